"""Every step's heartbeat in shared memory (``jitSave``): two halves, a torn write never read."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ckpt_agent.flash.step_heartbeat import (
    HALF_BYTES,
    STEP_HEARTBEAT_FILE,
    StepHeartbeatSlot,
    encode_payload,
    read_step_heartbeat,
)
from ckpt_agent.format.heartbeat import PackedRng

RNG = PackedRng(torch_cpu=bytes(range(256)) * 4)


def _write(slot: StepHeartbeatSlot, step: int, epoch: int = 0, data: object = None) -> None:
    slot.write(step, epoch, encode_payload(1000.0 + step, RNG.pack(), data))


def test_the_newest_record_is_read_back_whole(tmp_path: Path) -> None:
    slot = StepHeartbeatSlot(tmp_path)
    for step in range(5):
        _write(slot, step, epoch=2, data={"pos": step + 1})
    got = read_step_heartbeat(tmp_path)
    assert got is not None
    assert (got.heartbeat.step, got.epoch, got.heartbeat.data) == (4, 2, {"pos": 5})
    assert got.heartbeat.rng_packed == RNG and got.heartbeat.time == 1004.0
    slot.close()


def test_nothing_there_is_none(tmp_path: Path) -> None:
    assert read_step_heartbeat(tmp_path) is None
    StepHeartbeatSlot(tmp_path).close()  # created, never written
    assert read_step_heartbeat(tmp_path) is None


def test_a_record_torn_mid_write_leaves_the_previous_one(tmp_path: Path) -> None:
    slot = StepHeartbeatSlot(tmp_path)
    _write(slot, 7)
    _write(slot, 8)
    path = tmp_path / STEP_HEARTBEAT_FILE
    raw = bytearray(path.read_bytes())
    off = (2 % 2) * HALF_BYTES  # step 8 is the second record: sequence 2
    raw[off + 60] ^= 0xFF  # its payload changed after the header was written
    path.write_bytes(bytes(raw))
    got = read_step_heartbeat(tmp_path)
    assert got is not None and got.heartbeat.step == 7


def test_a_torn_header_is_refused_too(tmp_path: Path) -> None:
    slot = StepHeartbeatSlot(tmp_path)
    _write(slot, 7)
    _write(slot, 8)
    path = tmp_path / STEP_HEARTBEAT_FILE
    raw = bytearray(path.read_bytes())
    struct.pack_into("<q", raw, 20, 9)  # the second record's step field, not its CRC
    path.write_bytes(bytes(raw))
    got = read_step_heartbeat(tmp_path)
    assert got is not None and got.heartbeat.step == 7


def test_both_halves_torn_is_none(tmp_path: Path) -> None:
    slot = StepHeartbeatSlot(tmp_path)
    _write(slot, 1)
    _write(slot, 2)
    path = tmp_path / STEP_HEARTBEAT_FILE
    raw = bytearray(path.read_bytes())
    for half in (0, 1):
        raw[half * HALF_BYTES + 60] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert read_step_heartbeat(tmp_path) is None


def test_a_new_writer_continues_the_sequence(tmp_path: Path) -> None:
    first = StepHeartbeatSlot(tmp_path)
    for step in range(3):
        _write(first, step)
    first.close()
    again = StepHeartbeatSlot(tmp_path)  # the restarted trainer
    _write(again, 10)
    got = read_step_heartbeat(tmp_path)
    assert got is not None and (got.heartbeat.step, got.seq) == (10, 4)


def test_a_data_position_over_the_room_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    slot = StepHeartbeatSlot(tmp_path)
    _write(slot, 1)
    with pytest.raises(ValueError, match="keep the data position small"):
        _write(slot, 2, data={"ids": "x" * HALF_BYTES})
    got = read_step_heartbeat(tmp_path)
    assert got is not None and got.heartbeat.step == 1


def test_a_record_travels_whole_and_installs_in_a_new_area(tmp_path: Path) -> None:
    from ckpt_agent.flash.step_heartbeat import (
        decode_record,
        install_record,
        newest_record,
        peek_seq,
    )

    old, new = tmp_path / "lost-node", tmp_path / "new-node"
    slot = StepHeartbeatSlot(old)
    for step in (4, 5, 6):
        _write(slot, step, epoch=3, data={"pos": step})
    assert peek_seq(old) == 3 and peek_seq(new) == 0
    raw = newest_record(old)
    assert raw is not None and decode_record(raw).heartbeat.step == 6
    with pytest.raises(ValueError, match="not a whole"):
        decode_record(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(ValueError, match="not a whole"):
        decode_record(raw + b"x")
    new.mkdir()
    installed = install_record(new, raw)
    got = read_step_heartbeat(new)
    assert got is not None and installed.heartbeat == got.heartbeat
    assert (got.heartbeat.step, got.epoch, got.heartbeat.data) == (6, 3, {"pos": 6})
