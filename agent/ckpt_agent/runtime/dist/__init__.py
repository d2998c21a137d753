"""Several ranks: the agent's own agreement and two-phase commit over a
:class:`~ckpt_agent.runtime.dist.agreement.Comm`, and the
:class:`~ckpt_agent.runtime.dist.rank_group.RankGroup` that runs them for the checkpointer.
"""
