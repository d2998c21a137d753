"""What :meth:`Checkpointer.start` returns (:class:`ResumePoint`), rank 0's choice the other
ranks restore exactly (:class:`ResumeRequest`) and the candidates a resume looks at
(:class:`Candidate`, :class:`Rejection`); see :mod:`.restorer`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.errors import RejectionKind, ResumeError
from ckpt_agent.format.heartbeat import Heartbeat
from ckpt_agent.format.manifest import lineage_from_json, lineage_to_json
from ckpt_agent.records import CheckpointRecord, Json, Lineage
from ckpt_agent.runtime.core.context import Handover
from ckpt_agent.runtime.core.serialization import LoadedState

__all__ = ["Candidate", "Rejection", "ResumePoint", "ResumeRequest"]


@dataclass(frozen=True)
class ResumePoint:
    """Where training continues, as returned by :meth:`Checkpointer.start`."""

    step: int
    """The next step to run (0 for a fresh start; checkpoint step + 1 after a resume)."""
    checkpoint_id: str | None = None
    """The checkpoint restored (None: fresh start)."""
    checkpoint_step: int | None = None
    action: str = "fresh"
    """``fresh``, ``resume``, ``resume_from`` (operator's choice), ``manual`` or
    ``rebuild_from_heartbeat``."""
    exact: bool = True
    """Bit-exact continuation (False: lightweight/approximate source or heartbeat rebuild)."""
    data_state: object = None
    """The saved data position (applied to ``dataloader_state`` if it has ``load_state_dict``)."""
    epoch: int | None = None
    train_config: dict[str, Any] | None = None
    """The saved ``train_config.json`` when the source is a full checkpoint."""
    reason: str = ""
    rejected: tuple[tuple[str, str], ...] = ()
    """Checkpoints tried and rejected on the way, with why."""
    warnings: tuple[str, ...] = ()
    lineage: Lineage = field(default_factory=Lineage)
    """The resume lineage the run's next checkpoints carry."""
    prev_hash: str | None = None
    """The manifest hash the run's next checkpoint links to (the restored checkpoint's;
    None after a fresh start)."""
    last_valid_step: int = -1
    """The newest valid weights checkpoint in storage when the resume chose (-1: none)."""

    @property
    def resumed(self) -> bool:
        return self.checkpoint_id is not None

    def handover(self) -> Handover:
        """What the save side continues from (handed over once, :meth:`Persister.start
        <ckpt_agent.runtime.save.persister.Persister.start>`)."""
        return Handover(
            prev_hash=self.prev_hash,
            lineage=self.lineage,
            checkpoint_step=self.checkpoint_step,
            last_valid_step=self.last_valid_step,
        )

    def event_fields(self) -> dict[str, Any]:
        """What the ``start`` event of the decision log says about this resume."""
        return {
            "action": self.action,
            "checkpoint": self.checkpoint_id,
            "next_step": self.step,
            "exact": self.exact,
            "reason": self.reason,
            "rejected": [list(r) for r in self.rejected],
            "lineage": {"epoch": self.lineage.epoch, "pins": list(self.lineage.pins)},
        }


@dataclass(frozen=True)
class ResumeRequest:
    """Rank 0's choice, restored exactly on another rank
    (:meth:`~ckpt_agent.runtime.restore.restorer.Restorer.resume_point`)."""

    checkpoint_id: str
    """The checkpoint rank 0 restored."""
    weights_from: str | None = None
    """The weights source of a heartbeat rebuild (None: the checkpoint holds its weights)."""
    action: str = "resume"
    """Rank 0's :attr:`ResumePoint.action` (``resume``, ``manual``, ...)."""
    lineage: Lineage | None = None
    """Rank 0's resume lineage (None: the restored checkpoint's own)."""

    def to_json(self) -> dict[str, Json]:
        """The request as rank 0 broadcasts it (:mod:`~ckpt_agent.runtime.restore.agreed`)."""
        return {
            "id": self.checkpoint_id,
            "weights_from": self.weights_from,
            "action": self.action,
            "lineage": None if self.lineage is None else lineage_to_json(self.lineage),
        }

    @classmethod
    def from_json(cls, msg: Mapping[str, Json]) -> ResumeRequest:
        cid = msg.get("id")
        if not isinstance(cid, str) or not cid:
            raise ResumeError(f"rank 0's resume choice names no checkpoint ({cid!r})")
        weights = msg.get("weights_from")
        raw = msg.get("lineage")
        return cls(
            checkpoint_id=cid,
            weights_from=None if weights is None else str(weights),
            action=str(msg.get("action") or "resume"),
            lineage=None if raw is None else lineage_from_json(raw, "rank 0's resume lineage"),
        )


@dataclass(frozen=True)
class Rejection:
    """Why a candidate was not restored: the kind decides, the reason is for people."""

    kind: RejectionKind
    reason: str


@dataclass
class Candidate:
    """A checkpoint loaded and checked during :meth:`Checkpointer.start`."""

    record: CheckpointRecord
    loaded: LoadedState | None = None
    heartbeat: Heartbeat | None = None
    manifest_hash: str = ""
    own: LoadedState | None = None
    """This rank's own part (rank > 0 of a multi-rank checkpoint): RNG, data position."""
    own_heartbeat: Heartbeat | None = None
    """This rank's RNG and data position at the checkpoint's very step, from its step
    heartbeat in shared memory: a rank that died before a just-in-time save
    (:mod:`ckpt_agent.runtime.shm.jit`). Exact, unlike a heartbeat rebuild."""
    checked: bool = False
    """Decoded in full and checked against the live objects (:mod:`.preflight`)."""
