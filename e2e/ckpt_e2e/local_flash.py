"""Flash checkpoints inside one test process: a node's sidecar on a thread, and the bitwise
comparison of two training states.

:func:`sidecar_thread` runs a :class:`~ckpt_agent.flash.sidecar.Sidecar` loop on a daemon
thread of the caller (as a pod's sidecar container beside the trainer) until the block
ends; :func:`same_state` says whether two state trees (model and optimizer state dicts,
nested lists and dicts) are bitwise equal: every tensor the same dtype and
``torch.equal``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions
from ckpt_agent.policy import AgentConfig

__all__ = ["same_state", "sidecar_thread"]


@contextmanager
def sidecar_thread(config: AgentConfig, options: SidecarOptions | None = None) -> Iterator[Sidecar]:
    """A sidecar serving ``config``'s shared memory from a thread, stopped and closed after."""
    sidecar = Sidecar(config, options or SidecarOptions(metrics_port=0, poll_s=0.01))
    stop = threading.Event()
    thread = threading.Thread(target=sidecar.run, kwargs={"until": stop.is_set}, daemon=True)
    thread.start()
    try:
        yield sidecar
    finally:
        stop.set()
        thread.join(30)
        sidecar.close()


def same_state(a: Any, b: Any) -> bool:
    """Bitwise equality of two state trees (tensors by dtype and ``torch.equal``)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same_state(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)
