"""Listing what storage holds: runs, committed checkpoints and the newest heartbeat.

Torch-free: the operator and ``ckpt list`` use it. A checkpoint exists for
readers only once its ``COMMIT`` is published; its status comes from the
validator's record for exactly that COMMIT.

:func:`scan_checkpoints` is the one walk behind :func:`list_checkpoints`: one lazy,
paginated listing of ``<run>/steps/`` taken folder by folder (a folder's keys are
contiguous in key order), each COMMIT read as its folder ends, nothing kept of a folder
but its record. :class:`ListingLimits` bounds it (keys examined, a deadline): the
operator's retention pass never walks more of a run than its share of the pass allows,
and learns that it did not see the whole run (:attr:`Listing.complete`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.errors import CheckpointNotFoundError, one_line
from ckpt_agent.format.heartbeat import read_heartbeat
from ckpt_agent.format.layout import (
    COMMIT,
    VALIDATION,
    dumps,
    heartbeat_key,
    is_run_id,
    parse_checkpoint_id,
    sha256_hex,
    steps_prefix,
)
from ckpt_agent.format.readers import read_commit, read_validation
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, checkpoint_id
from ckpt_agent.storage.base import Storage
from ckpt_agent.text import clean

__all__ = [
    "Listing",
    "ListingLimits",
    "list_checkpoints",
    "list_runs",
    "newest_heartbeat_record",
    "scan_checkpoints",
]

log = logging.getLogger(__name__)

#: Unreadable COMMITs of one listing named one per log line; the rest are counted in one.
WARN_EACH = 5


def list_runs(storage: Storage) -> list[str]:
    """Run ids with at least one object under ``<run>/steps/``."""
    out: list[str] = []
    for info in storage.list("", delimiter="/"):
        if info.is_prefix:
            run = info.key.rstrip("/")
            if is_run_id(run) and any(True for _ in _take(storage.list(f"{run}/steps/"), 1)):
                out.append(run)
    return out


def _take(it: Iterator[Any], n: int) -> Iterator[Any]:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


@dataclass(frozen=True)
class ListingLimits:
    """How much of a run one listing may examine (None: no bound)."""

    max_entries: int | None = None
    """Keys of ``<run>/steps/`` looked at (each COMMIT read counts with its key)."""
    deadline: float | None = None
    """``clock()`` value after which the listing stops (checked before every key)."""
    clock: Callable[[], float] = time.monotonic


@dataclass
class Listing:
    """What :func:`scan_checkpoints` found, and whether it saw the whole run."""

    records: list[CheckpointRecord] = field(default_factory=list)
    """Committed checkpoints seen, oldest first (step, then tier)."""
    entries: int = 0
    """Keys of ``<run>/steps/`` examined."""
    cut: str = ""
    """Why the listing stopped before the end of the run ("" when it saw all of it)."""
    unreadable: int = 0
    """COMMITs that could not be read or parsed (listed as corrupted)."""
    largest_manifest: tuple[str, int] | None = None
    """Key and size of the largest rank manifest (``rank_*.json``) seen, committed or not:
    what a blob GC of the run would parse."""

    @property
    def complete(self) -> bool:
        return not self.cut


def list_checkpoints(
    storage: Storage, run_id: str, *, include_broken: bool = True, include_heartbeat: bool = True
) -> list[CheckpointRecord]:
    """Every committed checkpoint of ``run_id``, oldest first (step, then tier).

    One paginated listing of ``<run>/steps/`` plus one read of each COMMIT
    (and VALIDATION.json, when present). Status: ``valid``/``corrupted`` from
    the validator's record for exactly this COMMIT, else ``pending`` (never
    offered for resume before it is verified). A COMMIT that cannot be read or
    parsed (malformed, past the format's limits, a storage error: anything) is
    reported as ``corrupted`` with a one-line ``extra["error"]`` naming it,
    unless ``include_broken=False``; the others are listed all the same.
    Folders without a COMMIT do not exist. With ``include_heartbeat`` the
    newest L0 heartbeat of rank 0 is listed too
    (:func:`newest_heartbeat_record`), for the ladder's heartbeat rung.
    """
    return scan_checkpoints(
        storage, run_id, include_broken=include_broken, include_heartbeat=include_heartbeat
    ).records


@dataclass
class _Folder:
    """One checkpoint folder while the listing walks it: only what its record needs."""

    name: str
    commit: bool = False
    validation: bool = False


def scan_checkpoints(
    storage: Storage,
    run_id: str,
    *,
    include_broken: bool = True,
    include_heartbeat: bool = True,
    limits: ListingLimits | None = None,
) -> Listing:
    """:func:`list_checkpoints` with bounds: stops before the key past
    ``limits.max_entries`` or once ``limits.deadline`` has passed, and says so in
    :attr:`Listing.cut` (the records then cover the folders seen whole, in key order:
    the oldest steps of each tier first). A folder the bound cuts through is left out.

    Unreadable COMMITs are logged by name up to :data:`WARN_EACH` per listing, then
    counted in one line (50,000 garbage COMMITs make one warning, not 50,000).
    """
    limits = limits or ListingLimits()
    prefix = steps_prefix(run_id)
    out = Listing()
    bad: list[str] = []
    current: _Folder | None = None
    for info in storage.list(prefix):
        if limits.max_entries is not None and out.entries >= limits.max_entries:
            out.cut = f"stopped after {out.entries:,} entries (the bound)"
            current = None
            break
        if limits.deadline is not None and limits.clock() >= limits.deadline:
            out.cut = f"stopped after {out.entries:,} entries (out of time)"
            current = None
            break
        out.entries += 1
        rest = info.key[len(prefix) :]
        folder, _, name = rest.partition("/")
        if not name or "/" in name:
            continue
        manifest = name.startswith("rank_") and name.endswith(".json")  # what the GC reads
        if manifest and (out.largest_manifest is None or info.size > out.largest_manifest[1]):
            out.largest_manifest = (info.key, info.size)
        if current is None or current.name != folder:
            if current is not None:
                _add(storage, run_id, current, out, bad, include_broken)
            current = _Folder(folder)
        if name == COMMIT:
            current.commit = True
        elif name == VALIDATION:
            current.validation = True
    if current is not None:
        _add(storage, run_id, current, out, bad, include_broken)
    if len(bad) > WARN_EACH:
        log.warning(
            "run %s: %d more unreadable COMMIT(s), listed as corrupted (first: %s)",
            clean(run_id),
            len(bad) - WARN_EACH,
            clean(bad[WARN_EACH]),
        )
    if include_heartbeat:
        hb = newest_heartbeat_record(storage, run_id)
        if hb is not None:
            out.records.append(hb)
    tiers = list(Tier)
    out.records.sort(key=lambda r: (r.step, tiers.index(r.tier)))
    return out


def _add(
    storage: Storage,
    run_id: str,
    folder: _Folder,
    out: Listing,
    bad: list[str],
    include_broken: bool,
) -> None:
    """The record of one folder seen whole, when it is a committed checkpoint."""
    if not folder.commit:
        return
    try:
        tier, step = parse_checkpoint_id(folder.name)
    except ValueError:
        return
    try:
        rec = _record(storage, run_id, folder.name, folder.validation)
    except CheckpointNotFoundError:
        return  # deleted between listing and reading
    except Exception as e:  # one bad COMMIT never hides the others
        error = one_line(e)
        out.unreadable += 1
        bad.append(folder.name)
        if len(bad) <= WARN_EACH:
            log.warning("run %s: %s is unreadable: %s", clean(run_id), clean(folder.name), error)
        if include_broken:
            out.records.append(
                CheckpointRecord(
                    id=folder.name,
                    step=step,
                    tier=tier,
                    status=CheckpointStatus.CORRUPTED,
                    extra={"error": error},
                )
            )
        return
    out.records.append(rec)


def _record(storage: Storage, run_id: str, folder: str, has_verdict: bool) -> CheckpointRecord:
    """One checkpoint's record: its COMMIT, and the validator's verdict on exactly it."""
    committed = read_commit(storage, run_id, folder)
    status = CheckpointStatus.PENDING
    reason = ""
    if has_verdict:
        v = read_validation(storage, run_id, folder)
        if v is not None and v.commit_sha256 == committed.manifest_hash:
            status = v.status
            reason = v.reason
    rec = committed.commit.record(committed.manifest_hash, status)
    if reason:
        rec.extra["status_reason"] = reason
    return rec


def newest_heartbeat_record(
    storage: Storage, run_id: str, rank: int = 0
) -> CheckpointRecord | None:
    """The newest L0 heartbeat of ``rank`` as a record (``heartbeat_step_<n>``), if any.

    Heartbeats live in a ring object, not in ``steps/``; a readable ring is
    ``valid`` (its JSON is its integrity check). Retention never deletes it.
    """
    try:
        entries = read_heartbeat(storage, run_id, rank)
    except Exception as e:  # an unreadable ring is no heartbeat, never a failed listing
        log.warning(
            "run %s: heartbeat ring of rank %d is unreadable: %s", clean(run_id), rank, one_line(e)
        )
        return None
    if not entries:
        return None
    hb = entries[-1]
    return CheckpointRecord(
        id=checkpoint_id(Tier.HEARTBEAT, hb.step),
        step=hb.step,
        tier=Tier.HEARTBEAT,
        status=CheckpointStatus.VALID,
        created_at=hb.time,
        manifest_hash=sha256_hex(dumps(hb.to_json())),
        reason="L0 heartbeat",
        extra={"ring": heartbeat_key(run_id, rank)},
    )
