"""Waiting for the device-to-host copies a snapshot queued (every device, not just the current).

A snapshot copies CUDA tensors into host memory with ``non_blocking=True`` (pinned
buffers: asynchronous DMA on each tensor's device) and must wait for all of them
before the training thread may change a tensor again. ``torch.cuda.synchronize()``
without an argument waits for the *current* device only: a process whose state
lies on several GPUs (model parallel in one process) would return before the
other devices' copies landed. :func:`synchronize_copies` waits for every device
a snapshot touched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["cuda_devices", "synchronize_copies"]


def cuda_devices(values: Iterable[object]) -> set[torch.device]:
    """The CUDA devices of the tensors among ``values``."""
    return {v.device for v in values if isinstance(v, torch.Tensor) and v.device.type == "cuda"}


def synchronize_copies(values: Iterable[object]) -> None:
    """Wait until the copies queued from every CUDA tensor among ``values`` completed."""
    for device in sorted(cuda_devices(values), key=lambda d: d.index or 0):
        torch.cuda.synchronize(device)
