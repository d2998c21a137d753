"""ckpt_operator: the Kubernetes operator (kopf) of ckpt-operator.

One folder per layer; a layer imports only the layers below it, never the reverse
(import-linter's "Operator layers" contracts in ``pyproject.toml``):

* ``app`` — wiring: ``main`` (CLI, kopf settings) → ``handlers`` (kopf callbacks) →
  ``loops`` (background schedulers), ``webhook_server`` (the HTTPS server);
* ``behaviours`` — what the operator does, async, one module per behaviour (``admission``,
  ``policies``, ``recovery``, ``attempts``, ``disruption``, ``retention``, ``agentcheck``),
  over ``deps``;
* ``adapters`` — the I/O, one module per outside thing: ``kube`` (the only module calling the
  Kubernetes API), ``caches``, ``sources`` (the only storage I/O), ``events``, ``metrics``,
  ``certs``, ``agentprobe``; they never import each other;
* ``planners`` — pure decisions and builders, no I/O (``injection``, ``restart``,
  ``attempt_plan``, ``manual``, ``agent_presence``, ``disruption_signals``, ``retention_plan``,
  ``status``, ``validation``, ``tenancy``, ``reports``, ``runfacts``, ``pools``);
* ``kinds`` — the job kinds (``kind.JobKind``, ``pytorchjob``, ``trainjob``, ``registry``);
* ``model`` — the vocabulary everything shares: ``jobs`` (reading job objects),
  ``jsonpatch``, ``constants``, ``config`` (settings).
"""

__version__ = "0.1.0"
