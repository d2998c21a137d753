"""Writing one rank's snapshot as its part of a checkpoint (chunk, de-duplicate, compress, hash).

:class:`PartWriter` turns a complete shared-memory snapshot into the rank's part
in storage (the trainer's decision recorded in its metadata) and records the
snapshot's chunk hashes next to it, so that an in-place restart can load it
from memory after checking it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ckpt_agent.decide.retention import classify
from ckpt_agent.errors import CheckpointFormatError, StorageError
from ckpt_agent.flash.checksums import HASH_CHUNK_BYTES, chunk_hashes, fast_checksums
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.format.layout import sha256_hex
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import (
    CheckpointMeta,
    RankManifest,
    library_versions,
    lineage_from_json,
)
from ckpt_agent.format.readers import read_commit, read_rank_manifest
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource, WrittenRank
from ckpt_agent.policy.models import RetentionSpec
from ckpt_agent.records import CheckpointStatus, RetentionClass
from ckpt_agent.storage.base import Storage

__all__ = ["Handled", "PartWriter"]

log = logging.getLogger(__name__)


@dataclass
class Handled:
    """A snapshot written as its rank's part."""

    desc: Descriptor
    written: WrittenRank
    persist_s: float
    token: str
    """The trainer's save token (parts of one attempt carry the same one)."""


class PartWriter:
    """Writes snapshots as rank parts (see the module doc)."""

    def __init__(self, run_id: str, writer: CheckpointWriter, retention: RetentionSpec) -> None:
        self.run_id = run_id
        self.writer = writer
        self.retention = retention
        self.last_commit: tuple[int, str] | None = None
        """(step, manifest hash) of the newest checkpoint this sidecar committed (or found)."""

    def seed(self, storage: Storage) -> None:
        """Know the blobs of the newest committed checkpoint (de-duplication across restarts)."""
        try:
            records = [
                r
                for r in list_checkpoints(storage, self.run_id, include_heartbeat=False)
                if r.manifest_hash and r.status != CheckpointStatus.CORRUPTED
            ]
        except (StorageError, CheckpointFormatError):
            return
        if not records:
            return
        newest = records[-1]
        self.last_commit = (newest.step, newest.manifest_hash or "")
        with contextlib.suppress(StorageError, CheckpointFormatError, LookupError, ValueError):
            committed = read_commit(storage, self.run_id, newest.id)
            for ref in committed.commit.ranks:
                part = read_rank_manifest(storage, self.run_id, committed, ref.rank)
                self.writer.index.seed(part)

    def meta(self, desc: Descriptor) -> CheckpointMeta:
        """The checkpoint metadata of a snapshot (what the trainer decided, with its hashes)."""
        m = desc.meta
        score = float(m.get("score", 0.0))
        rc_raw = m.get("retention_class")
        prev = m.get("prev_hash")
        resume_step = int(m.get("resume_step", -1))
        last = self.last_commit
        if last is not None and resume_step <= last[0] < desc.step and last[1]:
            prev = last[1]  # this sidecar committed something newer on the same branch
        versions = m.get("versions")
        return CheckpointMeta(
            run_id=self.run_id,
            step=desc.step,
            tier=desc.tier,
            world_size=desc.world_size,
            created_at=desc.created_at,
            score=score,
            components={str(k): float(v) for k, v in dict(m.get("components") or {}).items()},
            retention_class=RetentionClass(rc_raw) if rc_raw else classify(score, self.retention),
            reason=str(m.get("reason") or ""),
            anomaly=m.get("anomaly"),
            lightweight=bool(m.get("lightweight", False)),
            approximate=bool(m.get("approximate", False)),
            emergency=bool(m.get("emergency", False)),
            prev_hash=str(prev) if prev else None,
            sections=tuple(desc.tree),
            versions=dict(versions) if isinstance(versions, dict) else library_versions(),
            lineage=lineage_from_json(m.get("lineage"), "snapshot lineage"),
        )

    def write_part(self, reader: ShmReader, desc: Descriptor) -> Handled | None:
        """Write this snapshot as its rank's part; None when it was torn or overwritten."""
        t0 = time.perf_counter()
        with reader.open(desc) as snap:
            if snap is None:
                return None
            meta = self.meta(desc)
            sources = [
                TensorSource(name, t.dtype, t.shape, snap.tensor(name))
                for name, t in desc.tensors.items()
            ]
            files = {name: bytes(snap.file(name)) for name in desc.files}
            views = {s.name: s.data for s in sources}
            views.update({name: snap.file(name) for name in desc.files})
            try:
                written = self.writer.write_rank(meta, desc.rank, desc.tree, sources, files)
            except BaseException:
                self._record_hashes(reader, desc, views)
                raise
            self._record_hashes(reader, desc, views, written=written.manifest)
            del views
            del sources
        token = str(desc.meta.get("token") or "")
        return Handled(desc, written, time.perf_counter() - t0, token)

    def record_only(self, reader: ShmReader, desc: Descriptor) -> bool:
        """A memory-only snapshot (:attr:`Descriptor.memory_only`: a memory-tier snapshot or
        a just-in-time save): its hashes recorded for the in-place restart, nothing written
        to storage. False when it was torn or overwritten meanwhile."""
        with reader.open(desc) as snap:
            if snap is None:
                return False
            views = {name: snap.tensor(name) for name in desc.tensors}
            views.update({name: snap.file(name) for name in desc.files})
            self._record_hashes(reader, desc, views)
            del views
        return True

    def _record_hashes(
        self,
        reader: ShmReader,
        desc: Descriptor,
        views: Mapping[str, memoryview],
        *,
        written: RankManifest | None = None,
    ) -> None:
        """Chunk hashes and fast checksums of the snapshot (the snapshot is still open), for
        an in-place restart that loads it from memory."""
        try:
            out: dict[str, list[str]] = {}
            if written is not None:
                for name, t in written.tensors.items():
                    if t.inline is not None:
                        out[name] = [t.inline_sha256 or ""]
                    else:
                        out[name] = [written.blobs[c].raw_sha256 for c in t.chunks] or [
                            sha256_hex(b"")
                        ]
            else:
                for name, view in views.items():
                    out[name] = chunk_hashes(view)
            if written is not None and self.writer.chunk_bytes != HASH_CHUNK_BYTES:
                return  # hashes only comparable at the standard chunk size
            fast = {name: fast_checksums(view) for name, view in views.items()}
            reader.write_hashes(desc, out, fast)
        except (OSError, ValueError):
            log.warning("could not record the hashes of %s", desc.checkpoint_id, exc_info=True)
