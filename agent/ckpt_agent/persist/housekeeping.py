"""Applying retention to storage, and garbage-collecting blobs no manifest references.

Deleting a checkpoint removes its ``COMMIT`` first (from then on it does not
exist for readers), then the rest of its folder (rank manifests, verdict).
Blobs are shared between checkpoints, so they are removed separately by
:func:`gc_blobs`: every rank manifest still in storage — committed or not,
so an in-flight checkpoint of another rank is respected — marks its blobs as
live; other blobs older than ``grace_s`` are deleted. While any rank manifest
is unreadable (it might reference any blob) no blob is deleted: the result
reports it. Heartbeats are a ring and never deleted here. Torch-free
(``ckpt gc`` and the operator use it too).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.decide.retention import RetentionPlan
from ckpt_agent.errors import CheckpointFormatError, NotFoundError, StorageError
from ckpt_agent.format.layout import (
    AUDIT_TAIL_BYTES,
    COMMIT,
    MANIFEST_MAX_BYTES,
    audit_key,
    blobs_prefix,
    checkpoint_prefix,
    commit_key,
    parse_checkpoint_id,
    steps_prefix,
)
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.format.readers import read_capped
from ckpt_agent.policy.models import Tier
from ckpt_agent.storage.base import Storage
from ckpt_agent.text import clean
from ckpt_agent.tuning import GC_GRACE_S

__all__ = [
    "DELETE_BATCH",
    "DeleteGuard",
    "GcResult",
    "append_audit",
    "apply_retention",
    "delete_checkpoint",
    "delete_checkpoints",
    "gc_blobs",
    "read_audit_tail",
    "who",
]

log = logging.getLogger(__name__)


#: Keys per :meth:`~ckpt_agent.storage.base.Storage.delete_many` call (one S3
#: ``DeleteObjects`` request); a ``guard`` runs before each.
DELETE_BATCH = 1000

#: Called before each batch of deletes; raises to stop (a fenced writer: FencedError).
DeleteGuard = Callable[[], None]


def _no_guard() -> None:
    return None


def delete_checkpoint(
    storage: Storage, run_id: str, ckpt_id: str, *, guard: DeleteGuard | None = None
) -> int:
    """Unpublish (COMMIT first) and delete one checkpoint's folder; returns objects deleted."""
    return delete_checkpoints(storage, run_id, [ckpt_id], guard=guard)


def delete_checkpoints(
    storage: Storage, run_id: str, ckpt_ids: Sequence[str], *, guard: DeleteGuard | None = None
) -> int:
    """Delete checkpoints in batches: each batch's COMMITs in one
    :meth:`~ckpt_agent.storage.base.Storage.delete_many` (from then on they do not exist
    for readers), then their folders. ``guard`` runs before each batch; if a COMMIT
    batch fails nothing more is deleted (a folder left without its COMMIT is an
    uncommitted leftover that :func:`gc_blobs` removes later)."""
    check = guard or _no_guard
    n = 0
    for i in range(0, len(ckpt_ids), DELETE_BATCH):
        batch = ckpt_ids[i : i + DELETE_BATCH]
        check()
        n += storage.delete_many([commit_key(run_id, c) for c in batch])
        for ckpt_id in batch:
            n += storage.delete_prefix(checkpoint_prefix(run_id, ckpt_id))
    return n


def apply_retention(
    storage: Storage,
    run_id: str,
    plan: RetentionPlan,
    *,
    dry_run: bool = False,
    guard: DeleteGuard | None = None,
) -> list[str]:
    """Delete the plan's checkpoints in its deletion order; returns the ids deleted.

    ``guard`` runs before each batch of deletes (a writer's fence check)."""
    deleted: list[str] = []
    for ckpt_id in plan.deletion_order:
        try:
            tier, _ = parse_checkpoint_id(ckpt_id)
        except ValueError:
            continue
        if tier == Tier.HEARTBEAT:
            continue  # the heartbeat ring is not a folder
        deleted.append(ckpt_id)
    if not dry_run and deleted:
        delete_checkpoints(storage, run_id, deleted, guard=guard)
    return deleted


@dataclass
class GcResult:
    """What :func:`gc_blobs` found and did."""

    referenced: int = 0
    """Distinct blobs referenced by some manifest."""
    deleted: list[str] = field(default_factory=list)
    """Digests deleted (or that would be, with ``dry_run``)."""
    freed_bytes: int = 0
    kept_young: int = 0
    """Unreferenced blobs kept because they are younger than the grace period."""
    unreadable_manifests: list[str] = field(default_factory=list)
    """``key: why`` of rank manifests that cannot be read; when any, no blob was deleted."""
    stale_folders: list[str] = field(default_factory=list)
    """Uncommitted checkpoint folders removed (crash leftovers older than the grace period)."""


class ManifestCache:
    """Parsed rank manifests by (key, size, mtime): manifests are immutable once written."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, int, float | None], frozenset[str]] = {}

    def blobs_of(
        self, storage: Storage, key: str, size: int, mtime: float | None
    ) -> frozenset[str]:
        ck = (key, size, mtime)
        hit = self._cache.get(ck)
        if hit is not None:
            return hit
        raw = read_capped(storage, key, MANIFEST_MAX_BYTES)
        refs = frozenset(RankManifest.from_bytes(raw, key).referenced_blobs())
        self._cache[ck] = refs
        return refs

    def retain(self, keys: Iterable[str]) -> None:
        live = set(keys)
        for ck in list(self._cache):
            if ck[0] not in live:
                del self._cache[ck]


def referenced_blobs(
    storage: Storage,
    run_id: str,
    cache: ManifestCache | None = None,
    *,
    skip_folders: Iterable[str] = (),
) -> tuple[set[str], list[str]]:
    """Digests referenced by any rank manifest of the run, and the unreadable manifests."""
    cache = cache or ManifestCache()
    skip = {f"{steps_prefix(run_id)}{f}/" for f in skip_folders}
    refs: set[str] = set()
    bad: list[str] = []
    seen: list[str] = []
    for info in storage.list(steps_prefix(run_id)):
        name = info.key.rsplit("/", 1)[-1]
        if not (name.startswith("rank_") and name.endswith(".json")):
            continue
        if any(info.key.startswith(p) for p in skip):
            continue
        seen.append(info.key)
        try:
            refs |= cache.blobs_of(storage, info.key, info.size, info.mtime)
        except NotFoundError:
            continue
        except (CheckpointFormatError, StorageError) as e:
            bad.append(f"{info.key}: {e}")
    cache.retain(seen)
    return refs, bad


def stale_uncommitted(storage: Storage, run_id: str, *, grace_s: float, now: float) -> list[str]:
    """Folders without a COMMIT whose newest object is older than ``grace_s`` (crash leftovers)."""
    prefix = steps_prefix(run_id)
    newest: dict[str, float | None] = {}
    committed: set[str] = set()
    for info in storage.list(prefix):
        folder, _, rest = info.key[len(prefix) :].partition("/")
        if rest == COMMIT:
            committed.add(folder)
        prev = newest.get(folder, 0.0)
        newest[folder] = None if info.mtime is None or prev is None else max(prev, info.mtime)
    out = []
    for folder, mtime in newest.items():
        if folder in committed or mtime is None:
            continue
        if grace_s <= 0 or now - mtime >= grace_s:
            out.append(folder)
    return sorted(out)


def gc_blobs(
    storage: Storage,
    run_id: str,
    *,
    grace_s: float = GC_GRACE_S,
    dry_run: bool = False,
    now: float | None = None,
    cache: ManifestCache | None = None,
    guard: DeleteGuard | None = None,
) -> GcResult:
    """Delete stale uncommitted folders, then blobs no rank manifest references.

    Blobs (and uncommitted folders) younger than ``grace_s`` are kept: another
    writer may be about to commit them. When a rank manifest outside the stale
    folders cannot be read, no blob is deleted (it might reference any of
    them): ``unreadable_manifests`` says which, and a later pass collects once
    it is repaired or its checkpoint deleted. ``grace_s=0`` is only safe when no
    other writer exists (the single-rank engine, which runs GC between its
    own saves). Deletes go in batches (:meth:`Storage.delete_many`); ``guard`` runs
    before each (a writer's fence check: a fenced writer deletes nothing).
    """
    now = time.time() if now is None else now
    check = guard or _no_guard
    stale = stale_uncommitted(storage, run_id, grace_s=grace_s, now=now)
    if not dry_run and stale:
        check()
        for folder in stale:
            storage.delete_prefix(checkpoint_prefix(run_id, folder))
    refs, bad = referenced_blobs(storage, run_id, cache, skip_folders=stale)
    result = GcResult(referenced=len(refs), unreadable_manifests=bad, stale_folders=stale)
    if bad:
        log.warning(
            "gc: blob collection skipped, %d unreadable manifest(s): %s",
            len(bad),
            clean(", ".join(bad[:3])),
        )
        return result
    doomed: list[str] = []
    for info in storage.list(blobs_prefix(run_id)):
        digest = info.key.rsplit("/", 1)[-1]
        if digest in refs:
            continue
        young = info.mtime is None or now - info.mtime < grace_s
        if young and grace_s > 0:
            result.kept_young += 1
            continue
        doomed.append(info.key)
        result.deleted.append(digest)
        result.freed_bytes += info.size
    if not dry_run:
        for i in range(0, len(doomed), DELETE_BATCH):
            check()
            storage.delete_many(doomed[i : i + DELETE_BATCH])
    return result


def uncommitted_folders(storage: Storage, run_id: str) -> list[str]:
    """Checkpoint folders without a COMMIT (in flight, or left by a crash)."""
    prefix = steps_prefix(run_id)
    names: dict[str, set[str]] = {}
    for info in storage.list(prefix):
        folder, _, rest = info.key[len(prefix) :].partition("/")
        names.setdefault(folder, set()).add(rest)
    return sorted(f for f, n in names.items() if COMMIT not in n)


def who() -> str:
    """``user@host`` of this process (for the audit log)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid:{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def append_audit(storage: Storage, run_id: str, entry: Mapping[str, Any]) -> None:
    """Append one JSON line to ``<run>/audit.log`` (read, append, atomic replace).

    Manual recoveries are rare and made by one person at a time; the replace is
    atomic, so a reader never sees a half-written log. Only the log's last
    :data:`~ckpt_agent.format.layout.AUDIT_TAIL_BYTES` are read and kept (a real log
    never gets there; a forged or damaged one costs no more).
    """
    try:
        old, cut = read_audit_tail(storage, run_id)
    except NotFoundError:
        old, cut = b"", False
    if cut:  # only a damaged or forged log is this large: keep its newest lines
        log.warning(
            "%s: over %d bytes, oldest lines dropped", clean(audit_key(run_id)), AUDIT_TAIL_BYTES
        )
    if old and not old.endswith(b"\n"):
        old += b"\n"
    line = json.dumps(dict(entry), sort_keys=True, separators=(",", ":"), default=str) + "\n"
    storage.commit(audit_key(run_id), old + line.encode())


def read_audit_tail(
    storage: Storage, run_id: str, limit: int = AUDIT_TAIL_BYTES
) -> tuple[bytes, bool]:
    """The newest whole lines of ``<run>/audit.log`` within its last ``limit`` bytes, and
    whether older ones were left out (never more than ``limit`` bytes read).

    :class:`NotFoundError` when the run has no audit log.
    """
    key = audit_key(run_id)
    size = storage.stat(key).size
    if size <= limit:
        return storage.read(key, 0, limit), False
    data = storage.read(key, size - limit - 1, limit + 1)
    # Whole lines only: the byte before the tail tells whether its first line is cut.
    cut = data.find(b"\n")
    return (data[cut + 1 :] if cut >= 0 else b""), True
