"""What the operator does, one module per behaviour, as async functions over the API,
storage and the pure planners.

The kopf handlers (:mod:`ckpt_operator.app.handlers`) are one-liners over these;
these are thin too: read objects, call a pure builder/planner, write the
result, emit Events and metrics. All state lives on Kubernetes objects
(annotations, policy status) so any of them can be interrupted and re-run.

==================  =============================================================================
``deps``            :class:`~ckpt_operator.behaviours.deps.Deps` (what every behaviour needs),
                    the job status annotation write they share
``state``           what they remember between events (node signals, refused attempts, reported
                    pods, agent answers), behind named methods
``admission``       the webhooks: ``validate_policy``, ``inject_pod``
``policies``        ``reconcile_policy`` (ConfigMap, ``Ready``), ``write_policy_status``
                    (guarded write)
``recovery``        ``observe_job`` (bookkeeping), ``recover_job`` (plan → Events → recreate)
``attempts``        ``recover_trainjob``: a TrainJob's JobSet restart attempts (else ``recovery``)
``restart_steps``   what ``recovery`` and ``attempts`` share: the plan's inputs, giving up, Events
``agentcheck``      ``check_agents``: pods whose training code never started the agent
``disruption``      ``signal_pod``, ``signal_node`` (``ckpt.dev/save-now``)
``retention``       ``reconcile_retention`` (delete, collect blobs, report in the policy status)
==================  =============================================================================
"""
