"""Writing checkpoints: chunk, hash, de-duplicate, encode, write blobs, publish manifests.

Torch-free: it takes raw byte views of tensors (the snapshot buffers) and
knows nothing about where they came from. Runs on the persister thread.

Differential storage, exactly: every chunk of raw bytes is hashed (SHA-256);
a chunk whose raw hash is already in :class:`BlobIndex` (written by an
earlier checkpoint of this run and still referenced) is not encoded or
written again, its blob is referenced. Frozen layers, untouched embedding
chunks and frozen optimizer state therefore cost one hash, not one write.
Restore is exact because the reference is by content.

Pipeline, two stages: each chunk is hashed, de-duplicated and encoded on a
pool of CPU threads (``min(parallel_writes, cores)``; SHA-256 and zstd release
the GIL, so chunks hash and compress in parallel), then written on a pool of
``parallel_writes`` upload threads (overlapping the storage's latency with the
next chunks' hashing). The persister thread only submits chunks (at most a
few per CPU thread ahead) and assembles the manifest in order. Memory: tasks
read the snapshot's buffers in place; beyond them a save holds at most one
encoded chunk (and one shuffle scratch buffer) per CPU thread and
``parallel_writes`` encoded chunks waiting for or in their upload — none with
raw blobs. The codec of each blob comes from
:class:`~ckpt_agent.persist.encoding.BlobEncoder` (``auto``: compress where it
pays, from the storage's measured throughput).

Commit protocol (:meth:`CheckpointWriter.write_rank` then
:meth:`CheckpointWriter.commit`): blobs (each atomic and durable, e.g. fsynced
before it is renamed into place; a re-used blob is first checked to still
exist, else written again), then — after *every* blob write has returned —
the rank manifest, then the ``COMMIT`` listing the rank manifests with their
hashes. A re-save of an existing checkpoint id first deletes its COMMIT (and
verdict), so readers never pair an old COMMIT with a new rank manifest. A
:attr:`CheckpointWriter.fence` is checked there and before the COMMIT (:mod:`.fencing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckpt_agent.background import usable_cpus
from ckpt_agent.format.codec import (
    CODEC_NONE,
    PY_SHUFFLER,
    Shuffler,
)
from ckpt_agent.format.entries import BlobEntry, TensorEntry
from ckpt_agent.format.fence import Fence
from ckpt_agent.format.layout import (
    CHUNK_MAX_BYTES,
    DTYPE_ITEMSIZE,
    blob_key,
    checkpoint_prefix,
    commit_key,
    rank_manifest_key,
    sha256_hex,
)
from ckpt_agent.format.manifest import (
    CheckpointMeta,
    CommitManifest,
    RankManifest,
    RankRef,
    library_versions,
)
from ckpt_agent.persist.chunk_tasks import ChunkRun, StoredChunk, raw_hashes
from ckpt_agent.persist.encoding import BlobEncoder, CodecPolicy, Encoded, WriteMeter
from ckpt_agent.persist.fencing import prepare_save, publish_commit, publish_manifest, stamp
from ckpt_agent.records import Json, rank_name
from ckpt_agent.storage.base import Storage
from ckpt_agent.tuning import CHUNK_BYTES

__all__ = [
    "BlobIndex",
    "CheckpointWriter",
    "TensorSource",
    "WrittenCheckpoint",
    "WrittenRank",
]

log = logging.getLogger(__name__)


#: Tensors up to this many bytes are stored inline in the manifest (base64).
INLINE_MAX_BYTES = 8 * 1024
#: Blob uploads in flight at once (and encoded chunks waiting for one): overlaps
#: fsync/network latency with hashing/encoding; also caps the hashing/encoding threads.
PARALLEL_WRITES = 4
#: Chunks submitted ahead of the oldest unfinished one, per thread (they hold no memory:
#: views of the snapshot).
SUBMIT_AHEAD = 2


@dataclass(frozen=True)
class TensorSource:
    """One tensor's bytes to write: C-contiguous, native byte order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    """Raw bytes (``len == nbytes``); read only during :meth:`CheckpointWriter.write_rank`."""


class BlobIndex:
    """raw SHA-256 → blob entry, for blobs that committed checkpoints still reference.

    Filled from each manifest the writer commits (and, on start, from the
    newest committed one). Entries are dropped when the validator finds their
    blob corrupted or when garbage collection deletes it.
    """

    def __init__(self) -> None:
        self._by_raw: dict[str, BlobEntry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_raw)

    def get(self, raw_sha256: str) -> BlobEntry | None:
        with self._lock:
            return self._by_raw.get(raw_sha256)

    def add(self, entry: BlobEntry) -> None:
        with self._lock:
            self._by_raw.setdefault(entry.raw_sha256, entry)

    def seed(self, manifest: RankManifest) -> None:
        """Remember every blob a committed manifest references."""
        with self._lock:
            for digest in manifest.referenced_blobs():
                b = manifest.blobs[digest]
                self._by_raw.setdefault(b.raw_sha256, b)

    def forget(self, digests: Sequence[str] | set[str]) -> int:
        """Drop entries whose stored digest is in ``digests``; returns how many."""
        gone = set(digests)
        with self._lock:
            drop = [k for k, v in self._by_raw.items() if v.digest in gone]
            for k in drop:
                del self._by_raw[k]
        return len(drop)

    def clear(self) -> None:
        with self._lock:
            self._by_raw.clear()


@dataclass
class WrittenRank:
    """What :meth:`CheckpointWriter.write_rank` produced."""

    manifest: RankManifest
    ref: RankRef
    bytes_new: int = 0
    bytes_reused: int = 0
    blobs_new: int = 0
    blobs_reused: int = 0
    raw_bytes: int = 0
    blobs_compressed: int = 0
    """New blobs stored compressed (the others raw)."""
    timings: dict[str, float] = field(default_factory=dict)
    """``hash_s``/``encode_s``/``write_s``: seconds summed over the pool's threads;
    ``total_s``: wall time; ``write_mib_s``/``compress_mib_s``: the throughputs the
    ``auto`` codec decided from (when known)."""

    def byte_counts(self) -> dict[str, int]:
        """This part's bytes for a log event: ``bytes_new`` (stored, this save),
        ``bytes_reused`` (stored, earlier saves' blobs) and ``raw_bytes`` (uncompressed)."""
        return {
            "bytes_new": self.bytes_new,
            "bytes_reused": self.bytes_reused,
            "raw_bytes": self.raw_bytes,
        }


@dataclass
class WrittenCheckpoint:
    """A committed checkpoint."""

    commit: CommitManifest
    manifest_hash: str
    ranks: list[WrittenRank]
    size_bytes: int

    def byte_counts(self) -> dict[str, int]:
        """:meth:`WrittenRank.byte_counts` over every rank (``bytes_new``: the COMMIT too)."""
        return {
            "bytes_new": self.size_bytes,
            "bytes_reused": sum(r.bytes_reused for r in self.ranks),
            "raw_bytes": self.commit.raw_bytes,
        }


class CheckpointWriter:
    """Writes one rank's part of checkpoints, and commits them.

    Multi-rank: every rank calls :meth:`write_rank`; the coordinator verifies
    the rank manifests and calls :meth:`commit` with all the parts
    (:class:`ckpt_agent.runtime.dist.commit.TwoPhaseCommit`, :mod:`ckpt_agent.flash.sidecar`).
    One call at a time per writer.
    """

    def __init__(
        self,
        storage: Storage,
        run_id: str,
        *,
        codec: CodecPolicy | None = None,
        index: BlobIndex | None = None,
        shuffler: Shuffler = PY_SHUFFLER,
        chunk_bytes: int = CHUNK_BYTES,
        inline_max_bytes: int = INLINE_MAX_BYTES,
        parallel_writes: int = PARALLEL_WRITES,
    ) -> None:
        if chunk_bytes <= 0 or chunk_bytes % 16 or chunk_bytes > CHUNK_MAX_BYTES:
            raise ValueError(
                f"chunk_bytes must be a positive multiple of 16 of at most {CHUNK_MAX_BYTES} "
                "(readers refuse larger chunks)"
            )
        if parallel_writes < 1:
            raise ValueError("parallel_writes must be >= 1")
        self.parallel_writes = parallel_writes
        #: Threads that hash and encode (CPU); uploads run on their own ``parallel_writes``.
        self.cpu_threads = max(1, min(parallel_writes, usable_cpus()))  # cgroup quota too
        self._pool: ThreadPoolExecutor | None = None
        self._io_pool: ThreadPoolExecutor | None = None
        self.storage = storage
        self.run_id = run_id
        #: The writer generation this process holds (set at start; None: no fencing).
        self.fence: Fence | None = None
        self.codec = codec or CodecPolicy()
        self.index = index if index is not None else BlobIndex()
        self.shuffler = shuffler
        self.chunk_bytes = chunk_bytes
        self.inline_max_bytes = inline_max_bytes
        #: The storage's measured write throughput (kept across checkpoints).
        self.meter = WriteMeter(storage.assumed_write_bps, min_bytes=chunk_bytes // 4)
        #: Per-blob codec choice (``auto``) and encoding.
        self.encoder = BlobEncoder(
            self.codec,
            self.meter,
            shuffler=shuffler,
            threads=self.cpu_threads,
        )

    # ------------------------------------------------------------------ one rank

    def write_rank(
        self,
        meta: CheckpointMeta,
        rank: int,
        state: Json,
        tensors: Sequence[TensorSource],
        files: Mapping[str, bytes] | None = None,
    ) -> WrittenRank:
        """Write blobs and the rank manifest (not yet visible: no COMMIT)."""
        t0 = time.perf_counter()
        if not meta.versions:
            meta = dataclasses.replace(meta, versions=library_versions())
        meta = stamp(meta, self.fence)
        ckpt_id = meta.checkpoint_id
        # A re-save of the same id (after a resume) replaces the old one: unpublish it first.
        prepare_save(self.storage, self.run_id, ckpt_id, self.fence)
        out = WrittenRank(manifest=None, ref=None)  # type: ignore[arg-type]
        run = ChunkRun(self.parallel_writes)
        planned: list[tuple[str, TensorEntry, list[int]]] = []
        sources = [*tensors]
        sources += [
            TensorSource(fname, "uint8", (len(payload),), memoryview(payload))
            for fname, payload in (files or {}).items()
        ]
        try:
            for src in sources:
                entry, slots = self._plan_tensor(src, run, out)
                planned.append((src.name, entry, slots))
        except BaseException:
            with contextlib.suppress(BaseException):  # the first error is the one to raise
                run.drain()  # no task may outlive this call: they read the caller's buffers
            raise
        run.drain()  # every blob written (durable) before the manifest
        blobs: dict[str, BlobEntry] = {}
        entries: dict[str, TensorEntry] = {}
        file_entries: dict[str, TensorEntry] = {}
        stored = [f.result() for f in run.futures]
        totals = self._account(stored, out)
        for i, (name, planned_entry, slots) in enumerate(planned):
            digests = []
            for slot in slots:
                blob = self._blob_of(stored, slot)
                blobs[blob.digest] = blob
                digests.append(blob.digest)
            entry = dataclasses.replace(planned_entry, chunks=tuple(digests))
            (entries if i < len(tensors) else file_entries)[name] = entry
        manifest = RankManifest(
            meta=meta,
            rank=rank,
            state=state,
            tensors=entries,
            blobs=blobs,
            files=file_entries,
            stats={
                "bytes_new": out.bytes_new,
                "bytes_reused": out.bytes_reused,
                "blobs_new": out.blobs_new,
                "blobs_reused": out.blobs_reused,
                "raw_bytes": out.raw_bytes,
            },
        )
        data = manifest.to_bytes()
        t1 = time.perf_counter()
        publish_manifest(
            self.storage, rank_manifest_key(self.run_id, ckpt_id, rank), data, self.fence
        )
        out.manifest = manifest
        out.ref = RankRef(
            rank=rank, key=f"{rank_name(rank)}.json", sha256=sha256_hex(data), size=len(data)
        )
        out.bytes_new += len(data)
        totals["write_s"] += time.perf_counter() - t1
        totals["total_s"] = time.perf_counter() - t0
        out.timings = totals | self._throughputs()
        return out

    def _throughputs(self) -> dict[str, float]:
        """The measured throughputs ``auto`` decides from (finite ones only)."""
        out: dict[str, float] = {}
        if self.meter.measured and math.isfinite(self.meter.bps):
            out["write_mib_s"] = self.meter.bps / (1 << 20)
        speed = self.encoder.compress_bps
        if speed is not None and math.isfinite(speed):
            out["compress_mib_s"] = speed / (1 << 20)
        return out

    def _plan_tensor(
        self, src: TensorSource, run: ChunkRun, out: WrittenRank
    ) -> tuple[TensorEntry, list[int]]:
        """The tensor's entry (chunks filled in later) and its chunks' task numbers."""
        nbytes = len(src.data)
        out.raw_bytes += nbytes
        if src.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"{src.name}: unsupported dtype {src.dtype!r}")
        entry = TensorEntry(
            dtype=src.dtype, shape=src.shape, nbytes=nbytes, byte_order=sys.byteorder
        )
        if nbytes <= self.inline_max_bytes:
            raw = bytes(src.data)
            return dataclasses.replace(entry, inline=raw, inline_sha256=sha256_hex(raw)), []
        slots: list[int] = []
        for start in range(0, nbytes, self.chunk_bytes):
            if run.error is not None or run.failed.is_set():
                break  # a chunk failed: submit nothing more (drain raises it)
            while len(run.futures) - run.done >= self.cpu_threads * SUBMIT_AHEAD:
                run.wait_front()
            part = src.data[start : start + self.chunk_bytes]
            slot = len(run.futures)
            run.futures.append(self._executor().submit(self._store, run, slot, part, src.dtype))
            slots.append(slot)
        return entry, slots

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.cpu_threads, thread_name_prefix="ckpt-encode"
            )
        return self._pool

    def _uploader(self) -> ThreadPoolExecutor:
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(
                max_workers=self.parallel_writes, thread_name_prefix="ckpt-upload"
            )
        return self._io_pool

    def _store(self, run: ChunkRun, slot: int, part: memoryview, dtype: str) -> StoredChunk:
        """One chunk: hash; re-use, or encode and hand to the upload pool (a CPU thread)."""
        t0 = time.perf_counter()
        raw_sha, raw_b3 = raw_hashes(part)
        hash_s = time.perf_counter() - t0
        with run.lock:
            first = run.claims.setdefault(raw_sha, slot)
        if first != slot:  # a repeat within this checkpoint
            return StoredChunk(None, same_as=first, hash_s=hash_s)
        known = self.index.get(raw_sha)
        if known is not None and not self.storage.exists(blob_key(self.run_id, known.digest)):
            # Deleted since it was indexed (retention + GC elsewhere): write it again.
            self.index.forget({known.digest})
            known = None
        if known is not None:
            return StoredChunk(known, hash_s=hash_s)
        enc = self.encoder.encode(part, dtype)
        t1 = time.perf_counter()
        digest = raw_sha if enc.spec.codec == CODEC_NONE else hashlib.sha256(enc.stored).hexdigest()
        hash_s += time.perf_counter() - t1
        entry = BlobEntry(
            digest=digest,
            size=len(memoryview(enc.stored)),
            raw_sha256=raw_sha,
            raw_size=len(part),
            codec=enc.spec,
            raw_blake3=raw_b3,
        )
        run.slots.acquire()  # at most parallel_writes encoded chunks wait for their upload
        try:
            upload = self._uploader().submit(self._upload, run, blob_key(self.run_id, digest), enc)
        except BaseException:
            run.slots.release()
            raise
        return StoredChunk(entry, upload=upload, hash_s=hash_s, encode_s=enc.seconds)

    def _upload(self, run: ChunkRun, key: str, enc: Encoded) -> tuple[bool, float]:
        """Write one blob unless it exists (content-addressed: same bytes already there)."""
        t0 = time.perf_counter()
        try:
            written = not self.storage.exists(key)
            if written:
                self.meter.write(self.storage, key, enc.stored)
        except BaseException:
            run.failed.set()
            raise
        finally:
            run.slots.release()
        return written, time.perf_counter() - t0

    @staticmethod
    def _blob_of(stored: Sequence[StoredChunk], slot: int) -> BlobEntry:
        s = stored[slot]
        entry = s.entry if s.entry is not None else stored[s.same_as].entry
        assert entry is not None  # a claimed chunk always has its blob
        return entry

    @staticmethod
    def _account(stored: Sequence[StoredChunk], out: WrittenRank) -> dict[str, float]:
        """Counts into ``out``; the summed per-thread timings."""
        totals = {"hash_s": 0.0, "encode_s": 0.0, "write_s": 0.0}
        for s in stored:
            totals["hash_s"] += s.hash_s
            totals["encode_s"] += s.encode_s
            if s.entry is None:
                continue  # a repeat: counted once, at its first chunk
            written = False
            if s.upload is not None:
                written, seconds = s.upload.result()
                totals["write_s"] += seconds
            if written:
                out.bytes_new += s.entry.size
                out.blobs_new += 1
                out.blobs_compressed += s.entry.codec.codec != CODEC_NONE
            else:
                out.bytes_reused += s.entry.size
                out.blobs_reused += 1
        return totals

    def close(self) -> None:
        """Stop the chunk and upload threads."""
        for pool in (self._pool, self._io_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._io_pool = None

    # ------------------------------------------------------------------ commit

    def commit(self, meta: CheckpointMeta, ranks: Sequence[WrittenRank]) -> WrittenCheckpoint:
        """Publish the COMMIT (last): from now on the checkpoint exists for readers."""
        meta = stamp(meta, self.fence)
        ckpt_id = meta.checkpoint_id
        size = sum(r.bytes_new for r in ranks)
        commit = CommitManifest(
            meta=meta,
            ranks=tuple(sorted((r.ref for r in ranks), key=lambda x: x.rank)),
            size_bytes=size,
            raw_bytes=sum(r.raw_bytes for r in ranks),
        )
        data = commit.to_bytes()
        publish_commit(self.storage, self.run_id, ckpt_id, data, self.fence)
        for r in ranks:
            self.index.seed(r.manifest)
        return WrittenCheckpoint(
            commit=commit,
            manifest_hash=sha256_hex(data),
            ranks=list(ranks),
            size_bytes=size + len(data),
        )

    def unpublish(self, ckpt_id: str) -> None:
        """Remove a checkpoint's COMMIT, verdict and manifests (blobs are left to GC)."""
        if self.fence is not None:  # a fenced writer deletes nothing
            self.fence.check()
        self.storage.delete(commit_key(self.run_id, ckpt_id))
        self.storage.delete_prefix(checkpoint_prefix(self.run_id, ckpt_id))
