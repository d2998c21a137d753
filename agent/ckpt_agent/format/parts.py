"""Checking one rank's published part of a checkpoint (torch-free).

Used by the coordinator of the two-phase commit before it publishes ``COMMIT``:
:class:`ckpt_agent.runtime.dist.commit.TwoPhaseCommit` in the trainers and
:mod:`ckpt_agent.flash.sidecar` in the persisting sidecar (which never imports torch).
"""

from __future__ import annotations

from ckpt_agent.errors import CheckpointFormatError, NotFoundError
from ckpt_agent.format.layout import (
    MANIFEST_MAX_BYTES,
    blob_key,
    checkpoint_prefix,
    rank_manifest_key,
    sha256_hex,
)
from ckpt_agent.format.manifest import RankManifest, RankRef
from ckpt_agent.records import rank_name
from ckpt_agent.storage.base import Storage

__all__ = ["part_keys", "verify_part"]


def verify_part(storage: Storage, run_id: str, ckpt_id: str, ref: RankRef) -> RankManifest:
    """Read one rank's published manifest back and check it against ``ref`` (and its blobs).

    Checks: the bytes hash to ``ref.sha256`` with ``ref.size``; the manifest
    parses, describes this checkpoint and rank; every blob it references
    exists with its recorded size. Raises :class:`CheckpointFormatError` or
    :class:`~ckpt_agent.storage.base.StorageError`.
    """
    key = checkpoint_prefix(run_id, ckpt_id) + ref.key
    if ref.key != f"{rank_name(ref.rank)}.json":
        raise CheckpointFormatError(f"{ckpt_id}: rank {ref.rank} announced manifest {ref.key}")
    try:
        raw = storage.read(key, 0, min(ref.size, MANIFEST_MAX_BYTES) + 1)  # what was announced
    except NotFoundError:
        raise CheckpointFormatError(f"{ckpt_id}: {ref.key} is not in storage") from None
    digest = sha256_hex(raw)
    if len(raw) != ref.size or digest != ref.sha256:
        raise CheckpointFormatError(
            f"{ckpt_id}: {ref.key} in storage has {len(raw)} bytes / {digest[:16]}…, "
            f"rank {ref.rank} announced {ref.size} bytes / {ref.sha256[:16]}…"
        )
    manifest = RankManifest.from_bytes(raw, f"{ckpt_id}/{ref.key}")
    if manifest.checkpoint_id != ckpt_id or manifest.rank != ref.rank:
        raise CheckpointFormatError(f"{ckpt_id}/{ref.key}: describes another checkpoint or rank")
    for digest_ in sorted(manifest.referenced_blobs()):
        blob = manifest.blobs[digest_]
        try:
            info = storage.stat(blob_key(run_id, digest_))
        except NotFoundError:
            raise CheckpointFormatError(
                f"{ckpt_id}/{ref.key}: blob {digest_[:16]}… is missing from storage"
            ) from None
        if info.size != blob.size:
            raise CheckpointFormatError(
                f"{ckpt_id}/{ref.key}: blob {digest_[:16]}… has {info.size} bytes, "
                f"manifest says {blob.size}"
            )
    return manifest


def part_keys(run_id: str, ckpt_id: str, world_size: int) -> list[str]:
    """The rank manifest keys a complete checkpoint of ``world_size`` ranks has."""
    return [rank_manifest_key(run_id, ckpt_id, r) for r in range(world_size)]
