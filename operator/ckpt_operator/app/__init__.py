"""Wiring: the ``ckpt-operator`` command, the kopf handlers, background loops, the webhook
server. The top layer: nothing in the operator imports it."""
