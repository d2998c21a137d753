"""The restore path: choosing the resume point, preflight checks, applying a checkpoint
(:class:`~ckpt_agent.runtime.restore.restorer.Restorer`) and what a resume writes and reads
besides the checkpoint (:mod:`~ckpt_agent.runtime.restore.bookkeeping`).

Independent of :mod:`ckpt_agent.runtime.save` (an import contract says so).
"""
