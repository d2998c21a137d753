"""Optional TensorBoard scalars of the scheduler (``checkpoint/score``, ``checkpoint/interval``).

Runtime-only: it imports torch's TensorBoard writer, which the torch-free layers
(:mod:`ckpt_agent.metrics` is one) must not.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

__all__ = ["TensorBoard"]

log = logging.getLogger(__name__)


class TensorBoard:
    """``checkpoint/score`` and ``checkpoint/interval`` scalars, when tensorboard is installed."""

    def __init__(self, logdir: str | Path) -> None:
        self._writer: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        try:
            self._writer = SummaryWriter(log_dir=str(logdir))
        except Exception:  # pragma: no cover - tensorboard present but broken
            log.warning("TensorBoard writer could not start", exc_info=True)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def scalars(self, step: int, score: float, interval: int) -> None:
        if self._writer is not None:
            self._writer.add_scalar("checkpoint/score", score, step)
            self._writer.add_scalar("checkpoint/interval", interval, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
