"""The fault-injection suite (FIT): named failure scenarios and a random-crash campaign.

``python -m ckpt_e2e.fit --list`` (or ``scripts/ckpt-fit``) runs them; each scenario
starts real training processes (and the real control plane where the fault involves
the operator), injects its fault, lets the system recover on its own and checks the
pass criteria of :mod:`ckpt_e2e.fit.core`.
"""
