"""The shared-memory snapshot area: commit marker, slot protection, torn snapshots."""

from __future__ import annotations

import signal
import struct
from pathlib import Path
from typing import Any

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest
import torch

from ckpt_agent.flash.protocol import ALIGN, HEADER_BYTES, PersistedMark
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.persist.validate import load_check
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.shm.writer import ShmWriter
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.tuning import DIRECT_IO_ALIGN

RUN = w.RUN


def _sidecar(tmp_path: Path, **options: Any) -> Sidecar:
    cfg = AgentConfig.model_validate(
        {
            "runId": RUN,
            "storageUrl": (tmp_path / "store").as_uri(),
            "shmDir": str(tmp_path / "shm"),
            "workDir": str(tmp_path / "sidecar-work"),
            "validation": {"loadInSubprocess": False},
        }
    )
    return Sidecar(cfg, SidecarOptions(probe_every_s=1000, metrics_port=0, **options))


def _state(v: float) -> dict[str, object]:
    return {"model": {"w": torch.full((64, 64), v), "b": torch.arange(64.0) + v}}


def test_descriptor_is_the_commit_marker(tmp_path: Path) -> None:
    writer = ShmWriter(tmp_path / "shm", RUN, 0)
    reader = ShmReader(tmp_path / "shm", RUN, 0)
    assert reader.latest() is None
    d = writer.write(5, Tier.PULSE, _state(1.0))
    assert d is not None and d.seq == 1
    latest = reader.latest()
    assert latest is not None and (latest.step, latest.seq) == (5, 1)
    with reader.open(latest) as snap:
        assert snap is not None
        got = torch.frombuffer(bytearray(snap.tensor("model/w")), dtype=torch.float32)
        assert torch.equal(got, torch.full((64 * 64,), 1.0))
    reader.desc_path(latest.slot).unlink()  # no marker: the snapshot does not exist
    assert reader.latest() is None
    writer.close()


def test_a_view_kept_past_the_snapshot_does_not_fail_the_persist(tmp_path: Path) -> None:
    """A storage client may keep a request body (a slice of the snapshot) after the write
    returned: closing the snapshot must not turn that into a failed persist."""
    writer = ShmWriter(tmp_path / "shm", RUN, 0)
    reader = ShmReader(tmp_path / "shm", RUN, 0)
    d = writer.write(5, Tier.PULSE, _state(1.0))
    assert d is not None
    with reader.open(d) as snap:
        assert snap is not None
        cycle: list[object] = [snap.tensor("model/w")[:16]]
        cycle.append(cycle)  # only the cycle collector frees it
        del cycle
    # the lock is dropped: both slots are free again (the newest is persisted)
    reader.mark(PersistedMark(seq=d.seq, step=5, checkpoint_id="c", ok=True))
    assert writer.write(6, Tier.PULSE, _state(2.0)) is not None
    assert writer.write(7, Tier.PULSE, _state(3.0)) is not None
    writer.close()


def test_newest_unpersisted_snapshot_is_never_overwritten(tmp_path: Path) -> None:
    writer = ShmWriter(tmp_path / "shm", RUN, 0)
    reader = ShmReader(tmp_path / "shm", RUN, 0)
    a = writer.write(1, Tier.PULSE, _state(1.0))
    b = writer.write(2, Tier.PULSE, _state(2.0))
    assert a is not None and b is not None and a.slot != b.slot
    # a persister holds the newest (b): the older slot (a) is free, b is not
    with reader.open(b) as snap:
        assert snap is not None
        c = writer.write(3, Tier.PULSE, _state(3.0))
        assert c is not None and c.slot == a.slot
        # now c is the newest unpersisted one and b is being read: nothing is free
        assert writer.busy
        assert writer.write(4, Tier.PULSE, _state(4.0)) is None
    assert not writer.busy  # b was released (and is older than c)
    writer.close()


def test_a_torn_header_is_never_read(tmp_path: Path) -> None:
    writer = ShmWriter(tmp_path / "shm", RUN, 0)
    d = writer.write(1, Tier.PULSE, _state(1.0))
    assert d is not None
    writer.close()
    reader = ShmReader(tmp_path / "shm", RUN, 0)
    with open(reader.data_path(d.slot), "r+b") as f:  # seq_end != seq_begin
        f.seek(16)
        f.write(struct.pack("<Q", 0))
    with reader.open(d) as snap:
        assert snap is None
    sidecar = _sidecar(tmp_path)
    try:
        assert sidecar.run_once() == 0
    finally:
        sidecar.close()
    assert list_checkpoints(LocalStorage(tmp_path / "store"), RUN) == []


@pytest.mark.distributed
def test_half_written_snapshot_is_never_persisted(tmp_path: Path) -> None:
    """A trainer SIGKILLed in the middle of copying snapshot 2: the persister writes
    snapshot 1 (complete), never the torn one."""
    out = tmp_path / "job"
    codes = h.launch(w.shm_half_write, 1, out, str(tmp_path / "shm"), timeout=60)
    assert codes == [-signal.SIGKILL]
    assert (out / "first_done").exists()
    reader = ShmReader(tmp_path / "shm", RUN, 0)
    complete = reader.complete()
    assert [d.step for d in complete] == [1]
    torn = 1 - complete[0].slot
    assert not reader.desc_path(torn).exists()
    raw = reader.data_path(torn).read_bytes()[:HEADER_BYTES]
    _, begin, end, _ = struct.unpack_from("<8sQQQ", raw)
    assert (begin, end) == (2, 0)  # started, never finished
    assert not reader.trainer_alive()
    sidecar = _sidecar(tmp_path)
    try:
        assert sidecar.run_once() == 1
        assert sidecar.run_once() == 0
    finally:
        sidecar.close()
    store = LocalStorage(tmp_path / "store")
    records = list_checkpoints(store, RUN, include_heartbeat=False)
    assert [(r.step, r.status.value) for r in records] == [(1, "valid")]
    assert load_check(store, RUN, records[0].id).ok


def test_one_sidecar_commits_the_parts_of_every_rank_it_serves(tmp_path: Path) -> None:
    """A pod with two ranks and one sidecar: rank 1's snapshot appears while the sidecar
    already waits in rank 0's commit; it writes rank 1's part meanwhile and commits both.
    A part of another save attempt (other token) is never taken."""
    import threading

    from ckpt_agent.format.readers import read_checkpoint

    w0 = ShmWriter(tmp_path / "shm", RUN, 0, world_size=2)
    w1 = ShmWriter(tmp_path / "shm", RUN, 1, world_size=2)

    def sections(rank: int, token: str) -> dict[str, object]:
        return {"progress": {"step": 5, "rank": rank, "token": token}, **_state(float(rank))}

    assert w0.write(5, Tier.PULSE, sections(0, "t1"), meta={"token": "t1"}) is not None
    timer = threading.Timer(
        0.5, lambda: w1.write(5, Tier.PULSE, sections(1, "t1"), meta={"token": "t1"})
    )
    sidecar = _sidecar(tmp_path, commit_timeout_s=30.0)
    timer.start()
    try:
        assert sidecar.run_once() >= 1
    finally:
        timer.join()
        sidecar.close()
        w0.close()
        w1.close()
    store = LocalStorage(tmp_path / "store")
    records = list_checkpoints(store, RUN, include_heartbeat=False)
    assert [(r.step, r.world_size, r.status.value) for r in records] == [(5, 2, "valid")]
    committed, m1 = read_checkpoint(store, RUN, records[0].id, 1)
    assert [r.rank for r in committed.commit.ranks] == [0, 1]
    assert m1.state["progress"]["token"] == "t1"


def test_rank_0_moves_on_when_the_other_ranks_skipped_its_snapshot(tmp_path: Path) -> None:
    """One sidecar per rank, each persisting the newest snapshot of its area: rank 0's
    takes snapshot 5 and waits for rank 1's part of it, while rank 1's first look finds
    10 already and never writes 5. Rank 0's wait ends as soon as rank 1's part of 10 is
    in storage (not after the commit timeout, with 10 unpersisted meanwhile): it commits
    10. A rare flake of the DDP kill test (no checkpoint at all within 60 s) was this."""
    import threading
    import time

    w0 = ShmWriter(tmp_path / "shm", RUN, 0, world_size=2)
    w1 = ShmWriter(tmp_path / "shm", RUN, 1, world_size=2)

    def sections(rank: int, step: int) -> dict[str, object]:
        token = f"t{step}"
        return {"progress": {"step": step, "rank": rank, "token": token}, **_state(step + rank)}

    def write(w: ShmWriter, rank: int, step: int) -> None:
        assert w.write(step, Tier.PULSE, sections(rank, step), meta={"token": f"t{step}"})

    zero, one = (_sidecar(tmp_path, ranks=(r,), commit_timeout_s=15.0) for r in (0, 1))
    write(w0, 0, 5)
    waiting = threading.Thread(target=zero.run_once)  # writes its part of 5, waits for rank 1
    t0 = time.monotonic()
    waiting.start()
    try:
        time.sleep(0.5)
        write(w1, 1, 5)
        write(w1, 1, 10)
        write(w0, 0, 10)
        assert one.run_once() == 1  # rank 1's newest only: 10 (5 is never written)
        waiting.join(10)
        assert not waiting.is_alive(), "rank 0 still waits for a part that never comes"
        assert time.monotonic() - t0 < 10
        assert zero.run_once() == 1  # 10, committed with rank 1's part
    finally:
        waiting.join()
        for x in (zero, one):
            x.close()
        w0.close()
        w1.close()
    store = LocalStorage(tmp_path / "store")
    records = list_checkpoints(store, RUN, include_heartbeat=False)
    valid = [(r.step, r.world_size) for r in records if r.status.value == "valid"]
    assert valid == [(10, 2)]


def test_large_tensors_are_page_aligned_in_the_slot_and_persisted_direct(
    tmp_path: Path,
) -> None:
    """The persister writes large tensors straight from the slot with O_DIRECT."""
    writer = ShmWriter(tmp_path / "shm", RUN, 0)
    state = {"model": {"b": torch.arange(5.0), "w": torch.randn(512, 1024), "v": torch.randn(3)}}
    d = writer.write(3, Tier.PULSE, state)
    assert d is not None
    assert d.tensors["model/w"].offset % DIRECT_IO_ALIGN == 0
    assert d.tensors["model/b"].offset % ALIGN == 0 and d.tensors["model/v"].offset % ALIGN == 0
    assert d.tensors["model/v"].offset < d.tensors["model/w"].offset + 512 * 1024 * 4 + ALIGN
    sidecar = _sidecar(tmp_path)
    try:
        assert sidecar.run_once() == 1
        store = sidecar.storage
        assert isinstance(store, LocalStorage)
        assert store.direct_io.bytes_written == 2 * 1024 * 1024  # all of model/w
    finally:
        sidecar.close()
    with LocalStorage(tmp_path / "store") as s:
        (ckpt,) = list_checkpoints(s, RUN, include_heartbeat=False)
        assert load_check(s, RUN, ckpt.id).ok
    writer.close()
