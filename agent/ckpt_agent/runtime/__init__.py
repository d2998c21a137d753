"""The training process's side (torch): :class:`~ckpt_agent.runtime.checkpointer.Checkpointer`
as a facade over capture, save path, persisters, restorer, signals and multi-rank glue.
"""
