"""ckpt_operator: the Kubernetes operator (kopf) of ckpt-operator.

Layers (higher import lower, never the reverse; enforced by review and by
import-linter's "no torch" contract):

* ``main`` (CLI, kopf settings) → ``handlers`` (kopf glue) → ``service``
  (async orchestration) and ``loops`` (background schedulers);
* ``kube`` (the only module calling the Kubernetes API), ``sources`` (the only
  storage I/O), ``webhook``, ``certs``, ``metrics``, ``events``;
* pure builders and planners, no I/O: ``injection``, ``restart``,
  ``disruption``, ``retention_reconcile``, ``status``, ``validation``,
  ``jobs``, ``jsonpatch``, ``constants``, ``config``.
"""

__version__ = "0.1.0"
