"""Plain records shared by the catalog, retention, the recovery ladder and the operator.

No I/O and no torch here: the operator imports these too. A
:class:`CheckpointRecord` is what a committed manifest says about a
checkpoint, plus the status the catalog/validator assigned to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, TypeAlias

from ckpt_agent.policy.models import Tier

__all__ = [
    "AnomalyEvent",
    "CheckpointRecord",
    "CheckpointStatus",
    "Json",
    "Lineage",
    "RetentionClass",
    "checkpoint_id",
]

#: A JSON value (dict/list/str/int/float/bool/None) as parsed or about to be dumped;
#: ``Any`` keeps call sites simple. The one definition every layer imports.
Json: TypeAlias = Any

STEP_DIGITS = 12
RANK_DIGITS = 5


class CheckpointStatus(StrEnum):
    """Lifecycle of a checkpoint as seen by readers."""

    PENDING = "pending"
    """Committed, not yet validated. Never offered for resume."""
    VALID = "valid"
    """Hashes re-read, loaded in a separate process, shapes checked."""
    CORRUPTED = "corrupted"
    """Failed validation; never offered for resume."""
    EXPIRED = "expired"
    """Released by retention (deleted or about to be)."""


class RetentionClass(StrEnum):
    """Retention class by score."""

    CRITICAL = "critical"
    IMPORTANT = "important"
    ROUTINE = "routine"


def checkpoint_id(tier: Tier | str, step: int) -> str:
    """The checkpoint's name: tier and zero-padded global step (never wall-clock time).

    Zero padding makes text order and numeric order agree.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{Tier(tier).value}_step_{step:0{STEP_DIGITS}d}"


def rank_name(rank: int) -> str:
    return f"rank_{rank:0{RANK_DIGITS}d}"


@dataclass(frozen=True)
class Lineage:
    """Which resume lineage a checkpoint belongs to (see :mod:`ckpt_agent.decide.lineage`).

    Applying a resume pin (``CKPT_RESUME_FROM``, a ``RECOVER.json`` request)
    opens a new lineage: ``epoch`` one above every epoch in storage, ``pins``
    the keys of the pins it honours (the one applied first). A resume that
    follows the ladder continues the resumed checkpoint's lineage. The
    default is the run's original lineage (and what manifests written before
    lineages existed say).
    """

    epoch: int = 0
    """Pins applied on the way to this checkpoint (0: never pinned)."""
    pins: tuple[str, ...] = ()
    """Keys of the pins this lineage honours: ``CKPT_RESUME_FROM:<id>``,
    ``RECOVER.json:<request hash>``."""
    parent: str | None = None
    """The checkpoint the writing process resumed from (None: a fresh start)."""

    def same_lineage(self, other: Lineage) -> bool:
        """Same epoch and pins (the parent may differ: later restarts of the same lineage)."""
        return (self.epoch, self.pins) == (other.epoch, other.pins)


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint (all ranks of one step of one tier)."""

    id: str
    """``<tier>_step_<000000001200>``; unique within a run."""
    step: int
    """Global step the checkpoint captures (training resumes at ``step + 1``)."""
    tier: Tier
    """heartbeat, pulse or full."""
    status: CheckpointStatus = CheckpointStatus.VALID
    """Validation status."""
    score: float = 0.0
    """Scheduler score at the time of the save."""
    retention_class: RetentionClass | None = None
    """Class assigned when saved (derived from score when absent)."""
    size_bytes: int = 0
    """Bytes this checkpoint added to storage (new blobs + manifests)."""
    created_at: float = 0.0
    """Unix time the checkpoint was taken (its snapshot; the COMMIT follows, after retries
    as long as the storage needs)."""
    manifest_hash: str = ""
    """SHA-256 of the committed (global) manifest."""
    prev_hash: str | None = None
    """``manifest_hash`` of the previous weights checkpoint in the run (the chain)."""
    depends_on: tuple[str, ...] = ()
    """Checkpoint ids this one cannot be restored without."""
    anomaly: str | None = None
    """Anomaly flagged at this step (``nan``, ``loss_spike``, ``grad_anomaly``), if any."""
    lightweight: bool = False
    """Weights + RNG only (a gradient-anomaly pulse)."""
    approximate: bool = False
    """Written with the opt-in approximate optimizer filter: not bit-exact."""
    emergency: bool = False
    """Taken because of a system alarm / disruption signal."""
    world_size: int = 1
    """Ranks that contributed parts."""
    reason: str = ""
    """Why the scheduler saved it."""
    lineage: Lineage = field(default_factory=Lineage)
    """The resume lineage it belongs to."""
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Free-form annotations (never interpreted by the decision logic)."""

    @property
    def has_weights(self) -> bool:
        """Pulses and fulls carry model weights; heartbeats do not."""
        return self.tier in (Tier.PULSE, Tier.FULL)

    @property
    def resumable(self) -> bool:
        return self.status == CheckpointStatus.VALID

    def with_status(self, status: CheckpointStatus) -> CheckpointRecord:
        return replace(self, status=status)


@dataclass(frozen=True)
class AnomalyEvent:
    """A detected training anomaly (from the scheduler's decision log)."""

    step: int
    """Step at which it was detected."""
    kind: str
    """``nan``, ``loss_spike`` or ``grad_anomaly``."""
    resolved_step: int | None = None
    """Step from which the run is considered past it (None: still unresolved)."""
