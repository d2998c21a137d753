"""The validator's verdict on one committed checkpoint (the ``VALIDATION`` document).

Not a catalog record (:mod:`ckpt_agent.records`) and not the restore side's
bookkeeping: the one document the validator writes next to a checkpoint's
COMMIT, naming the COMMIT it judged. Reading it back is
:func:`ckpt_agent.format.readers.read_validation`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.layout import (
    FORMAT_VALIDATION,
    FORMAT_VERSION,
    VALIDATION,
    VALIDATION_MAX_BYTES,
    dumps,
    loads,
)
from ckpt_agent.format.schema import digest_field, optional_field, required_field
from ckpt_agent.records import CheckpointStatus

__all__ = ["ValidationVerdict"]


@dataclass(frozen=True)
class ValidationVerdict:
    """The validator's verdict on one committed checkpoint."""

    checkpoint_id: str
    commit_sha256: str
    """The COMMIT it judged (a rewritten checkpoint is judged anew)."""
    status: CheckpointStatus
    reason: str = ""
    validated_at: float = 0.0
    checks: tuple[str, ...] = ()
    duration_s: float = 0.0

    def to_bytes(self) -> bytes:
        return dumps(
            {
                "format": FORMAT_VALIDATION,
                "version": FORMAT_VERSION,
                "checkpoint_id": self.checkpoint_id,
                "commit_sha256": self.commit_sha256,
                "status": self.status.value,
                "reason": self.reason,
                "validated_at": self.validated_at,
                "checks": list(self.checks),
                "duration_s": self.duration_s,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, what: str = VALIDATION) -> ValidationVerdict:
        d = loads(data, what, VALIDATION_MAX_BYTES)
        if d.get("format") != FORMAT_VALIDATION:
            raise CheckpointFormatError(f"{what}: not a validation record")
        try:
            status = CheckpointStatus(required_field(d, "status", str, what))
        except ValueError:
            raise CheckpointFormatError(f"{what}: unknown status {d.get('status')!r}") from None
        checks = d.get("checks") or []
        return cls(
            checkpoint_id=required_field(d, "checkpoint_id", str, what),
            commit_sha256=digest_field(d.get("commit_sha256"), what),
            status=status,
            reason=str(optional_field(d, "reason", str, what) or ""),
            validated_at=float(optional_field(d, "validated_at", (int, float), what) or 0.0),
            checks=tuple(str(c) for c in checks) if isinstance(checks, list) else (),
            duration_s=float(optional_field(d, "duration_s", (int, float), what) or 0.0),
        )
