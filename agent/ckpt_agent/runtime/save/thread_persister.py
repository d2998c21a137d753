"""In-process persisting: host-buffer snapshots, a persister thread, rank 0's validator thread.

:class:`ThreadPersister` copies the state into reusable host buffers
(:mod:`ckpt_agent.runtime.save.snapshot`) on the training thread, then its
persister thread chunks, hashes, de-duplicates, compresses and writes it and
publishes the manifest and the ``COMMIT`` (:mod:`ckpt_agent.persist.writer`;
with several ranks through the two-phase commit). On rank 0 a validator
thread then runs the post-commit pipeline
(:class:`~ckpt_agent.persist.finalize.FinalizePipeline`: load-check, verdict,
catalog, retention, blob GC).

Threads and what each owns: the training thread calls every
:class:`~ckpt_agent.runtime.save.persister.Persister` method and takes the snapshot;
the persister thread (``ckpt-persist-<rank>``) owns the rank's
:class:`~ckpt_agent.runtime.save.chain.HashChain` (it builds each manifest from it and
advances it after the commit) and the ``committed``/byte counters of the engine's stats;
the validator thread (``ckpt-validate-0``) owns the finalize pipeline's counters
(seeded once by :meth:`ThreadPersister.start`, before it runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from ckpt_agent import tuning
from ckpt_agent.decide.decision import Decision, SaveOutcome
from ckpt_agent.decide.retention import classify
from ckpt_agent.format.manifest import CheckpointMeta, CommitManifest
from ckpt_agent.persist.finalize import FinalizeJob
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine, Handover
from ckpt_agent.runtime.core.serialization import LiveArray, flatten, library_versions
from ckpt_agent.runtime.dist.commit import TwoPhaseCommit
from ckpt_agent.runtime.dist.rank_group import RankGroup
from ckpt_agent.runtime.save.chain import HashChain
from ckpt_agent.runtime.save.snapshot import (
    BackgroundWorker,
    HostArena,
    JobError,
    Snapshot,
    take_snapshot,
)

__all__ = ["ThreadPersister"]


@dataclass
class _PersistJob:
    snapshot: Snapshot
    decision: Decision
    submitted: float


class ThreadPersister:
    """The in-process :class:`~ckpt_agent.runtime.save.persister.Persister` (see the module doc)."""

    def __init__(
        self,
        engine: Engine,
        capture: StateCapture,
        group: RankGroup | None,
        *,
        approximate_threshold: float | None,
    ) -> None:
        self.engine = engine
        self.capture = capture
        self.group = group
        self.approximate_threshold = approximate_threshold
        self.arena = HostArena()
        self._committer: TwoPhaseCommit | None = None
        self._chain: HashChain | None = None
        """The persister thread's (made in :meth:`start`, before that thread exists)."""
        self._worker: BackgroundWorker[_PersistJob] | None = None
        self._post: BackgroundWorker[FinalizeJob] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, handover: Handover) -> None:
        ranks = self.engine.ranks
        self._chain = HashChain(handover)
        self.engine.finalizer.seed_last_valid_step(handover.last_valid_step)
        if self.group is not None and self.group.commit_comm is not None:
            self._committer = TwoPhaseCommit(self.group.commit_comm, self.engine.parts.writer)
        if not ranks.writes:
            return
        self._worker = BackgroundWorker(
            f"ckpt-persist-{ranks.rank}",
            self._persist,
            capacity=1,
            describe=lambda j: f"persisting {j.snapshot.tier.value} of step {j.snapshot.step}",
            tier_of=lambda j: j.snapshot.tier,
        )
        if ranks.coordinator:
            self._post = BackgroundWorker(
                f"ckpt-validate-{ranks.rank}",
                self._finalize,
                capacity=tuning.VALIDATION_BACKLOG,
                describe=lambda j: f"validating {j.checkpoint_id}",
            )

    def prepare(self, step: int) -> Callable[[], None] | None:
        # fresh containers of references (state_dict()), walked later: only their shapes
        sections = self.capture.sections(lightweight=False, step=step)
        return partial(self._reserve, sections)

    def _reserve(self, sections: dict[str, object]) -> None:
        live: dict[str, LiveArray] = {}
        for name, value in sections.items():
            flatten(value, name, live)
        self.arena.reserve(list(live.values()))

    def close(self, timeout: float | None) -> None:
        if self._worker is not None:
            self._worker.close(timeout)
        if self._post is not None:
            self._post.close(timeout)

    # ------------------------------------------------------------------ state

    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.busy

    def wait_free(self) -> None:
        if self._worker is not None:
            self._worker.wait_idle()

    def wait_persisted(self, timeout: float | None = None) -> bool:
        return self._worker.wait_idle(timeout) if self._worker is not None else True

    def wait_validated(self, timeout: float | None = None) -> bool:
        return self._post.wait_idle(timeout) if self._post is not None else True

    def poll(self) -> None:
        return None

    def take_errors(self) -> list[JobError]:
        errs: list[JobError] = []
        for w in (self._worker, self._post):
            if w is not None:
                errs.extend(w.take_errors())
        return errs

    def system_signals(self) -> tuple[int | None, float | None]:
        return None, None

    # ------------------------------------------------------------------ training thread

    def save(self, decision: Decision, files: dict[str, bytes]) -> str | None:
        assert self._worker is not None and decision.tier is not None
        tier, step = decision.tier, decision.step
        approx = None if decision.lightweight else self.approximate_threshold
        snap = take_snapshot(
            step,
            tier,
            self.capture.sections(lightweight=decision.lightweight, step=step),
            self.arena,
            files=files,
            approx_threshold=approx,
        )
        self.engine.book_snapshot(
            decision, snap.stall_s, bytes=snap.nbytes, approximate=snap.approximate
        )
        ok = self._worker.submit(_PersistJob(snap, decision, time.perf_counter()))
        assert ok, "persister accepted no job although idle"
        return checkpoint_id(tier, step)

    # ------------------------------------------------------------------ persister thread

    def _persist(self, job: _PersistJob) -> None:
        e, chain = self.engine, self._chain
        assert chain is not None
        snap, d = job.snapshot, job.decision
        meta = CheckpointMeta(
            run_id=e.run_id,
            step=snap.step,
            tier=snap.tier,
            world_size=e.ranks.world_size if self._committer is not None else 1,
            created_at=time.time(),
            score=d.score,
            components=dict(d.components),
            retention_class=classify(d.score, e.config.retention),
            reason=d.reason,
            anomaly=d.anomaly,
            lightweight=d.lightweight,
            approximate=snap.approximate,
            emergency=d.emergency,
            prev_hash=chain.prev_hash,
            sections=tuple(snap.tree),
            versions=library_versions(),
            lineage=chain.lineage,
        )
        commit: CommitManifest | None
        if self._committer is not None:  # every rank its part; rank 0 commits when all verified
            with e.store_lock:
                result = self._committer.run(meta, snap.tree, snap.sources(), snap.files)
            written, manifest_hash = result.written, result.manifest_hash
            commit = result.checkpoint.commit if result.checkpoint is not None else None
            size_bytes = result.size_bytes if commit is not None else written.bytes_new
            counts = (result.checkpoint or written).byte_counts()  # all ranks' on rank 0
        else:
            with e.store_lock:
                writer = e.parts.writer
                written = writer.write_rank(meta, 0, snap.tree, snap.sources(), snap.files)
                committed = writer.commit(meta, [written])
            manifest_hash, size_bytes = committed.manifest_hash, committed.size_bytes
            commit = committed.commit
            counts = committed.byte_counts()
        persist_s = time.perf_counter() - job.submitted
        chain.advance(manifest_hash)
        tier = snap.tier.value
        e.metrics.save_latency.labels(tier=tier).observe(persist_s)
        e.metrics.bytes_written.labels(tier=tier).inc(size_bytes)
        e.metrics.bytes_reused.labels(tier=tier).inc(written.bytes_reused)
        e.stats.committed += 1
        e.stats.bytes_written += size_bytes
        e.stats.bytes_reused += written.bytes_reused
        e.feedback.put(SaveOutcome.persisted(snap.tier, persist_s))
        if commit is not None:
            record = commit.record(manifest_hash, CheckpointStatus.PENDING)
            record = replace(record, size_bytes=size_bytes)
            e.catalog.upsert(
                e.run_id, record, timings={"stall_s": snap.stall_s, "persist_s": persist_s}
            )
        e.event(
            "committed",
            checkpoint=meta.checkpoint_id,
            step=snap.step,
            tier=snap.tier,
            persist_s=round(persist_s, 6),
            **counts,
            blobs_new=written.blobs_new,
            blobs_reused=written.blobs_reused,
            manifest_hash=manifest_hash,
            timings={k: round(v, 6) for k, v in written.timings.items()},
        )
        if self._post is None:
            return  # validation, retention and GC are rank 0's
        self._post.wait_below(tuning.VALIDATION_BACKLOG)
        self._post.submit(
            FinalizeJob(
                checkpoint_id=meta.checkpoint_id,
                tier=snap.tier,
                step=snap.step,
                manifest_hash=manifest_hash,
                world_size=meta.world_size,
                lightweight=d.lightweight,
                expected=snap.expected,
            )
        )

    # ------------------------------------------------------------------ validator thread

    def _finalize(self, job: FinalizeJob) -> None:
        self.engine.finalizer.finalize(job)
