"""The post-commit pipeline: validate → verdict → catalog → retention → blob GC.

One home for what happens to a checkpoint after its ``COMMIT`` is published,
used by both persisters: the trainer's validator thread
(:class:`~ckpt_agent.runtime.checkpointer.Checkpointer`) and the coordinating
sidecar (:mod:`ckpt_agent.flash.sidecar`).

.. code-block:: python

    pipeline = FinalizePipeline(storage, run_id, validator=v, catalog=c, index=i,
                                retention=config.retention, metrics=m, emit=events)
    result = pipeline.finalize(FinalizeJob(ckpt_id, tier, step, manifest_hash,
                                           world_size=2, expected=shapes))

:meth:`FinalizePipeline.finalize` load-checks every rank's part (rank 0's shapes
against ``expected``), records the verdict next to the checkpoint
(``ValidationVerdict``) and in the catalog, counts it in the metrics, emits
``validated``/``corrupted``, drops (and deletes) blobs that fail their hash, then
applies the retention policy and collects unreferenced blobs (``retention``
event). Torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckpt_agent.decide.retention import RetentionPlan, plan_retention
from ckpt_agent.errors import CheckpointFormatError, StorageError
from ckpt_agent.format.fence import Fence
from ckpt_agent.format.layout import blob_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.termination import TerminationLog
from ckpt_agent.metrics import Metrics
from ckpt_agent.persist.catalog import Catalog
from ckpt_agent.persist.housekeeping import GcResult, ManifestCache, apply_retention, gc_blobs
from ckpt_agent.persist.validate import TensorMeta, ValidationOutcome, Validator
from ckpt_agent.persist.writer import BlobIndex
from ckpt_agent.policy.models import RetentionSpec, Tier
from ckpt_agent.records import AnomalyEvent, CheckpointRecord, CheckpointStatus
from ckpt_agent.storage.base import Storage
from ckpt_agent.text import clean
from ckpt_agent.tuning import gc_grace_for

__all__ = [
    "AnomalySource",
    "EventSink",
    "FinalizeJob",
    "FinalizePipeline",
    "FinalizeResult",
    "RetentionResult",
    "anomalies_from_records",
]

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Where the pipeline's events go (the caller's decision/event log)."""

    def __call__(self, event: str, **fields: Any) -> None: ...


#: The anomalies retention protects checkpoints before (given the listed records).
AnomalySource = Callable[[Sequence[CheckpointRecord]], Sequence[AnomalyEvent]]


def anomalies_from_records(pulse_interval: int) -> AnomalySource:
    """Anomalies as recorded on the checkpoints themselves (a persister without a scheduler)."""

    def source(records: Sequence[CheckpointRecord]) -> list[AnomalyEvent]:
        return [
            AnomalyEvent(step=r.step, kind=r.anomaly, resolved_step=r.step + pulse_interval)
            for r in records
            if r.anomaly
        ]

    return source


def _no_events(event: str, **fields: Any) -> None:
    del event, fields


@dataclass
class FinalizeJob:
    """One committed checkpoint to finalize."""

    checkpoint_id: str
    tier: Tier
    step: int
    manifest_hash: str
    """The COMMIT's hash as written (a different one at validation means it changed)."""
    world_size: int = 1
    lightweight: bool = False
    expected: TensorMeta | None = None
    """``name → (dtype, shape)`` of rank 0's tensors (None: no shape check)."""
    has_weights: bool = True


@dataclass
class RetentionResult:
    """What one retention + GC pass deleted."""

    plan: RetentionPlan
    deleted: list[str] = field(default_factory=list)
    gc: GcResult = field(default_factory=GcResult)
    kept: list[CheckpointRecord] = field(default_factory=list)
    """The run's checkpoints after the pass (as listed before it, less ``deleted``)."""


@dataclass
class FinalizeResult:
    """The verdict and what retention did (None: it failed and errors are tolerated)."""

    outcome: ValidationOutcome
    retention: RetentionResult | None = None


class FinalizePipeline:
    """Validate, record and clean up after committed checkpoints of one run (module doc).

    Args:
        storage, run_id: where the checkpoints are.
        validator, catalog, index: the caller's validator, local catalog and blob index
            (blobs found corrupted or collected are forgotten by the index).
        retention: the policy's retention section.
        metrics: the caller's metrics (``ckpt_validation_seconds``, ``ckpt_checkpoints_total``,
            ``ckpt_last_valid_step``).
        emit: the caller's event sink (``validated``, ``corrupted``, ``retention``).
        anomalies: the anomalies retention honours (default: none).
        gc_grace_s: blob-GC grace; None: :func:`~ckpt_agent.tuning.gc_grace_for` the job's
            world size.
        store_lock: held around storage writes (shared with the caller's writer).
        tolerate_retention_errors: a storage/format error in retention is logged, not raised.
        report: the container's termination message, rewritten with the run's checkpoints
            after every validation verdict, from the retention pass that follows it (or the
            catalog when that pass fails) (:mod:`ckpt_agent.format.termination`).
    """

    def __init__(
        self,
        storage: Storage,
        run_id: str,
        *,
        validator: Validator,
        catalog: Catalog,
        index: BlobIndex,
        retention: RetentionSpec,
        metrics: Metrics,
        emit: EventSink | None = None,
        anomalies: AnomalySource | None = None,
        gc_grace_s: float | None = None,
        store_lock: threading.Lock | None = None,
        tolerate_retention_errors: bool = False,
        report: TerminationLog | None = None,
    ) -> None:
        self.storage = storage
        self.run_id = run_id
        self.validator = validator
        self.catalog = catalog
        self.index = index
        self.retention = retention
        self.metrics = metrics
        self.emit: EventSink = emit or _no_events
        self.anomalies: AnomalySource = anomalies or (lambda records: ())
        self.gc_grace_s = gc_grace_s
        self.store_lock = store_lock or threading.Lock()
        self.tolerate_retention_errors = tolerate_retention_errors
        self.report = report
        self.gc_cache = ManifestCache()
        #: The writer generation this process holds (set at start; None: no fencing).
        self.fence: Fence | None = None
        self.last_valid_step = -1
        """Newest valid weights checkpoint's step (:meth:`seed_last_valid_step` on resume;
        then written by the thread that runs :meth:`finalize` only)."""
        self.valid = 0
        self.corrupted = 0

    def seed_last_valid_step(self, step: int) -> None:
        """The newest valid weights step a resume found in storage (-1: none), before the
        first :meth:`finalize`: the one hand-over from the restore side; from then on only
        the finalizing thread counts."""
        self.last_valid_step = step

    # ------------------------------------------------------------------ the call

    def finalize(self, job: FinalizeJob) -> FinalizeResult:
        """Validate ``job``, record the verdict, apply retention and collect blobs.

        With a :attr:`fence`, a fenced writer stops here (:class:`FencedError`): it writes
        no verdict and deletes nothing; retention and blob GC check it before each batch
        of deletes, after their listing (an object a newer writer wrote is listed only
        after that writer's claim, so the check sees the claim)."""
        if self.fence is not None:
            self.fence.check()
        outcome = self.validate(job)
        self.record(
            outcome,
            job.tier,
            job.step,
            has_weights=job.has_weights,
            lightweight=job.lightweight,
        )
        grace = self.gc_grace_s if self.gc_grace_s is not None else gc_grace_for(job.world_size)
        if not self.tolerate_retention_errors:
            return self._reported(FinalizeResult(outcome, self.apply_retention(grace)))
        try:
            return self._reported(FinalizeResult(outcome, self.apply_retention(grace)))
        except (StorageError, CheckpointFormatError) as e:
            log.warning("retention after %s failed: %s", clean(job.checkpoint_id), clean(e))
            return self._reported(FinalizeResult(outcome, None))

    def _reported(self, result: FinalizeResult) -> FinalizeResult:
        """Rewrite the termination-message report with the verdict: from what retention kept
        (the storage's listing), or from the catalog when retention failed."""
        if self.report is not None:
            retention = result.retention
            kept = retention.kept if retention is not None else self.catalog.records(self.run_id)
            self.report.write(self.run_id, kept)
        return result

    # ------------------------------------------------------------------ steps

    def validate(self, job: FinalizeJob) -> ValidationOutcome:
        """Load-check every rank's part; the verdict of the first failing rank wins."""
        outcome = self.validator.validate(job.checkpoint_id, job.expected)
        outcome.expected_hash = job.manifest_hash  # recorded only while that COMMIT is there
        for r in range(1, job.world_size):  # every rank's part is loaded and checked
            other = self.validator.validate(job.checkpoint_id, None, rank=r)
            outcome.duration_s += other.duration_s
            outcome.bad_blobs.extend(other.bad_blobs)
            if outcome.valid and not other.valid:
                outcome.status = other.status
                outcome.reason = f"rank {r}: {other.reason}"
        if outcome.manifest_hash and outcome.manifest_hash != job.manifest_hash:
            outcome.status = CheckpointStatus.CORRUPTED
            outcome.reason = "the COMMIT changed after it was written: " + (outcome.reason or "")
        return outcome

    def record(
        self,
        outcome: ValidationOutcome,
        tier: Tier,
        step: int,
        *,
        has_weights: bool = True,
        lightweight: bool = False,
    ) -> None:
        """Write the verdict (storage, catalog, metrics, event); self-heal bad blobs."""
        try:
            if not self.validator.record(outcome):
                return  # judged or removed while validated (expired, deleted): that stands
        except StorageError as e:
            log.warning(
                "could not record the verdict on %s: %s", clean(outcome.checkpoint_id), clean(e)
            )
        self.catalog.set_status(
            self.run_id,
            outcome.checkpoint_id,
            outcome.status,
            outcome.reason,
            validate_s=outcome.duration_s,
        )
        self.metrics.validation.observe(outcome.duration_s)
        self.metrics.checkpoints.labels(tier=tier.value, status=outcome.status.value).inc()
        if outcome.valid:
            self.valid += 1
            if has_weights and not lightweight and step > self.last_valid_step:
                self.last_valid_step = step
                self.metrics.last_valid_step.set(step)
            self.emit(
                "validated",
                checkpoint=outcome.checkpoint_id,
                status="valid",
                seconds=round(outcome.duration_s, 6),
                checks=outcome.checks,
            )
            return
        self.corrupted += 1
        log.error(
            "ALERT checkpoint %s is CORRUPTED and will never be offered for resume: %s",
            clean(outcome.checkpoint_id),
            clean(outcome.reason),
        )
        self.emit(
            "corrupted",
            checkpoint=outcome.checkpoint_id,
            status=outcome.status.value,
            reason=outcome.reason,
            seconds=round(outcome.duration_s, 6),
            bad_blobs=outcome.bad_blobs,
            checks=outcome.checks,
        )
        if outcome.bad_blobs:
            # Self-heal: a blob that does not hash to its name is useless to everyone;
            # drop it so that the next save writes it again instead of re-using it.
            with self.store_lock:
                self.index.forget(outcome.bad_blobs)
                if self.fence is not None:
                    self.fence.check()
                for digest in outcome.bad_blobs:
                    try:
                        self.storage.delete(blob_key(self.run_id, digest))
                    except StorageError:
                        log.warning("could not delete corrupted blob %s", clean(digest[:16]))

    def apply_retention(self, grace_s: float) -> RetentionResult:
        """Apply the retention policy, collect unreferenced blobs, update the catalog."""
        with self.store_lock:
            records = list_checkpoints(self.storage, self.run_id)
            anomalies = list(self.anomalies(records))
            plan = plan_retention(records, self.retention, anomalies, time.time())
            guard = self.fence.check if self.fence is not None else None
            deleted = apply_retention(self.storage, self.run_id, plan, guard=guard)
            gc = gc_blobs(
                self.storage, self.run_id, grace_s=grace_s, cache=self.gc_cache, guard=guard
            )
            if gc.deleted:
                self.index.forget(gc.deleted)
        by_id = {r.id: r for r in records}
        for cid in deleted:
            r = by_id.get(cid)
            why = f"deleted by retention: {plan.delete.get(cid, '')}"
            if r is not None and r.status == CheckpointStatus.CORRUPTED:
                reason = r.extra.get("status_reason", "")
                self.catalog.set_status(
                    self.run_id, cid, CheckpointStatus.CORRUPTED, f"{reason}; {why}"
                )
                continue
            self.catalog.set_status(self.run_id, cid, CheckpointStatus.EXPIRED, why)
            if r is not None:
                self.metrics.checkpoints.labels(tier=r.tier.value, status="expired").inc()
        if deleted or gc.deleted:
            self.emit(
                "retention",
                deleted={cid: plan.delete.get(cid, "") for cid in deleted},
                blobs_deleted=len(gc.deleted),
                bytes_freed=gc.freed_bytes,
                stale_folders=gc.stale_folders,
            )
        gone = set(deleted)
        kept = [r for r in records if r.id not in gone]
        return RetentionResult(plan=plan, deleted=deleted, gc=gc, kept=kept)
