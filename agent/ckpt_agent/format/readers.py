"""Reading a checkpoint back: the COMMIT, rank manifests, the verdict, tensor bytes.

Every read checks what the format promises: a rank manifest must hash to what
the COMMIT records, a blob to its name and a decoded chunk to its raw hash.
Torch-free; only the :class:`~ckpt_agent.storage.base.Storage` interface is
used (a backend that can map objects serves blobs without a copy through
:meth:`~ckpt_agent.storage.base.Storage.read_view`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_agent.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    NotFoundError,
)
from ckpt_agent.format.chunkread import Scratch, check_inline, read_chunk
from ckpt_agent.format.codec import PY_SHUFFLER, Shuffler
from ckpt_agent.format.entries import TensorEntry
from ckpt_agent.format.layout import (
    COMMIT_MAX_BYTES,
    MANIFEST_MAX_BYTES,
    VALIDATION_MAX_BYTES,
    checkpoint_prefix,
    commit_key,
    sha256_hex,
    validation_key,
)
from ckpt_agent.format.manifest import CommitManifest, RankManifest
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.storage.base import Storage

__all__ = [
    "CommittedCheckpoint",
    "check_tensor_bytes",
    "read_capped",
    "read_checkpoint",
    "read_commit",
    "read_rank_manifest",
    "read_tensor_bytes",
    "read_validation",
]


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A COMMIT as read from storage, with its hash."""

    commit: CommitManifest
    manifest_hash: str
    raw: bytes


def read_commit(storage: Storage, run_id: str, ckpt_id: str) -> CommittedCheckpoint:
    """Read and parse a checkpoint's COMMIT.

    Raises :class:`CheckpointNotFoundError` when it is not committed and
    :class:`CheckpointFormatError` when the COMMIT is malformed.
    """
    key = commit_key(run_id, ckpt_id)
    try:
        raw = read_capped(storage, key, COMMIT_MAX_BYTES)
    except NotFoundError:
        raise CheckpointNotFoundError(
            f"checkpoint {ckpt_id} of run {run_id} is not committed (no {key} in {storage.url})"
        ) from None
    commit = CommitManifest.from_bytes(raw, f"{ckpt_id}/COMMIT")
    if commit.meta.run_id != run_id or commit.checkpoint_id != ckpt_id:
        raise CheckpointFormatError(
            f"{ckpt_id}/COMMIT describes {commit.meta.run_id}/{commit.checkpoint_id}: "
            "a file copied from another checkpoint"
        )
    return CommittedCheckpoint(commit=commit, manifest_hash=sha256_hex(raw), raw=raw)


def read_rank_manifest(
    storage: Storage, run_id: str, committed: CommittedCheckpoint, rank: int
) -> RankManifest:
    """Read one rank's manifest and check it against the hash the COMMIT records."""
    commit = committed.commit
    refs = [r for r in commit.ranks if r.rank == rank]
    if not refs:
        raise CheckpointFormatError(
            f"{commit.checkpoint_id}: no manifest for rank {rank} "
            f"(world size {commit.meta.world_size})"
        )
    ref = refs[0]
    key = checkpoint_prefix(run_id, commit.checkpoint_id) + ref.key
    if ref.size > MANIFEST_MAX_BYTES:
        raise CheckpointFormatError(
            f"{commit.checkpoint_id}: COMMIT records {ref.key} with {ref.size} bytes, over the "
            f"format's {MANIFEST_MAX_BYTES}-byte limit"
        )
    try:
        raw = storage.read(key, 0, ref.size + 1)  # never more than the COMMIT promises
    except NotFoundError:
        raise IntegrityError(
            f"{commit.checkpoint_id}: rank manifest {ref.key} is missing from storage"
        ) from None
    digest = sha256_hex(raw)
    if len(raw) != ref.size or digest != ref.sha256:
        raise IntegrityError(
            f"{commit.checkpoint_id}: rank manifest {ref.key} has {len(raw)} bytes hashing to "
            f"{digest[:16]}…, COMMIT records {ref.size} bytes / {ref.sha256[:16]}… "
            "(modified or truncated)"
        )
    manifest = RankManifest.from_bytes(raw, f"{commit.checkpoint_id}/{ref.key}")
    if manifest.checkpoint_id != commit.checkpoint_id or manifest.rank != rank:
        raise CheckpointFormatError(
            f"{commit.checkpoint_id}/{ref.key}: describes another checkpoint"
        )
    return manifest


def read_checkpoint(
    storage: Storage, run_id: str, ckpt_id: str, rank: int = 0
) -> tuple[CommittedCheckpoint, RankManifest]:
    committed = read_commit(storage, run_id, ckpt_id)
    return committed, read_rank_manifest(storage, run_id, committed, rank)


def read_capped(storage: Storage, key: str, limit: int) -> bytes:
    """The object at ``key``, refused (:class:`CheckpointFormatError`) past ``limit`` bytes.

    Reads at most ``limit + 1`` bytes whatever the object holds.
    """
    raw = storage.read(key, 0, limit + 1)
    if len(raw) > limit:
        raise CheckpointFormatError(
            f"{key}: more than {limit} bytes, over the format's limit (not written by ckpt-agent)"
        )
    return raw


def read_validation(storage: Storage, run_id: str, ckpt_id: str) -> ValidationVerdict | None:
    """The validator's verdict, or None when there is none or it is unreadable (not trusted)."""
    key = validation_key(run_id, ckpt_id)
    try:
        return ValidationVerdict.from_bytes(read_capped(storage, key, VALIDATION_MAX_BYTES), key)
    except NotFoundError:
        return None
    except ValueError:  # CheckpointFormatError included
        return None


def read_tensor_bytes(
    storage: Storage,
    run_id: str,
    manifest: RankManifest,
    entry: TensorEntry,
    name: str,
    out: memoryview | None = None,
    shuffler: Shuffler = PY_SHUFFLER,
) -> memoryview:
    """Decode one tensor's raw bytes, checking every hash and size on the way.

    Chunks are decoded straight into ``out`` and verified there
    (:func:`~ckpt_agent.format.chunkread.read_chunk`); many tensors at once, on
    several threads: :mod:`ckpt_agent.format.parallel_read`. Raises
    :class:`IntegrityError` (missing/flipped/truncated data) or
    :class:`CheckpointFormatError`; never interprets the bytes.
    """
    what = f"{manifest.checkpoint_id}: {name!r}"
    target = out if out is not None else memoryview(bytearray(entry.nbytes))
    if len(target) != entry.nbytes:
        raise ValueError(f"{what}: output buffer has {len(target)} bytes, tensor {entry.nbytes}")
    if entry.inline is not None:
        check_inline(entry, what)
        target[:] = entry.inline
        return target
    offset = 0
    scratch = Scratch()
    for digest in entry.chunks:
        blob = manifest.blobs[digest]
        part = target[offset : offset + blob.raw_size]
        read_chunk(storage, run_id, blob, what, part, shuffler, scratch)
        offset += blob.raw_size
    return target


def check_tensor_bytes(
    storage: Storage,
    run_id: str,
    manifest: RankManifest,
    entry: TensorEntry,
    name: str,
    *,
    seen: set[str],
    shuffler: Shuffler = PY_SHUFFLER,
) -> None:
    """Like :func:`read_tensor_bytes`, but keeps nothing: memory stays one chunk.

    Each blob's stored bytes are checked against its name, then it is decoded
    into a scratch buffer of at most
    :data:`~ckpt_agent.format.layout.CHUNK_MAX_BYTES` and its raw hash
    checked; digests in ``seen`` are skipped and the checked ones added (a
    blob referenced many times is decoded once).
    """
    what = f"{manifest.checkpoint_id}: {name!r}"
    if entry.inline is not None:
        check_inline(entry, what)
        return
    out, scratch = Scratch(), Scratch()  # each at most a chunk: the manifest says so
    for digest in entry.chunks:
        if digest in seen:
            continue
        blob = manifest.blobs[digest]
        part = out.get(blob.raw_size)
        read_chunk(storage, run_id, blob, what, part, shuffler, scratch, check_stored=True)
        seen.add(digest)
