"""Bounded listing (issue #28): scan_checkpoints stops at its bounds and says so, streams
folder by folder, names the largest rank manifest, and logs garbage once, not per COMMIT."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ckpt_agent.format.layout import validation_key
from ckpt_agent.format.listing import ListingLimits, list_checkpoints, scan_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"


def _valid(store: LocalStorage, step: int) -> str:
    writer = CheckpointWriter(store, RUN, codec=CodecPolicy(codec="none"))
    meta = CheckpointMeta(run_id=RUN, step=step, tier=Tier.FULL, created_at=1000.0 + step)
    data = memoryview(bytes(8))
    rank = writer.write_rank(meta, 0, {"w": 1}, [TensorSource("w", "uint8", (8,), data)])
    done = writer.commit(meta, [rank])
    verdict = ValidationVerdict(meta.checkpoint_id, done.manifest_hash, CheckpointStatus.VALID)
    store.commit(validation_key(RUN, meta.checkpoint_id), verdict.to_bytes())
    return meta.checkpoint_id


def _garbage(root: Path, steps: range) -> list[str]:
    """Folders holding only a COMMIT that is not JSON (os calls: fast)."""
    out = []
    for step in steps:
        cid = checkpoint_id(Tier.PULSE, step)
        folder = root / RUN / "steps" / cid
        folder.mkdir(parents=True)
        (folder / "COMMIT").write_bytes(b"\x00 not a commit")
        out.append(cid)
    return out


class _CountingStorage(LocalStorage):
    """Counts the keys the listing pulls from the storage's (lazy) listing."""

    pulled = 0

    def list(self, prefix: str = "", *, delimiter: str | None = None):  # type: ignore[no-untyped-def]
        for info in super().list(prefix, delimiter=delimiter):
            self.pulled += 1
            yield info


def test_unbounded_scan_is_list_checkpoints(ck_store: LocalStorage) -> None:
    good = _valid(ck_store, 10**6)
    bad = _garbage(ck_store.root, range(3))
    listing = scan_checkpoints(ck_store, RUN, include_heartbeat=False)
    assert listing.complete and listing.cut == "" and listing.unreadable == 3
    assert [r.id for r in listing.records] == [*bad, good]
    assert listing.records == list_checkpoints(ck_store, RUN, include_heartbeat=False)
    assert [r.status for r in listing.records] == [CheckpointStatus.CORRUPTED] * 3 + [
        CheckpointStatus.VALID
    ]


def test_the_entry_bound_stops_the_walk_and_says_so(tmp_path: Path) -> None:
    store = _CountingStorage(tmp_path / "store")
    _garbage(store.root, range(500))
    listing = scan_checkpoints(store, RUN, limits=ListingLimits(max_entries=100))
    assert not listing.complete and "100 entries (the bound)" in listing.cut
    assert listing.entries == 100 and store.pulled <= 101  # nothing listed past the bound
    # the folder the bound cut through is left out; the ones before it are whole
    assert len(listing.records) == 99 and listing.unreadable == 99


def test_the_deadline_stops_the_walk_and_says_so(ck_store: LocalStorage) -> None:
    _garbage(ck_store.root, range(50))
    ticks = iter(range(10**6))

    def clock() -> float:
        return float(next(ticks))

    listing = scan_checkpoints(ck_store, RUN, limits=ListingLimits(deadline=20.0, clock=clock))
    assert not listing.complete and "out of time" in listing.cut
    assert listing.entries == 20 and len(listing.records) == 19


def test_a_deadline_already_past_reads_nothing(ck_store: LocalStorage) -> None:
    _valid(ck_store, 1)
    listing = scan_checkpoints(
        ck_store, RUN, include_heartbeat=False, limits=ListingLimits(deadline=0.0)
    )
    assert listing.records == [] and listing.entries == 0 and not listing.complete


def test_the_largest_rank_manifest_is_named_committed_or_not(ck_store: LocalStorage) -> None:
    _valid(ck_store, 1)
    stray = ck_store.root / RUN / "steps" / checkpoint_id(Tier.FULL, 2)
    stray.mkdir()
    with open(stray / "rank_00000.json", "wb") as f:
        os.truncate(f.fileno(), 24 << 20)  # sparse: costs no disk
    listing = scan_checkpoints(ck_store, RUN)
    assert listing.largest_manifest == (f"{RUN}/steps/{stray.name}/rank_00000.json", 24 << 20)
    assert len(listing.records) == 1  # the uncommitted folder is no checkpoint


def test_garbage_is_logged_once_not_per_commit(
    ck_store: LocalStorage, caplog: pytest.LogCaptureFixture
) -> None:
    _garbage(ck_store.root, range(40))
    with caplog.at_level(logging.WARNING, logger="ckpt_agent.format.listing"):
        listing = scan_checkpoints(ck_store, RUN)
    assert listing.unreadable == 40
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6 and "35 more unreadable COMMIT(s)" in lines[-1]


def test_folders_are_read_as_they_end_not_after_the_whole_listing(
    ck_store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streaming: a folder's COMMIT is read as soon as the listing reaches the next folder
    (no map of every key of the run is built first)."""
    _garbage(ck_store.root, range(5))
    events: list[str] = []
    real_list, real_read = ck_store.list, ck_store.read

    def listing(prefix: str = "", *, delimiter: str | None = None):  # type: ignore[no-untyped-def]
        for info in real_list(prefix, delimiter=delimiter):
            events.append(f"list {info.key.split('/')[2]}")
            yield info

    def read(key: str, start: int = 0, length: int | None = None) -> bytes:
        events.append(f"read {key.split('/')[2]}")
        return real_read(key, start, length)

    monkeypatch.setattr(ck_store, "list", listing)
    monkeypatch.setattr(ck_store, "read", read)
    scan_checkpoints(ck_store, RUN, include_heartbeat=False)
    first, third = checkpoint_id(Tier.PULSE, 0), checkpoint_id(Tier.PULSE, 2)
    assert events.index(f"read {first}") < events.index(f"list {third}")
