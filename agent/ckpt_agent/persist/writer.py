"""Writing checkpoints: chunk, hash, de-duplicate, encode, write blobs, publish manifests.

Torch-free: it takes raw byte views of tensors (the snapshot buffers) and
knows nothing about where they came from. Runs on the persister thread.

Differential storage, exactly: every chunk of raw bytes is hashed (SHA-256);
a chunk whose raw hash is already in :class:`BlobIndex` (written by an
earlier checkpoint of this run and still referenced) is not encoded or
written again, its blob is referenced. Frozen layers, untouched embedding
chunks and frozen optimizer state therefore cost one hash, not one write.
Restore is exact because the reference is by content.

Commit protocol (:meth:`CheckpointWriter.write_rank` then
:meth:`CheckpointWriter.commit`): blobs (each atomic; a re-used blob is
first checked to still exist, else written again), then the rank manifest,
then the ``COMMIT`` listing the rank manifests with their hashes. A re-save of an
existing checkpoint id first deletes its COMMIT (and verdict), so readers
never pair an old COMMIT with a new rank manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckpt_agent.format.codec import (
    CODEC_NONE,
    CODEC_ZSTD,
    PY_SHUFFLER,
    CodecSpec,
    Shuffler,
    encode,
    none_spec,
)
from ckpt_agent.format.layout import (
    CHUNK_MAX_BYTES,
    DTYPE_ITEMSIZE,
    FLOAT_DTYPES,
    blob_key,
    checkpoint_prefix,
    commit_key,
    rank_manifest_key,
    sha256_hex,
    validation_key,
)
from ckpt_agent.format.manifest import (
    BlobEntry,
    CheckpointMeta,
    CommitManifest,
    RankManifest,
    RankRef,
    TensorEntry,
    library_versions,
)
from ckpt_agent.policy.models import CompressionSpec
from ckpt_agent.records import Json, rank_name
from ckpt_agent.storage.base import Storage
from ckpt_agent.tuning import CHUNK_BYTES

__all__ = [
    "BlobIndex",
    "CheckpointWriter",
    "CodecPolicy",
    "TensorSource",
    "WrittenCheckpoint",
    "WrittenRank",
]

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer as Buffer

log = logging.getLogger(__name__)


#: Tensors up to this many bytes are stored inline in the manifest (base64).
INLINE_MAX_BYTES = 8 * 1024
#: Blob uploads in flight at once (overlaps fsync/network latency with hashing/encoding;
#: bounds the encoded chunks held in memory to this many).
PARALLEL_WRITES = 4
#: Keep the compressed form only when it saves at least this fraction.
MIN_SAVING = 0.03


@dataclass(frozen=True)
class TensorSource:
    """One tensor's bytes to write: C-contiguous, native byte order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview
    """Raw bytes (``len == nbytes``); read only during :meth:`CheckpointWriter.write_rank`."""


@dataclass(frozen=True)
class CodecPolicy:
    """Which codec each blob gets (from the policy's ``compression`` section)."""

    codec: str = CODEC_ZSTD
    level: int = 3
    byte_shuffle: bool = True
    min_size_bytes: int = 4096

    @classmethod
    def from_spec(cls, spec: CompressionSpec) -> CodecPolicy:
        """The codec policy a policy's ``compression`` section asks for."""
        return cls(
            codec=spec.codec,
            level=spec.level,
            byte_shuffle=spec.byte_shuffle and spec.codec != CODEC_NONE,
            min_size_bytes=spec.min_size_bytes,
        )

    def spec_for(self, dtype: str, nbytes: int) -> CodecSpec:
        if self.codec == CODEC_NONE or nbytes < self.min_size_bytes:
            return none_spec()
        itemsize = DTYPE_ITEMSIZE[dtype]
        shuffle = itemsize if self.byte_shuffle and dtype in FLOAT_DTYPES and itemsize > 1 else 0
        return CodecSpec(CODEC_ZSTD, self.level, shuffle)


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
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class WrittenCheckpoint:
    """A committed checkpoint."""

    commit: CommitManifest
    manifest_hash: str
    ranks: list[WrittenRank]
    size_bytes: int


class CheckpointWriter:
    """Writes one rank's part of checkpoints, and commits them.

    Multi-rank: every rank calls :meth:`write_rank`; the coordinator verifies
    the rank manifests and calls :meth:`commit` with all the parts
    (:class:`ckpt_agent.runtime.distributed.TwoPhaseCommit`, :mod:`ckpt_agent.flash.sidecar`).
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
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Future[bool], int]] = deque()
        self._this_rank: dict[str, BlobEntry] = {}
        self.storage = storage
        self.run_id = run_id
        self.codec = codec or CodecPolicy()
        self.index = index if index is not None else BlobIndex()
        self.shuffler = shuffler
        self.chunk_bytes = chunk_bytes
        self.inline_max_bytes = inline_max_bytes

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
        ckpt_id = meta.checkpoint_id
        # A re-save of the same id (after a resume) replaces the old one: unpublish it first.
        self.storage.delete(commit_key(self.run_id, ckpt_id))
        self.storage.delete(validation_key(self.run_id, ckpt_id))
        out = WrittenRank(manifest=None, ref=None)  # type: ignore[arg-type]
        self._this_rank = {}
        blobs: dict[str, BlobEntry] = {}
        entries: dict[str, TensorEntry] = {}
        t_hash = t_encode = t_write = 0.0
        file_entries: dict[str, TensorEntry] = {}
        try:
            for src in tensors:
                entries[src.name], th, te, tw = self._write_tensor(src, blobs, out)
                t_hash += th
                t_encode += te
                t_write += tw
            for fname, payload in (files or {}).items():
                src = TensorSource(fname, "uint8", (len(payload),), memoryview(payload))
                file_entries[fname], th, te, tw = self._write_tensor(src, blobs, out)
        except BaseException:
            try:  # no upload may outlive this call: they read the caller's buffers
                self._drain(out)
            except BaseException:
                pass
            raise
        t0w = time.perf_counter()
        self._drain(out)
        t_write += time.perf_counter() - t0w
        stats = {
            "bytes_new": out.bytes_new,
            "bytes_reused": out.bytes_reused,
            "blobs_new": out.blobs_new,
            "blobs_reused": out.blobs_reused,
            "raw_bytes": out.raw_bytes,
        }
        manifest = RankManifest(
            meta=meta,
            rank=rank,
            state=state,
            tensors=entries,
            blobs=blobs,
            files=file_entries,
            stats=stats,
        )
        data = manifest.to_bytes()
        t1 = time.perf_counter()
        self.storage.commit(rank_manifest_key(self.run_id, ckpt_id, rank), data)
        out.manifest = manifest
        out.ref = RankRef(
            rank=rank, key=f"{rank_name(rank)}.json", sha256=sha256_hex(data), size=len(data)
        )
        out.bytes_new += len(data)
        out.timings = {
            "hash_s": t_hash,
            "encode_s": t_encode,
            "write_s": t_write + (time.perf_counter() - t1),
            "total_s": time.perf_counter() - t0,
        }
        return out

    def _write_tensor(
        self, src: TensorSource, blobs: dict[str, BlobEntry], out: WrittenRank
    ) -> tuple[TensorEntry, float, float, float]:
        nbytes = len(src.data)
        out.raw_bytes += nbytes
        if src.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"{src.name}: unsupported dtype {src.dtype!r}")
        if nbytes <= self.inline_max_bytes:
            raw = bytes(src.data)
            return (
                TensorEntry(
                    dtype=src.dtype,
                    shape=src.shape,
                    nbytes=nbytes,
                    byte_order=sys.byteorder,
                    inline=raw,
                    inline_sha256=sha256_hex(raw),
                ),
                0.0,
                0.0,
                0.0,
            )
        chunks: list[str] = []
        t_hash = t_encode = t_write = 0.0
        for start in range(0, nbytes, self.chunk_bytes):
            part = src.data[start : start + self.chunk_bytes]
            t0 = time.perf_counter()
            raw_sha = hashlib.sha256(part).hexdigest()
            t_hash += time.perf_counter() - t0
            known = self._this_rank.get(raw_sha)  # a repeat within this checkpoint
            if known is not None:
                blobs[known.digest] = known
                chunks.append(known.digest)
                continue
            known = self.index.get(raw_sha)
            if known is not None and not self.storage.exists(blob_key(self.run_id, known.digest)):
                # Deleted since it was indexed (retention + GC elsewhere): write it again.
                self.index.forget({known.digest})
                known = None
            if known is not None:
                blobs[known.digest] = known
                chunks.append(known.digest)
                out.bytes_reused += known.size
                out.blobs_reused += 1
                continue
            spec = self.codec.spec_for(src.dtype, len(part))
            t0 = time.perf_counter()
            stored = encode(part, spec, self.shuffler)
            if spec.codec != CODEC_NONE and len(memoryview(stored)) > len(part) * (1 - MIN_SAVING):
                spec, stored = none_spec(), part  # incompressible: keep it raw (faster to load)
            t_encode += time.perf_counter() - t0
            t0 = time.perf_counter()
            digest = raw_sha if spec.codec == CODEC_NONE else hashlib.sha256(stored).hexdigest()
            t_hash += time.perf_counter() - t0
            size = len(memoryview(stored))
            entry = BlobEntry(
                digest=digest, size=size, raw_sha256=raw_sha, raw_size=len(part), codec=spec
            )
            key = blob_key(self.run_id, digest)
            t0 = time.perf_counter()
            self._submit(key, stored, size, out)
            t_write += time.perf_counter() - t0
            blobs[digest] = entry
            self._this_rank[raw_sha] = entry
            chunks.append(digest)
        return (
            TensorEntry(
                dtype=src.dtype,
                shape=src.shape,
                nbytes=nbytes,
                byte_order=sys.byteorder,
                chunks=tuple(chunks),
            ),
            t_hash,
            t_encode,
            t_write,
        )

    # ------------------------------------------------------------------ parallel uploads

    def _submit(self, key: str, stored: Buffer, size: int, out: WrittenRank) -> None:
        """Write a blob on the upload pool (unless it exists); keeps at most N in flight."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.parallel_writes, thread_name_prefix="ckpt-upload"
            )
        while len(self._pending) >= self.parallel_writes:
            self._collect_one(out)
        self._pending.append((self._pool.submit(self._upload, key, stored), size))

    def _upload(self, key: str, stored: Buffer) -> bool:
        if self.storage.exists(key):
            return False  # same bytes already stored (content-addressed)
        self.storage.write(key, memoryview(stored))
        return True

    def _collect_one(self, out: WrittenRank) -> None:
        fut, size = self._pending.popleft()
        if fut.result():
            out.bytes_new += size
            out.blobs_new += 1
        else:
            out.bytes_reused += size
            out.blobs_reused += 1

    def _drain(self, out: WrittenRank) -> None:
        """Wait for every upload; the first failure is raised after all have finished."""
        error: BaseException | None = None
        while self._pending:
            try:
                self._collect_one(out)
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the upload threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ------------------------------------------------------------------ commit

    def commit(self, meta: CheckpointMeta, ranks: Sequence[WrittenRank]) -> WrittenCheckpoint:
        """Publish the COMMIT (last): from now on the checkpoint exists for readers."""
        ckpt_id = meta.checkpoint_id
        size = sum(r.bytes_new for r in ranks)
        commit = CommitManifest(
            meta=meta,
            ranks=tuple(sorted((r.ref for r in ranks), key=lambda x: x.rank)),
            size_bytes=size,
            raw_bytes=sum(r.raw_bytes for r in ranks),
        )
        data = commit.to_bytes()
        self.storage.commit(commit_key(self.run_id, ckpt_id), data)
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
        self.storage.delete(commit_key(self.run_id, ckpt_id))
        self.storage.delete_prefix(checkpoint_prefix(self.run_id, ckpt_id))
