"""Peers' copies of the step heartbeat records (JIT saves on a node that may be lost)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.errors import ReplicaAuthError, ReplicaError
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.marks import MarkStore, fetch_mark, push_mark
from ckpt_agent.flash.sidecar.step_marks import StepMarkRelay
from ckpt_agent.flash.step_heartbeat import StepHeartbeatSlot, encode_payload, newest_record
from ckpt_agent.format.heartbeat import PackedRng

RUN = "marks-1"


def _record(area: Path, *steps: int, time0: float = 1000.0) -> bytes:
    slot = StepHeartbeatSlot(area)
    for step in steps:
        slot.write(
            step, 0, encode_payload(time0 + step, PackedRng(torch_cpu=b"r" * 64).pack(), None)
        )
    slot.close()
    raw = newest_record(area)
    assert raw is not None
    return raw


def test_the_store_keeps_the_newest_record_per_source_and_rank(tmp_path: Path) -> None:
    store = MarkStore(tmp_path / "shm", RUN)
    area = tmp_path / "area"
    first = _record(area, 1, 2)
    later = _record(area, 3)
    assert store.put("node-a", 2, later).heartbeat.step == 3
    assert store.put("node-a", 2, first).heartbeat.step == 3  # an older one never wins
    held = store.newest(2)
    assert held is not None and (held.source, held.record.heartbeat.step) == ("node-a", 3)
    assert store.newest(1) is None
    assert store.path("node-a", 2).is_relative_to(tmp_path / "shm" / RUN / "replica-marks")


def test_across_source_nodes_the_newest_by_time_wins(tmp_path: Path) -> None:
    store = MarkStore(tmp_path / "shm", RUN)
    store.put("node-a", 0, _record(tmp_path / "a", 9, time0=1000.0))
    store.put("node-b", 0, _record(tmp_path / "b", 4, time0=5000.0))  # the rank moved to b
    held = store.newest(0)
    assert held is not None and (held.source, held.record.heartbeat.step) == ("node-b", 4)


def test_a_corrupted_or_foreign_push_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    store = MarkStore(tmp_path / "shm", RUN)
    raw = bytearray(_record(tmp_path / "a", 1))
    raw[-1] ^= 0xFF
    with pytest.raises(ReplicaError, match="step heartbeat of rank 0 from node-a"):
        store.put("node-a", 0, bytes(raw))
    with pytest.raises(ValueError):
        store.put("../escape", 0, _record(tmp_path / "b", 1))
    with pytest.raises(ReplicaError, match="invalid rank"):
        store.put("node-a", -1, _record(tmp_path / "c", 1))
    assert not (tmp_path / "shm").exists() or not any((tmp_path / "shm").rglob("*.rec"))


def test_a_record_corrupted_at_rest_is_as_if_none(tmp_path: Path) -> None:
    store = MarkStore(tmp_path / "shm", RUN)
    store.put("node-a", 0, _record(tmp_path / "a", 1))
    path = store.path("node-a", 0)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.newest(0) is None


class _Replicator:
    def __init__(self) -> None:
        self.offered: list[tuple[int, bytes]] = []

    def offer_mark(self, rank: int, raw: bytes) -> None:
        self.offered.append((rank, raw))


class _State:
    def __init__(self, area: Path) -> None:
        self.claimed = True
        self.reader = type("R", (), {"dir": area})()


class _Areas:
    def __init__(self, states: dict[int, _State]) -> None:
        self.states = states


def test_the_sidecar_relays_each_new_record_once(tmp_path: Path) -> None:
    rep = _Replicator()
    relay = StepMarkRelay(rep)  # type: ignore[arg-type]
    areas = _Areas({0: _State(tmp_path / "r0"), 1: _State(tmp_path / "r1")})
    (tmp_path / "r1").mkdir()
    _record(tmp_path / "r0", 1)
    assert relay.poll(areas) == 1  # type: ignore[arg-type]
    assert relay.poll(areas) == 0  # type: ignore[arg-type]  # nothing new
    _record(tmp_path / "r0", 2, 3)
    assert relay.poll(areas) == 1  # type: ignore[arg-type]  # coalesced: the newest only
    assert [r for r, _ in rep.offered] == [0, 0]
    from ckpt_agent.flash.step_heartbeat import decode_record

    assert decode_record(rep.offered[-1][1]).heartbeat.step == 3


def test_a_record_pushed_to_a_peer_comes_back_from_it(
    tmp_path: Path, serve: Any, scope: JobScope
) -> None:
    marks = MarkStore(tmp_path / "shm-b", RUN)
    _, peer = serve(marks=marks)
    raw = _record(tmp_path / "a", 7, 8)
    assert fetch_mark(peer, scope, 3) is None  # nothing held yet
    push_mark(peer, scope, source="node-a", rank=3, raw=raw)
    held = fetch_mark(peer, scope, 3)
    assert held is not None and (held.source, held.raw) == ("node-a", raw)
    assert held.record.heartbeat.step == 8


def test_another_job_can_neither_push_nor_read_a_record(
    tmp_path: Path, serve: Any, scope: JobScope
) -> None:
    marks = MarkStore(tmp_path / "shm-b", RUN)
    _, peer = serve(marks=marks)
    push_mark(peer, scope, source="node-a", rank=0, raw=_record(tmp_path / "a", 1))
    other = JobScope("team-b", "job-9", b"another-secret-of-32-bytes-long!")
    with pytest.raises(ReplicaAuthError):
        push_mark(peer, other, source="node-x", rank=0, raw=_record(tmp_path / "x", 99))
    with pytest.raises(ReplicaAuthError):
        fetch_mark(peer, other, 0)
    held = marks.newest(0)
    assert held is not None and held.source == "node-a"


def test_a_corrupted_push_is_refused_with_the_reason(
    tmp_path: Path, serve: Any, scope: JobScope
) -> None:
    marks = MarkStore(tmp_path / "shm-b", RUN)
    server, peer = serve(marks=marks)
    raw = bytearray(_record(tmp_path / "a", 1))
    raw[-1] ^= 0xFF
    with pytest.raises(ReplicaError, match="step heartbeat of rank 0 from node-a"):
        push_mark(peer, scope, source="node-a", rank=0, raw=bytes(raw))
    assert marks.newest(0) is None and server.stats.failed == 1
