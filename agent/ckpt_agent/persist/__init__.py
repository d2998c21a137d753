"""Persisting (torch-free): write, validate, catalog, retention and GC of committed checkpoints.

``builder`` turns an :class:`~ckpt_agent.policy.AgentConfig` into the working parts;
``finalize`` is the one post-commit pipeline both persisters (the trainer's thread
and the flash sidecar) run.
"""
