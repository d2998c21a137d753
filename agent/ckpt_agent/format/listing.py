"""Listing what storage holds: runs, committed checkpoints and the newest heartbeat.

Torch-free: the operator and ``ckpt list`` use it. A checkpoint exists for
readers only once its ``COMMIT`` is published; its status comes from the
validator's record for exactly that COMMIT.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
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

__all__ = ["list_checkpoints", "list_runs", "newest_heartbeat_record"]

log = logging.getLogger(__name__)


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
    prefix = steps_prefix(run_id)
    folders: dict[str, set[str]] = {}
    for info in storage.list(prefix):
        rest = info.key[len(prefix) :]
        folder, _, name = rest.partition("/")
        if name and "/" not in name:
            folders.setdefault(folder, set()).add(name)
    out: list[CheckpointRecord] = []
    for folder, names in folders.items():
        if COMMIT not in names:
            continue
        try:
            tier, step = parse_checkpoint_id(folder)
        except ValueError:
            continue
        try:
            rec = _record(storage, run_id, folder, names)
        except CheckpointNotFoundError:
            continue  # deleted between listing and reading
        except Exception as e:  # one bad COMMIT never hides the others
            log.warning("run %s: %s is unreadable: %s", run_id, folder, one_line(e))
            if include_broken:
                out.append(
                    CheckpointRecord(
                        id=folder,
                        step=step,
                        tier=tier,
                        status=CheckpointStatus.CORRUPTED,
                        extra={"error": one_line(e)},
                    )
                )
            continue
        out.append(rec)
    if include_heartbeat:
        hb = newest_heartbeat_record(storage, run_id)
        if hb is not None:
            out.append(hb)
    out.sort(key=lambda r: (r.step, list(Tier).index(r.tier)))
    return out


def _record(storage: Storage, run_id: str, folder: str, names: set[str]) -> CheckpointRecord:
    """One checkpoint's record: its COMMIT, and the validator's verdict on exactly it."""
    committed = read_commit(storage, run_id, folder)
    status = CheckpointStatus.PENDING
    reason = ""
    if VALIDATION in names:
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
            "run %s: heartbeat ring of rank %d is unreadable: %s", run_id, rank, one_line(e)
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
