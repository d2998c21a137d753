"""Reading a checkpoint back: the COMMIT, rank manifests, the verdict, tensor bytes.

Every read checks what the format promises: a rank manifest must hash to what
the COMMIT records, a blob to its name and a decoded chunk to its raw hash.
Torch-free; only the :class:`~ckpt_agent.storage.base.Storage` interface is
used (a backend that can map objects serves blobs without a copy through
:meth:`~ckpt_agent.storage.base.Storage.read_view`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_agent.errors import CheckpointFormatError, CheckpointNotFoundError, IntegrityError
from ckpt_agent.format.codec import PY_SHUFFLER, CodecError, Shuffler, decode
from ckpt_agent.format.layout import (
    blob_key,
    checkpoint_prefix,
    commit_key,
    sha256_hex,
    validation_key,
)
from ckpt_agent.format.manifest import CommitManifest, RankManifest, TensorEntry, ValidationRecord
from ckpt_agent.storage.base import NotFoundError, Storage

__all__ = [
    "CommittedCheckpoint",
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
        raw = storage.read(key)
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
    try:
        raw = storage.read(key)
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


def read_validation(storage: Storage, run_id: str, ckpt_id: str) -> ValidationRecord | None:
    try:
        raw = storage.read(validation_key(run_id, ckpt_id))
    except NotFoundError:
        return None
    try:
        return ValidationRecord.from_bytes(raw)
    except (CheckpointFormatError, ValueError):
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

    Raises :class:`IntegrityError` (missing/flipped/truncated data) or
    :class:`CheckpointFormatError`; never interprets the bytes.
    """
    what = f"{manifest.checkpoint_id}: {name!r}"
    target = out if out is not None else memoryview(bytearray(entry.nbytes))
    if len(target) != entry.nbytes:
        raise ValueError(f"{what}: output buffer has {len(target)} bytes, tensor {entry.nbytes}")
    if entry.inline is not None:
        if sha256_hex(entry.inline) != entry.inline_sha256:
            raise IntegrityError(f"{what}: inline data does not match its SHA-256")
        target[:] = entry.inline
        return target
    offset = 0
    for digest in entry.chunks:
        blob = manifest.blobs[digest]
        key = blob_key(run_id, digest)
        try:
            with storage.read_view(key) as stored:
                if len(stored) != blob.size:
                    raise IntegrityError(
                        f"{what}: blob {digest[:16]}… has {len(stored)} bytes, manifest says "
                        f"{blob.size} (truncated or overwritten)"
                    )
                got = sha256_hex(stored)
                if got != digest:
                    raise IntegrityError(
                        f"{what}: blob {digest[:16]}… hashes to {got[:16]}… (corrupted bytes)"
                    )
                part = target[offset : offset + blob.raw_size]
                try:
                    decode(stored, blob.codec, blob.raw_size, out=part, shuffler=shuffler)
                except CodecError as e:
                    raise IntegrityError(f"{what}: blob {digest[:16]}…: {e}") from None
        except NotFoundError:
            raise IntegrityError(f"{what}: blob {digest[:16]}… is missing from storage") from None
        same = blob.codec.codec == "none" and blob.raw_sha256 == digest  # already checked
        if not same and sha256_hex(part) != blob.raw_sha256:
            raise IntegrityError(f"{what}: blob {digest[:16]}… decodes to the wrong bytes")
        offset += blob.raw_size
    return target
