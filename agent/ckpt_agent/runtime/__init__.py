"""The training process's side (torch): :class:`~ckpt_agent.runtime.checkpointer.Checkpointer`
as a facade over the sub-packages, top to bottom (an import contract keeps the order):
:mod:`~ckpt_agent.runtime.shm` (shared memory), :mod:`~ckpt_agent.runtime.save` and
:mod:`~ckpt_agent.runtime.restore` (independent of each other), :mod:`~ckpt_agent.runtime.dist`
(several ranks) and :mod:`~ckpt_agent.runtime.core` (what they all share).
"""
