"""ckpt_operator: the Kubernetes operator (kopf) of ckpt-operator.

Layers (higher import lower, never the reverse; enforced by import-linter's
"Operator layers" contracts in ``pyproject.toml``):

* ``main`` (CLI, kopf settings) → ``handlers`` (kopf glue) →
* ``behaviours`` (async orchestration, one module per behaviour: ``admission``,
  ``policies``, ``recovery``, ``disruption``, ``retention``, over ``deps``),
  ``loops`` (background schedulers) and ``webhook`` (the HTTPS server) →
* adapters: ``kube`` (the only module calling the Kubernetes API), ``sources``
  (the only storage I/O), ``events``, ``metrics``, ``certs`` →
* pure builders and planners, no I/O: ``injection``, ``restart``,
  ``disruption``, ``retention_reconcile``, ``status``, ``validation`` →
  ``jobs``, ``jsonpatch`` → ``constants``, ``config``.
"""

__version__ = "0.1.0"
