"""ckpt_agent: the in-pod checkpointing agent.

The public surface::

    from ckpt_agent import Checkpointer

    ckpt = Checkpointer(model=model, optimizer=opt)
    start = ckpt.start()                  # restores everything when there is a checkpoint
    for step in range(start.step, total_steps):
        loss = train_step(...)
        ckpt.step(step, loss.item())      # observes, decides, snapshots when due
    ckpt.close()

Importing this package is cheap and torch-free: :class:`Checkpointer` and
:class:`ResumePoint` (which need torch) are loaded on first access. The operator
imports only the torch-free layers (``policy``, ``records``, ``decide``,
``format``, ``persist``, ``storage``); ``docs/architecture.md`` lists the layers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckpt_agent.errors import (
    CheckpointError,
    CkptError,
    PermanentError,
    PersistError,
    ResumeError,
    RetryableError,
)
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.version import __version__

if TYPE_CHECKING:
    from ckpt_agent.runtime.checkpointer import Checkpointer
    from ckpt_agent.runtime.restore.resume_point import ResumePoint

__all__ = [
    "AgentConfig",
    "CheckpointError",
    "Checkpointer",
    "CkptError",
    "PermanentError",
    "PersistError",
    "ResumeError",
    "ResumePoint",
    "RetryableError",
    "__version__",
]

_LAZY = {
    "Checkpointer": "ckpt_agent.runtime.checkpointer",
    "ResumePoint": "ckpt_agent.runtime.restore.resume_point",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
