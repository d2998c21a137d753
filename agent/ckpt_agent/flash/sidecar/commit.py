"""The coordinator's commit: gather every rank's part, verify, publish ``COMMIT``, finalize.

The sidecar serving rank 0 waits until every rank's part of a checkpoint is in
storage with the same save token, verifies each one against its hash, publishes
``COMMIT`` (claiming the run's next writer generation at its first commit: from then
on a newer writer fences it, docs/security.md "Fencing") and hands the checkpoint to the
:class:`~ckpt_agent.persist.finalize.FinalizePipeline` (validate, verdict,
catalog, retention, blob GC).

Every sidecar persists only the newest complete snapshot of its area, so two sidecars
can pick different ones: rank 0's may take snapshot N while rank 1's, looking a moment
later, already sees N+1 and never writes N. The wait for N then ends as soon as every
missing rank has written its part of a newer snapshot that rank 0's area holds too
(:class:`Superseded`): rank 0 moves on to that one instead of waiting out the commit
timeout with the newer snapshots unpersisted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from ckpt_agent.errors import CheckpointFormatError, NotFoundError
from ckpt_agent.flash.sidecar.metrics import SidecarMetrics
from ckpt_agent.flash.sidecar.persisting import Handled, PartWriter
from ckpt_agent.format.fence import claim
from ckpt_agent.format.layout import MANIFEST_MAX_BYTES, rank_manifest_key, sha256_hex
from ckpt_agent.format.manifest import RankManifest, RankRef
from ckpt_agent.format.parts import verify_part
from ckpt_agent.format.readers import read_capped
from ckpt_agent.persist.builder import PersistParts
from ckpt_agent.persist.finalize import FinalizeJob
from ckpt_agent.persist.writer import WrittenCheckpoint, WrittenRank
from ckpt_agent.records import CheckpointStatus, rank_name

__all__ = ["Coordinator", "Superseded"]


class Superseded(Exception):  # noqa: N818 (an outcome, not a failure)
    """The other ranks moved past this checkpoint: its parts will never all exist."""


class Coordinator:
    """Commits checkpoints whose rank-0 part this sidecar wrote (see the module doc)."""

    def __init__(
        self,
        run_id: str,
        parts: PersistParts,
        part_writer: PartWriter,
        metrics: SidecarMetrics,
        *,
        commit_timeout_s: float,
    ) -> None:
        self.run_id = run_id
        self.parts = parts
        self.part_writer = part_writer
        self.metrics = metrics
        self.commit_timeout_s = commit_timeout_s

    def commit(
        self,
        own: Handled,
        *,
        persist_others: Callable[[], bool],
        abort: Callable[[], bool],
        newer: Callable[[], str | None] = lambda: None,
    ) -> WrittenCheckpoint:
        """Wait for the other ranks' parts (persisting ours meanwhile), verify, commit.

        ``persist_others()`` persists the other ranks' pending snapshots this sidecar
        serves (True if it did any); ``abort()`` gives up early (stopping, not draining);
        ``newer()`` names the newest complete snapshot of rank 0's area when it is newer
        than this one (else None). Raises :class:`Superseded` when every missing rank has
        written its part of that newer one instead, :class:`TimeoutError` when parts are
        still missing after ``commit_timeout_s``.
        """
        desc = own.desc
        meta = self.part_writer.meta(desc)
        ckpt_id = desc.checkpoint_id
        parts: dict[int, WrittenRank] = {0: own.written}
        deadline = time.monotonic() + self.commit_timeout_s
        delay = 0.01
        while len(parts) < desc.world_size:
            for r in range(1, desc.world_size):
                if r in parts:
                    continue
                part = self.read_part(ckpt_id, r, own.token)
                if part is not None:
                    parts[r] = part
            if len(parts) >= desc.world_size:
                break
            # The other ranks' parts may be ours to write (one sidecar serves every rank of
            # its pod): keep persisting them while waiting, or this would wait for itself.
            if persist_others():
                continue
            missing = sorted(set(range(desc.world_size)) - set(parts))
            ahead = newer()
            if ahead is not None and all(self.read_part(ahead, r, "") for r in missing):
                raise Superseded(
                    f"{ckpt_id}: rank(s) {missing} persisted {ahead} instead: committing that"
                )
            if time.monotonic() >= deadline or abort():
                raise TimeoutError(
                    f"{ckpt_id}: the parts of rank(s) {missing} did not appear in storage "
                    f"within {self.commit_timeout_s:g} s: not committed"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        storage = self.parts.storage
        for r, p in parts.items():
            verify_part(storage, self.run_id, ckpt_id, p.ref)
            if p.manifest.meta.world_size != desc.world_size:
                raise CheckpointFormatError(f"{ckpt_id}: rank {r}'s part has another world size")
        self._hold()
        return self.parts.writer.commit(meta, [parts[r] for r in sorted(parts)])

    def _hold(self) -> None:
        """Claim the run's next writer generation at this sidecar's first commit (the
        sidecar commits for the trainer, so it is the writer that fences); from then on
        the writer and the finalize pipeline check it (:mod:`ckpt_agent.persist.fencing`)."""
        if self.parts.writer.fence is None:
            fence = claim(self.parts.storage, self.run_id)
            self.parts.writer.fence = self.parts.finalizer.fence = fence

    def read_part(self, ckpt_id: str, rank: int, token: str) -> WrittenRank | None:
        """Another rank's part in storage, if it is there and from the same save attempt."""
        key = rank_manifest_key(self.run_id, ckpt_id, rank)
        try:
            raw = read_capped(self.parts.storage, key, MANIFEST_MAX_BYTES)
        except NotFoundError:
            return None
        try:
            m = RankManifest.from_bytes(raw, key)
        except CheckpointFormatError:
            return None  # another writer's partial view (never: manifests are atomic)
        progress = m.state.get("progress") if isinstance(m.state, dict) else None
        if token and (not isinstance(progress, dict) or progress.get("token") != token):
            return None  # a stale part of an earlier attempt at the same id
        ref = RankRef(
            rank=rank, key=f"{rank_name(rank)}.json", sha256=sha256_hex(raw), size=len(raw)
        )
        stats = m.stats
        return WrittenRank(
            manifest=m,
            ref=ref,
            bytes_new=int(stats.get("bytes_new", 0)) + len(raw),
            bytes_reused=int(stats.get("bytes_reused", 0)),
            blobs_new=int(stats.get("blobs_new", 0)),
            blobs_reused=int(stats.get("blobs_reused", 0)),
            raw_bytes=int(stats.get("raw_bytes", 0)),
        )

    def after_commit(self, own: Handled, committed: WrittenCheckpoint) -> None:
        """Book the commit (metrics, catalog), then validate, record and clean up."""
        desc = own.desc
        self.part_writer.last_commit = (desc.step, committed.manifest_hash)
        tier = desc.tier.value
        # ckpt_save_latency_seconds is the trainer's (every save's, from persisted.json):
        # observed here too, a pod's histogram would count each save twice.
        self.metrics.bytes_written.labels(tier=tier).inc(committed.size_bytes)
        self.metrics.bytes_reused.labels(tier=tier).inc(committed.byte_counts()["bytes_reused"])
        record = committed.commit.record(committed.manifest_hash, CheckpointStatus.PENDING)
        record = replace(record, size_bytes=committed.size_bytes)
        self.parts.catalog.upsert(
            self.run_id, record, timings={"stall_s": desc.stall_s, "persist_s": own.persist_s}
        )
        self.parts.finalizer.finalize(
            FinalizeJob(
                checkpoint_id=desc.checkpoint_id,
                tier=desc.tier,
                step=desc.step,
                manifest_hash=committed.manifest_hash,
                world_size=desc.world_size,
                lightweight=bool(desc.meta.get("lightweight")),
                expected={name: (t.dtype, t.shape) for name, t in desc.tensors.items()},
            )
        )
