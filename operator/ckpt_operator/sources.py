"""Checkpoints in storage, as the operator sees them (the only storage I/O it does).

:class:`CheckpointSource` is the small interface the handlers use; unit tests
use an in-memory fake, production uses :class:`StorageCheckpointSource`
over :mod:`ckpt_agent.storage` and :mod:`ckpt_agent.format.manifest` (torch-free).

Deleting a checkpoint removes its ``COMMIT`` first (from then on it does
not exist for any reader: it is expired), then its manifests. Payload blobs
are shared between checkpoints (content addressed), so they are removed by
:meth:`CheckpointSource.collect_garbage` only when no manifest in storage
(committed or still being written) references them **and** they are older
than a grace period, so a checkpoint being written right now never loses a
blob it is about to reference (the writer also re-checks its blobs before it
commits).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from ckpt_agent.format.manifest import (
    CheckpointFormatError,
    RankManifest,
    blob_key,
    checkpoint_prefix,
    commit_key,
    list_checkpoints,
    read_heartbeat,
    verify_hashes,
)
from ckpt_agent.policy import CheckpointPolicySpec, StorageType
from ckpt_agent.records import CheckpointRecord
from ckpt_agent.storage import Storage, StorageError, StorageOptions, open_storage

__all__ = [
    "CheckpointSource",
    "GcResult",
    "SourceFactory",
    "StorageCheckpointSource",
    "VerificationFailedError",
    "storage_options_for",
]

log = logging.getLogger(__name__)

#: Blobs younger than this are never garbage-collected (a writer may be about to commit them).
DEFAULT_GC_GRACE_S = 3600.0


class VerificationFailedError(Exception):
    """A checkpoint failed re-verification; the message says why."""


@dataclass(frozen=True)
class GcResult:
    blobs_deleted: int = 0
    bytes_freed: int = 0


class CheckpointSource(Protocol):
    """What the operator needs from a policy's storage. Methods block (run them in a thread)."""

    def list_checkpoints(
        self, run_id: str, *, include_heartbeat: bool = True
    ) -> list[CheckpointRecord]:
        """Every committed checkpoint of the run (paginated listing of its manifests).

        With ``include_heartbeat`` the newest L0 heartbeat is listed too (the
        ladder's rebuild rung); retention leaves it out (the ring is not a
        deletable checkpoint).
        """
        ...

    def progress(self, run_id: str) -> list[tuple[int, float]]:
        """``(step, unix time)`` of the run's heartbeats (rank 0), oldest first."""
        ...

    def verify(self, run_id: str, checkpoint_id: str) -> bool:
        """Re-check hashes; True, or raise :class:`VerificationFailedError` with the reason."""
        ...

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        """Expire (remove the COMMIT) and delete the checkpoint's manifests."""
        ...

    def collect_garbage(self, run_id: str) -> GcResult:
        """Delete blobs no manifest references any more (older than the grace period)."""
        ...

    def close(self) -> None: ...


#: ``await factory(namespace, policy_name, spec)`` → the policy's source.
SourceFactory = Callable[[str, str, CheckpointPolicySpec], Awaitable[CheckpointSource]]


def storage_options_for(
    spec: CheckpointPolicySpec,
    *,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
) -> StorageOptions:
    """StorageOptions equivalent to what the webhook injects into the pods for ``spec``."""
    env_defaults = StorageOptions.from_env()
    if spec.storage.type != StorageType.S3 or spec.storage.s3 is None:
        return env_defaults
    s3 = spec.storage.s3
    sse = s3.server_side_encryption
    return env_defaults.replace(
        endpoint_url=s3.endpoint or env_defaults.endpoint_url,
        region=s3.region,
        path_style=s3.path_style,
        sse=sse.mode.value,
        kms_key_id=sse.kms_key_id,
        part_size_bytes=s3.part_size_mb * 1024 * 1024,
        max_concurrency=s3.max_concurrency,
        max_attempts=s3.max_attempts,
        access_key_id=access_key_id or env_defaults.access_key_id,
        secret_access_key=secret_access_key or env_defaults.secret_access_key,
    )


class StorageCheckpointSource:
    """:class:`CheckpointSource` over a :class:`ckpt_agent.storage.Storage`."""

    def __init__(
        self,
        storage: Storage,
        *,
        gc_grace_s: float = DEFAULT_GC_GRACE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.gc_grace_s = gc_grace_s
        self.clock = clock

    @classmethod
    def open(cls, url: str, options: StorageOptions | None = None) -> StorageCheckpointSource:
        return cls(open_storage(url, options))

    def list_checkpoints(
        self, run_id: str, *, include_heartbeat: bool = True
    ) -> list[CheckpointRecord]:
        return list_checkpoints(self.storage, run_id, include_heartbeat=include_heartbeat)

    def progress(self, run_id: str) -> list[tuple[int, float]]:
        try:
            return [(hb.step, hb.time) for hb in read_heartbeat(self.storage, run_id, 0)]
        except (CheckpointFormatError, StorageError) as e:
            log.warning("run %s: unreadable heartbeat ring: %s", run_id, e)
            return []

    def verify(self, run_id: str, checkpoint_id: str) -> bool:
        result = verify_hashes(self.storage, run_id, checkpoint_id)
        if not result.ok:
            raise VerificationFailedError(result.reason)
        return True

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        self.storage.delete(commit_key(run_id, checkpoint_id))
        self.storage.delete_prefix(checkpoint_prefix(run_id, checkpoint_id))

    def collect_garbage(self, run_id: str) -> GcResult:
        referenced: set[str] = set()
        steps = f"{run_id}/steps/"
        for info in list(self.storage.list(steps)):
            name = info.key.rsplit("/", 1)[-1]
            if not (name.startswith("rank_") and name.endswith(".json")):
                continue
            try:
                manifest = RankManifest.from_bytes(self.storage.read(info.key), info.key)
            except (CheckpointFormatError, StorageError) as e:
                # An unreadable manifest might reference anything: collect nothing this time.
                log.warning("run %s: skipping blob GC, unreadable %s: %s", run_id, info.key, e)
                return GcResult()
            referenced.update(manifest.referenced_blobs())
        cutoff = self.clock() - self.gc_grace_s
        deleted = freed = 0
        prefix = f"{run_id}/blobs/sha256/"
        for info in list(self.storage.list(prefix)):
            digest = info.key.rsplit("/", 1)[-1]
            if digest in referenced:
                continue
            if info.mtime is None or info.mtime > cutoff:
                continue
            try:
                if info.key != blob_key(run_id, digest):
                    continue  # not a blob of ours
            except CheckpointFormatError:
                continue
            self.storage.delete(info.key)
            deleted += 1
            freed += info.size
        return GcResult(deleted, freed)

    def close(self) -> None:
        self.storage.close()


class StorageSourceFactory:
    """The production :data:`SourceFactory`: opens (and caches) each policy's storage.

    S3 credentials come from the policy's ``credentialsSecret`` (read through
    ``get_secret`` when ``read_secrets``), else from the operator's own
    environment (``CKPT_S3_*``, the AWS chain: IRSA, instance profile).
    """

    def __init__(
        self,
        get_secret: Callable[[str, str], Awaitable[dict[str, str] | None]],
        *,
        read_secrets: bool = True,
        gc_grace_s: float = DEFAULT_GC_GRACE_S,
    ) -> None:
        self._get_secret = get_secret
        self._read_secrets = read_secrets
        self._gc_grace_s = gc_grace_s
        self._cache: dict[tuple[str, str], tuple[object, StorageCheckpointSource]] = {}

    async def __call__(
        self, namespace: str, policy: str, spec: CheckpointPolicySpec
    ) -> CheckpointSource:
        import asyncio

        key_id = secret = None
        s3 = spec.storage.s3 if spec.storage.type == StorageType.S3 else None
        if s3 is not None and s3.credentials_secret is not None and self._read_secrets:
            ref = s3.credentials_secret
            data = await self._get_secret(namespace, ref.name)
            if data is None:
                raise StorageError(
                    f"credentials Secret {namespace}/{ref.name} named by policy {policy} not found"
                )
            key_id = data.get(ref.access_key_id_key)
            secret = data.get(ref.secret_access_key_key)
            if not key_id or not secret:
                raise StorageError(
                    f"Secret {namespace}/{ref.name} lacks {ref.access_key_id_key} or "
                    f"{ref.secret_access_key_key}"
                )
        options = storage_options_for(spec, access_key_id=key_id, secret_access_key=secret)
        fingerprint = (spec.storage.url(), options)
        cached = self._cache.get((namespace, policy))
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        storage = await asyncio.to_thread(open_storage, spec.storage.url(), options)
        source = StorageCheckpointSource(storage, gc_grace_s=self._gc_grace_s)
        if cached is not None:
            cached[1].close()
        self._cache[(namespace, policy)] = (fingerprint, source)
        return source

    def close(self) -> None:
        for _, source in self._cache.values():
            source.close()
        self._cache.clear()
