"""Optional TensorBoard scalars of the scheduler: ``checkpoint/score``,
``checkpoint/interval`` and ``checkpoint/tier``.

Pass your own ``SummaryWriter`` to :class:`~ckpt_agent.Checkpointer`
(``summary_writer=writer``) and the scalars land next to your training curves;
the checkpointer never closes a writer it did not open. Without one, a writer
under ``<work dir>/tensorboard`` is opened when the ``tensorboard`` package is
installed. Runtime-only: it imports torch's TensorBoard writer, which the
torch-free layers (:mod:`ckpt_agent.metrics` is one) must not.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from ckpt_agent.decide.decision import Decision
from ckpt_agent.decide.tiers import tier_rank

__all__ = ["ScalarWriter", "TensorBoard"]

log = logging.getLogger(__name__)


class ScalarWriter(Protocol):
    """What the checkpointer needs of a ``torch.utils.tensorboard.SummaryWriter``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...

    def close(self) -> Any: ...


class TensorBoard:
    """The scheduler's scalars of every step, to a user's writer or one of our own."""

    def __init__(self, logdir: str | Path, writer: ScalarWriter | None = None) -> None:
        self._writer: ScalarWriter | None = writer
        self._owned = False
        if writer is not None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        try:
            self._writer = SummaryWriter(log_dir=str(logdir))
            self._owned = True
        except Exception:  # pragma: no cover - tensorboard present but broken
            log.warning("TensorBoard writer could not start", exc_info=True)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def scalars(self, decision: Decision) -> None:
        """``checkpoint/score``, ``checkpoint/interval`` and ``checkpoint/tier`` (the tier
        saved at this step: -1 none, 0 heartbeat, 1 pulse, 2 full)."""
        if self._writer is None:
            return
        step = decision.step
        self._writer.add_scalar("checkpoint/score", decision.score, step)
        self._writer.add_scalar("checkpoint/interval", decision.interval, step)
        tier = decision.tier if decision.save else None
        self._writer.add_scalar("checkpoint/tier", tier_rank(tier), step)

    def close(self) -> None:
        """Close the writer if the checkpointer opened it (a user's writer stays open)."""
        if self._writer is not None and self._owned:
            self._writer.close()
        self._writer = None
