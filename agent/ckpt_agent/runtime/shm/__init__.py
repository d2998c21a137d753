"""Shared memory (flash checkpoints): the writer, this rank's
:class:`~ckpt_agent.runtime.shm.target.FlashTarget`, the shared-memory persister and the
in-place restart that restores from shared memory
(:mod:`~ckpt_agent.runtime.shm.in_place`). Above the save and restore paths.
"""
