"""Checkpoints in storage, as the operator sees them (the only storage I/O it does).

:class:`CheckpointSource` is the small interface the handlers use; unit tests
use an in-memory fake, production uses :class:`StorageCheckpointSource`
over :mod:`ckpt_agent.storage`, the agent's torch-free readers
(:mod:`ckpt_agent.format.listing`, ``.heartbeat``, ``.verify``) and its
housekeeping (:mod:`ckpt_agent.persist.housekeeping`, the same deletion and
blob GC as ``ckpt gc`` and the agent).

Deleting a checkpoint removes its ``COMMIT`` first (from then on it does
not exist for any reader: it is expired), then its folder. Payload blobs
are shared between checkpoints (content addressed), so they are removed by
:meth:`CheckpointSource.collect_garbage` only when no manifest in storage
(committed or still being written) references them **and** they are older
than a grace period, so a checkpoint being written right now never loses a
blob it is about to reference (the writer also re-checks its blobs before it
commits). Uncommitted folders older than the grace period (crash leftovers)
are removed by the same pass. While any other rank manifest of the run is
unreadable (it might reference anything) no blob is collected
(:func:`~ckpt_agent.persist.housekeeping.gc_blobs` itself refuses).
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import stat as stat_mod
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.heartbeat import read_heartbeat
from ckpt_agent.format.layout import parse_checkpoint_id
from ckpt_agent.format.listing import Listing, ListingLimits, list_checkpoints, scan_checkpoints
from ckpt_agent.format.owner import RunOwner, read_owner
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.persist.housekeeping import (
    GcResult,
    ManifestCache,
    delete_checkpoint,
    delete_checkpoints,
    gc_blobs,
)
from ckpt_agent.policy import CheckpointPolicySpec, StorageType
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.storage import (
    PermanentStorageError,
    RetryableStorageError,
    Storage,
    StorageError,
    StorageOptions,
    open_storage,
)
from ckpt_agent.storage.anchored import AnchoredLocalStorage
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.tuning import GC_GRACE_S
from ckpt_operator.model.config import TenancyConfig
from ckpt_operator.planners.tenancy import (
    PathLink,
    ResolvedPath,
    grant_anchor,
    granted_paths,
    resolved_refusal,
    storage_refusal,
)

__all__ = [
    "CheckpointSource",
    "GrantEscapeError",
    "ReportedCheckpointSource",
    "SourceFactory",
    "StorageAccessDeniedError",
    "StorageCheckpointSource",
    "StorageTimeoutError",
    "VerificationFailedError",
    "resolve_path",
    "storage_options_for",
]

log = logging.getLogger(__name__)


class VerificationFailedError(Exception):
    """A checkpoint failed re-verification; the message says why."""


class StorageAccessDeniedError(PermanentStorageError):
    """The administrator did not allow the storage a policy names (see
    :mod:`ckpt_operator.planners.tenancy`); nothing was opened or sent. The message says what
    to do."""


class GrantEscapeError(StorageAccessDeniedError):
    """A local path granted as written leads outside the namespace's grants once resolved
    (a symbolic link on the way): refused outright (no fallback to the pods' reports); the
    message names the link."""


class StorageTimeoutError(RetryableStorageError):
    """A storage call did not return within the operator's storage timeout."""


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

    def scan_checkpoints(self, run_id: str, limits: ListingLimits) -> Listing:
        """Retention's listing: the committed checkpoints (no heartbeat), bounded by
        ``limits`` (:func:`ckpt_agent.format.listing.scan_checkpoints`: it says when it
        stopped short)."""
        ...

    def progress(self, run_id: str) -> list[tuple[int, float]]:
        """``(step, unix time)`` of the run's heartbeats (rank 0), oldest first."""
        ...

    def verify(self, run_id: str, checkpoint_id: str) -> bool:
        """Re-check hashes; True, or raise :class:`VerificationFailedError` with the reason."""
        ...

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        """Expire (remove the COMMIT) and delete the checkpoint's folder."""
        ...

    def delete_checkpoints(self, run_id: str, checkpoint_ids: Sequence[str]) -> None:
        """:meth:`delete_checkpoint` of several: their COMMITs in one batched delete (S3
        ``DeleteObjects``), then their folders."""
        ...

    def collect_garbage(self, run_id: str) -> GcResult:
        """Delete blobs no manifest references any more and stale uncommitted folders
        (both older than the grace period)."""
        ...

    def run_owner(self, run_id: str) -> RunOwner | None:
        """The run's owner, read only (None: the run has no owner record: a new run, or a
        legacy one). The operator never writes one (``ckpt claim`` does)."""
        ...

    def reachable(self) -> bool:
        """Whether this is the storage the pods write (False: a local path that does not
        exist in the operator's pod, e.g. a PVC mounted in the job's pods only)."""
        ...

    def close(self) -> None: ...


#: ``await factory(namespace, policy_name, spec)`` → the policy's source.
SourceFactory = Callable[[str, str, CheckpointPolicySpec], Awaitable[CheckpointSource]]


#: Components of a local path looked at, at most (a path is at most PATH_MAX = 4096 bytes).
MAX_COMPONENTS = 2048


def resolve_path(path: str) -> ResolvedPath:
    """``path`` resolved as :class:`~ckpt_agent.storage.fs.LocalStorage` (the pods'
    agents, ``ckpt``) opens it — ``..`` removed as text first (``os.path.abspath``), then
    links resolved (``os.path.realpath``) — with every symbolic link met on the way
    (``lstat`` of each component; nothing opened).

    Components that do not exist yet end the walk (nothing below them can be a link); they
    stay in :attr:`ResolvedPath.resolved` as written. ``ValueError`` for a relative path.
    """
    if not posixpath.isabs(path):
        raise ValueError(f"not an absolute path: {path!r}")
    normal = os.path.abspath(path)
    links: list[PathLink] = []
    prefix = "/"
    for name in normal.split("/")[:MAX_COMPONENTS]:
        if not name:
            continue
        prefix = posixpath.join(prefix, name)
        try:
            st = os.lstat(prefix)
        except OSError:
            break  # missing (or not a folder): nothing further down exists
        if stat_mod.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(prefix)
            except OSError:
                target = "?"
            links.append(PathLink(prefix, target, os.path.realpath(prefix)))
    return ResolvedPath(path, os.path.realpath(normal), tuple(links))


def storage_options_for(
    spec: CheckpointPolicySpec,
    *,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
) -> StorageOptions:
    """StorageOptions equivalent to what the webhook injects into the pods for ``spec``."""
    s3 = spec.storage.s3 if spec.storage.type == StorageType.S3 else None
    return StorageOptions.from_spec(
        s3, access_key_id=access_key_id, secret_access_key=secret_access_key
    )


class StorageCheckpointSource:
    """:class:`CheckpointSource` over a :class:`ckpt_agent.storage.Storage`."""

    def __init__(
        self,
        storage: Storage,
        *,
        gc_grace_s: float = GC_GRACE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.storage = storage
        self.gc_grace_s = gc_grace_s
        self.clock = clock
        self._manifests = ManifestCache()

    @classmethod
    def open(cls, url: str, options: StorageOptions | None = None) -> StorageCheckpointSource:
        return cls(open_storage(url, options))

    def list_checkpoints(
        self, run_id: str, *, include_heartbeat: bool = True
    ) -> list[CheckpointRecord]:
        return list_checkpoints(self.storage, run_id, include_heartbeat=include_heartbeat)

    def scan_checkpoints(self, run_id: str, limits: ListingLimits) -> Listing:
        return scan_checkpoints(self.storage, run_id, include_heartbeat=False, limits=limits)

    def progress(self, run_id: str) -> list[tuple[int, float]]:
        try:
            return [(hb.step, hb.time) for hb in read_heartbeat(self.storage, run_id, 0)]
        except (CheckpointFormatError, StorageError) as e:
            log.warning("run %s: unreadable heartbeat ring: %s", run_id, e)
            return []

    def verify(self, run_id: str, checkpoint_id: str) -> bool:
        tier, step = parse_checkpoint_id(checkpoint_id)
        if tier == Tier.HEARTBEAT:  # no commit, no hashes: the ring must still hold the step
            if any(s == step for s, _ in self.progress(run_id)):
                return True
            raise VerificationFailedError(
                f"{checkpoint_id}: the heartbeat ring of run {run_id} no longer holds step {step}"
            )
        result = verify_hashes(self.storage, run_id, checkpoint_id)
        if not result.ok:
            raise VerificationFailedError(result.reason)
        return True

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        delete_checkpoint(self.storage, run_id, checkpoint_id)

    def delete_checkpoints(self, run_id: str, checkpoint_ids: Sequence[str]) -> None:
        delete_checkpoints(self.storage, run_id, checkpoint_ids)

    def collect_garbage(self, run_id: str) -> GcResult:
        gc = gc_blobs(
            self.storage,
            run_id,
            grace_s=self.gc_grace_s,
            now=self.clock(),
            cache=self._manifests,
        )
        if gc.unreadable_manifests:  # gc_blobs deleted no blob: one might be referenced
            log.warning(
                "run %s: blob GC skipped, unreadable %s", run_id, "; ".join(gc.unreadable_manifests)
            )
        return gc

    def run_owner(self, run_id: str) -> RunOwner | None:
        return read_owner(self.storage, run_id)

    def reachable(self) -> bool:
        if isinstance(self.storage, AnchoredLocalStorage):
            return self.storage.reachable()
        if isinstance(self.storage, LocalStorage):
            return self.storage.root.is_dir()
        return True

    def close(self) -> None:
        self.storage.close()


class ReportedCheckpointSource:
    """:class:`CheckpointSource` over what the pods reported, for storage the operator
    cannot reach (:mod:`ckpt_operator.planners.reports`).

    Nothing can be verified or deleted from here: the restarted pod re-verifies each
    candidate before it loads one (its own ladder), and retention runs in the pods. What
    the pods verified stands in for that re-verification: a committed checkpoint (one with
    a manifest hash) a pod reported corrupted is listed as the checkpoint it was committed
    as (so the ladder keeps its place: the chain through it, the newest full) and fails
    :meth:`verify` with the pod's verdict, as the operator's own hash check fails it on
    storage it can read — the ladder walks on to the rung that storage would give (e.g. a
    heartbeat rebuild, where the only older full checkpoint is not the newest full). One
    without a hash (an unreadable COMMIT) stays corrupted: it has no place in a chain.
    Everything else verifies.
    """

    def __init__(self, records: list[CheckpointRecord]) -> None:
        self.corrupted = {
            r.id: r.extra.get("status_reason") or "corrupted"
            for r in records
            if r.status == CheckpointStatus.CORRUPTED and r.manifest_hash
        }
        self.records = [
            r.with_status(CheckpointStatus.VALID) if r.id in self.corrupted else r for r in records
        ]

    def list_checkpoints(
        self, run_id: str, *, include_heartbeat: bool = True
    ) -> list[CheckpointRecord]:
        del run_id
        return [r for r in self.records if include_heartbeat or r.tier != Tier.HEARTBEAT]

    def scan_checkpoints(self, run_id: str, limits: ListingLimits) -> Listing:
        del limits  # the pods' report: in memory, already bounded
        return Listing(records=self.list_checkpoints(run_id, include_heartbeat=False))

    def progress(self, run_id: str) -> list[tuple[int, float]]:
        del run_id
        return []  # the newest heartbeat is one of the records

    def verify(self, run_id: str, checkpoint_id: str) -> bool:
        why = self.corrupted.get(checkpoint_id)
        if why is not None:
            raise VerificationFailedError(
                f"{checkpoint_id}: {why} (run {run_id}; the pod's verdict, from its "
                "checkpoint report: the operator cannot read this storage)"
            )
        return True  # the pod verifies before loading

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        raise StorageError(
            f"cannot delete {run_id}/{checkpoint_id}: the storage is not reachable from the "
            "operator (retention of PVC storage runs in the pods)"
        )

    def delete_checkpoints(self, run_id: str, checkpoint_ids: Sequence[str]) -> None:
        for checkpoint_id in checkpoint_ids:
            self.delete_checkpoint(run_id, checkpoint_id)

    def collect_garbage(self, run_id: str) -> GcResult:
        del run_id
        return GcResult()

    def run_owner(self, run_id: str) -> RunOwner | None:
        del run_id
        return None  # not readable from here (the pods' agents check it)

    def reachable(self) -> bool:
        return False

    def close(self) -> None:
        pass


#: Seconds a policy's credentials Secret, once read, serves later storage opens: a burst
#: of restarts in one namespace reads it once, not once per restart (issue #19); a
#: rotated key is used within this long (a Secret not found is never remembered).
SECRET_TTL_S = 10.0


class StorageSourceFactory:
    """The production :data:`SourceFactory`: opens (and caches) each policy's storage.

    S3 credentials come from the policy's ``credentialsSecret`` (read through
    ``get_secret`` when ``read_secrets``, at most every :data:`SECRET_TTL_S`), else from
    the operator's own
    environment (``CKPT_S3_*``, the AWS chain: IRSA, instance profile) — the
    latter only where ``tenancy`` grants it. Nothing is opened for a policy that
    :func:`ckpt_operator.planners.tenancy.storage_refusal` refuses
    (:class:`StorageAccessDeniedError`). A local path is then resolved
    (:func:`~ckpt_agent.storage.anchored.resolve_path`) and checked again as the kernel
    will open it (:func:`~ckpt_operator.planners.tenancy.resolved_refusal`:
    :class:`GrantEscapeError` naming the link); the storage is rooted at the resolved
    path and opened from the grant without following links
    (:class:`~ckpt_agent.storage.anchored.AnchoredLocalStorage`), so a link swapped in
    later is refused, not followed. S3 connect/read timeouts are capped at
    ``timeout_s``, and so is the wait for opening the storage.
    """

    def __init__(
        self,
        get_secret: Callable[[str, str], Awaitable[dict[str, str] | None]],
        *,
        read_secrets: bool = True,
        gc_grace_s: float = GC_GRACE_S,
        tenancy: TenancyConfig | None = None,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._get_secret = get_secret
        self._clock = clock
        self._secrets: dict[tuple[str, str], tuple[float, dict[str, str]]] = {}
        self._read_secrets = read_secrets
        self._gc_grace_s = gc_grace_s
        self._tenancy = tenancy if tenancy is not None else TenancyConfig()
        self._timeout_s = timeout_s
        self._cache: dict[tuple[str, str], tuple[object, StorageCheckpointSource]] = {}

    async def __call__(
        self, namespace: str, policy: str, spec: CheckpointPolicySpec
    ) -> CheckpointSource:
        key_id = secret = None
        s3 = spec.storage.s3 if spec.storage.type == StorageType.S3 else None
        if s3 is not None and s3.credentials_secret is not None and self._read_secrets:
            ref = s3.credentials_secret
            data = await self._secret(namespace, ref.name)
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
        own_identity = key_id is None
        refusal = storage_refusal(namespace, spec, self._tenancy, operator_identity=own_identity)
        if refusal is not None:
            raise StorageAccessDeniedError(f"policy {namespace}/{policy}: {refusal}")
        options = storage_options_for(spec, access_key_id=key_id, secret_access_key=secret)
        options = options.replace(
            connect_timeout_s=min(options.connect_timeout_s, self._timeout_s),
            read_timeout_s=min(options.read_timeout_s, self._timeout_s),
        )
        if not own_identity:  # the tenant's keys, never mixed with the operator's session
            options = options.replace(session_token=None, profile=None)
        fingerprint = (spec.storage.url(), options)
        cached = self._cache.get((namespace, policy))
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        try:
            storage = await asyncio.wait_for(
                asyncio.to_thread(self._open, namespace, policy, spec, options), self._timeout_s
            )
        except TimeoutError:
            raise StorageTimeoutError(
                f"opening {spec.storage.url()} took over {self._timeout_s:.0f}s"
            ) from None
        source = StorageCheckpointSource(storage, gc_grace_s=self._gc_grace_s)
        if cached is not None:
            cached[1].close()
        self._cache[(namespace, policy)] = (fingerprint, source)
        return source

    def _open(
        self, namespace: str, policy: str, spec: CheckpointPolicySpec, options: StorageOptions
    ) -> Storage:
        """Open the policy's storage; a local path resolved, checked and anchored at its grant."""
        if spec.storage.type != StorageType.LOCAL:
            return open_storage(spec.storage.url(), options)
        path = resolve_path(spec.storage.local.path)
        grants = [resolve_path(g).resolved for g in granted_paths(namespace, self._tenancy)]
        refusal = resolved_refusal(namespace, path, grants)
        anchor = grant_anchor(path, grants)
        if refusal is not None or anchor is None:
            raise GrantEscapeError(f"policy {namespace}/{policy}: {refusal}")
        return AnchoredLocalStorage(path.resolved, anchor, options)

    async def _secret(self, namespace: str, name: str) -> dict[str, str] | None:
        now = self._clock()
        read = self._secrets.get((namespace, name))
        if read is not None and now - read[0] < SECRET_TTL_S:
            return read[1]
        data = await self._get_secret(namespace, name)
        if data is None:
            self._secrets.pop((namespace, name), None)
        else:
            self._secrets[(namespace, name)] = (now, data)
        return data

    def close(self) -> None:
        self._secrets.clear()
        for _, source in self._cache.values():
            source.close()
        self._cache.clear()
