"""The save path: due saves (:mod:`~ckpt_agent.runtime.save.saving`), the
:class:`~ckpt_agent.runtime.save.persister.Persister` protocol and its in-process
implementation, host snapshots and background workers, signals and heartbeats.

Independent of :mod:`ckpt_agent.runtime.restore` (an import contract says so).
"""
