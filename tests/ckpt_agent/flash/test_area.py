"""One rank's shared-memory area (flash.area): paths, the slot lock, the header, liveness."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_agent.flash.area import ShmArea, hold_lock, read_header
from ckpt_agent.flash.protocol import HEADER, MAGIC


def test_paths_are_the_protocols_layout(tmp_path: Path) -> None:
    area = ShmArea(tmp_path, "run-1", 3)
    assert area.dir == tmp_path / "run-1" / "rank_00003"
    assert area.data_path(1).name == "slot_1.data"
    assert area.desc_path(1).name == "slot_1.json"
    assert area.persisted_path.name == "persisted.json"
    with pytest.raises(ValueError):
        ShmArea(tmp_path, "run-1", 0, slots=0)


def test_an_empty_area_has_no_snapshot_and_no_live_sides(tmp_path: Path) -> None:
    area = ShmArea(tmp_path, "run-1", 0)
    assert area.complete() == [] and area.latest() is None and area.persisted() is None
    assert not area.trainer_alive() and not area.persister_alive()
    assert ShmArea.ranks(tmp_path, "run-1") == []


def test_hold_lock_is_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "trainer.lock"
    fd = hold_lock(path)
    assert fd >= 0
    try:
        # flock locks belong to the open file description: a second open is refused
        assert hold_lock(path) == -1
    finally:
        os.close(fd)
    again = hold_lock(path)
    assert again >= 0
    os.close(again)


def test_a_liveness_probe_at_the_same_instant_does_not_refuse_the_owner(tmp_path: Path) -> None:
    """A sidecar's probe holds a shared lock for microseconds; a trainer taking its lock
    at that instant waits it out instead of failing with "two trainers on one node?"."""
    import fcntl
    import threading

    path = tmp_path / "trainer.lock"
    path.touch()
    probe = os.open(path, os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH)  # the probe, caught in the act
    threading.Timer(0.05, lambda: fcntl.flock(probe, fcntl.LOCK_UN)).start()
    try:
        fd = hold_lock(path)
        assert fd >= 0
        os.close(fd)
    finally:
        os.close(probe)
    # a lock that stays held is an owner's: refused after the grace
    owner = hold_lock(path)
    try:
        assert hold_lock(path, probe_grace_s=0.05) == -1
    finally:
        os.close(owner)


def test_read_header_needs_the_magic_and_the_whole_header() -> None:
    buf = bytearray(HEADER.size)
    HEADER.pack_into(buf, 0, MAGIC, 7, 7, 4096)
    assert read_header(memoryview(buf)) == (7, 7, 4096)
    assert read_header(memoryview(buf)[: HEADER.size - 1]) is None
    HEADER.pack_into(buf, 0, b"NOTSHM!!", 7, 7, 4096)
    assert read_header(memoryview(buf)) is None
