"""What a resume writes and reads in storage besides the checkpoint itself.

The pending ``RECOVER.json`` request of ``ckpt recover --manual`` (read, then
consumed with an audit entry), the verdicts found while resuming (validation
records and the catalog), the retirement of checkpoints past the resume
step (:func:`ckpt_agent.decide.lineage.superseded`), and the checkpoint report a start
that fails leaves in the termination message (:func:`report_failed_start`). Used by
:class:`~ckpt_agent.runtime.restore.restorer.Restorer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ckpt_agent.decide.lineage import superseded
from ckpt_agent.decide.recovery import plan_recovery, walk
from ckpt_agent.errors import (
    CheckpointFormatError,
    NotFoundError,
    ResumeError,
    RetryableError,
    StorageError,
    UnsafePathError,
)
from ckpt_agent.format.layout import (
    RECOVER_MAX_BYTES,
    loads,
    recover_request_key,
    validation_key,
)
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_capped
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.housekeeping import append_audit, who
from ckpt_agent.persist.verdicts import write_verdict
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.text import clean

__all__ = [
    "consume_recover_request",
    "read_recover_request",
    "record_verdict",
    "report_failed_start",
    "retire_newer",
]

log = logging.getLogger(__name__)


def read_recover_request(e: Engine) -> dict[str, Any] | None:
    """The pending ``RECOVER.json`` of ``ckpt recover --manual`` (None: there is none).

    Read capped at :data:`RECOVER_MAX_BYTES` and parsed with the format's bounded
    parser: an oversized, malformed or deeply nested one is a :class:`ResumeError`.
    """
    key = recover_request_key(e.run_id)
    try:
        req: dict[str, Any] = loads(read_capped(e.storage, key, RECOVER_MAX_BYTES), key)
    except NotFoundError:
        return None
    except (CheckpointFormatError, UnsafePathError) as err:
        raise ResumeError(f"{err}: delete {key} or rerun `ckpt recover`") from None
    if not isinstance(req.get("checkpoint_id"), str):
        raise ResumeError(f"{key} names no checkpoint_id: delete it or rerun `ckpt recover`")
    return req


def consume_recover_request(
    e: Engine,
    request: dict[str, Any],
    checkpoint_id: str | None,
    next_step: int,
    *,
    applied: bool = True,
) -> None:
    """Delete the request once applied (or found applied already: its lineage has commits)."""
    append_audit(
        e.storage,
        e.run_id,
        {
            "time": time.time(),
            "who": who(),
            "what": "manual recovery applied" if applied else "manual recovery already applied",
            "checkpoint": checkpoint_id,
            "request": request,
            "next_step": next_step,
        },
    )
    e.storage.delete(recover_request_key(e.run_id))


def record_verdict(
    e: Engine,
    rec: CheckpointRecord,
    status: CheckpointStatus,
    reason: str,
    seconds: float,
    manifest_hash: str | None = None,
) -> None:
    """Record a verdict found while resuming (in storage and in the catalog), unless the
    checkpoint was judged final or removed meanwhile (:func:`write_verdict`: that stands)."""
    mh = manifest_hash or rec.manifest_hash
    if mh and e.ranks.coordinator:
        verdict = ValidationVerdict(
            checkpoint_id=rec.id,
            commit_sha256=mh,
            status=status,
            reason=reason,
            validated_at=time.time(),
            checks=("hashes", "load (resume)", "shapes"),
            duration_s=seconds,
        )
        try:
            if not write_verdict(e.storage, e.run_id, verdict, mh):
                return
        except StorageError as err:
            log.warning("could not record the verdict on %s: %s", clean(rec.id), clean(err))
    e.catalog.set_status(e.run_id, rec.id, status, reason, validate_s=seconds)
    e.metrics.checkpoints.labels(tier=rec.tier.value, status=status.value).inc()
    if status == CheckpointStatus.CORRUPTED:
        log.error("ALERT checkpoint %s is CORRUPTED: %s", clean(rec.id), clean(reason))
        e.event("corrupted", checkpoint=rec.id, reason=reason, during="resume")


def retire_newer(
    e: Engine,
    step: int,
    resumed_from: str,
    *,
    spare: Collection[str] = (),
    rejected: Mapping[str, str] | None = None,
) -> None:
    """Checkpoints past the resume step belong to an abandoned branch: mark them expired.

    (Otherwise a later crash could resume from the branch this resume
    deliberately left — e.g. a manual rewind past a loss spike.) ``spare``: the ones a
    ladder resume did not try (:func:`ckpt_agent.decide.lineage.untried`), left as they
    are; ``rejected``: why the ones it tried were rejected (said in their verdict).
    """
    if not e.ranks.coordinator:
        return
    listed = list_checkpoints(e.storage, e.run_id, include_heartbeat=False)
    why = rejected or {}
    for r in superseded(listed, step, spare=spare):
        reason = f"superseded: the run resumed from {resumed_from} (step {step})"
        if r.id in why:
            reason += f"; it was tried first and rejected: {why[r.id]}"
        e.storage.commit(
            validation_key(e.run_id, r.id),
            ValidationVerdict(
                checkpoint_id=r.id,
                commit_sha256=r.manifest_hash,
                status=CheckpointStatus.EXPIRED,
                reason=reason,
                validated_at=time.time(),
            ).to_bytes(),
        )
        e.catalog.set_status(e.run_id, r.id, CheckpointStatus.EXPIRED, reason)
        e.event("superseded", checkpoint=r.id, reason=reason)
    kept = sorted(r.id for r in listed if r.id in spare and r.step > step)
    if kept:
        log.warning(
            "resume from %s (step %d): %s newer but not tried (pending, or listed after the "
            "ladder chose); left as they are, not superseded",
            clean(resumed_from),
            step,
            clean(", ".join(kept)),
        )


def report_failed_start(
    e: Engine,
    records: Callable[[], list[CheckpointRecord]],
    usable: Callable[[str], bool] | None = None,
) -> None:
    """Before a start fails on a checkpoint it cannot restore: rewrite the termination
    report (:mod:`ckpt_agent.format.termination`) with ``records()`` — the run's
    checkpoints with the verdicts this start found.

    With ``usable`` (a resume pin failed: ``usable(id)`` loads and checks one candidate,
    recording its verdict), the candidates the recovery ladder would take instead are
    tried first, until one is usable: an operator that plans from the pods' reports
    (it cannot read the storage) then skips every bad checkpoint at its next restart,
    not one per crash loop. Best effort: a storage outage ends the probe.
    """
    if e.finalizer.report is None or not e.ranks.coordinator:
        return
    if usable is not None:
        try:
            walk(plan_recovery(records(), e.config.recovery), usable)
        except RetryableError as err:
            log.warning("probing the recovery ladder after a failed pin stopped: %s", clean(err))
    e.finalizer.report.write(e.run_id, records())
