"""Several ranks: pickle-free collectives (:mod:`~ckpt_agent.runtime.dist.comm`), the
per-step agreement (:mod:`~ckpt_agent.runtime.dist.agreement`), the two-phase commit
(:mod:`~ckpt_agent.runtime.dist.commit`) and the
:class:`~ckpt_agent.runtime.dist.rank_group.RankGroup` that runs them for the checkpointer.
"""
