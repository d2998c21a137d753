"""Rehydration's protocol files, the choice of a replica and its installation into an area
(flash.replica.rehydrate)."""

from __future__ import annotations

from pathlib import Path

import pytest
from replica_helpers import RUN, make_snap, pattern

from ckpt_agent.flash import checksums
from ckpt_agent.flash.area import ShmArea
from ckpt_agent.flash.reader import ShmReader, verify_snapshot
from ckpt_agent.flash.replica import rehydrate
from ckpt_agent.flash.replica.client import Peer
from ckpt_agent.flash.replica.fetch import Replica
from ckpt_agent.flash.replica.rehydrate import (
    ANSWER,
    Held,
    RehydrateAnswer,
    install,
    newest_held,
    read_answer,
    read_request,
    write_answer,
    write_request,
)


def test_a_request_and_its_answer_are_matched_by_nonce(tmp_path: Path) -> None:
    area = ShmArea(tmp_path, RUN, 3)
    assert read_request(area) is None
    write_request(area, "n1")
    assert read_request(area) == "n1"
    assert read_answer(area, "n1") is None
    write_answer(area, RehydrateAnswer("n1", True, "step 9", step=9, seq=2, source="node-a"))
    assert read_answer(area, "n0") is None  # an answer to another request
    got = read_answer(area, "n1")
    assert got == RehydrateAnswer("n1", True, "step 9", step=9, seq=2, source="node-a")
    (area.dir / ANSWER).write_text('{"format": "something else", "nonce": "n1"}')
    assert read_answer(area, "n1") is None
    (area.dir / ANSWER).write_text("{not json")
    assert read_answer(area, "n1") is None


def test_the_newest_replica_of_the_rank_comes_first_this_nodes_own_among_equals() -> None:
    p1, p2 = Peer("p1", 7471), Peer("p2", 7471)
    listed: list[tuple[Peer | None, dict[str, object]]] = [
        (p1, {"source": "a", "rank": 0, "step": 10, "seq": 4}),
        (p2, {"source": "a", "rank": 0, "step": 20, "seq": 5}),
        (None, {"source": "b", "rank": 0, "step": 20, "seq": 3}),
        (p1, {"source": "a", "rank": 1, "step": 99, "seq": 9}),  # another rank
        (p1, {"source": "a", "rank": 0, "step": "30", "seq": 1}),  # malformed
        (p1, {"source": "a", "rank": 0, "step": True, "seq": 1}),  # malformed
        (p1, {"rank": 0, "step": 40, "seq": 1}),  # no source
    ]
    assert newest_held(listed, 0) == [
        Held(None, "b", 20, 3),
        Held(p2, "a", 20, 5),
        Held(p1, "a", 10, 4),
    ]
    assert newest_held(listed, 2) == []


def _replica(step: int = 42, seq: int = 7, rank: int = 0) -> tuple[Replica, dict[str, bytes]]:
    tensors = {"w": pattern(3000, 1), "b": pattern(100, 2)}
    snap = make_snap(tensors, step=step, seq=seq, rank=rank, files={"cfg": b"{}"})
    return Replica("node-a", rank, snap.desc, memoryview(snap.slot)), {**tensors, "cfg": b"{}"}


def test_an_installed_replica_is_a_complete_snapshot_with_hashes_marked_handled(
    tmp_path: Path,
) -> None:
    reader = ShmReader(tmp_path / "shm-c", RUN, 0)
    replica, content = _replica()
    desc = install(reader, replica)
    assert (desc.step, desc.seq, desc.tier, desc.tree) == (
        42,
        1,
        replica.desc.tier,
        replica.desc.tree,
    )
    assert reader.latest() == desc
    hashes = reader.hashes(desc.slot, desc.seq)
    assert hashes is not None and hashes.fast is not None
    with reader.open(desc) as snap:
        assert snap is not None
        assert verify_snapshot(snap, hashes) == []
        for name, data in content.items():
            view = snap.file(name) if name in desc.files else snap.tensor(name)
            assert bytes(view) == data
    mark = reader.persisted()
    assert mark is not None and mark.seq == desc.seq and not mark.committed  # not persisted here
    again = install(reader, _replica(step=50, seq=3)[0])
    assert (again.seq, again.step) == (2, 50) and again.slot != desc.slot
    assert reader.latest() == again


def test_a_replica_of_another_rank_or_run_is_not_installed(tmp_path: Path) -> None:
    reader = ShmReader(tmp_path / "shm-c", RUN, 0)
    with pytest.raises(ValueError, match="rank 1"):
        install(reader, _replica(rank=1)[0])
    assert reader.latest() is None


def test_an_installed_replica_records_the_checksums_it_was_verified_with_not_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica read back at the persister's chunk size brings the SHA-256s it was verified
    against and the fast checksums of the bytes so verified: no third pass over it."""
    replica, _ = _replica()
    views = {
        n: replica.data[t.offset : t.offset + t.nbytes] for n, t in replica.desc.tensors.items()
    }
    views.update(
        {n: replica.data[t.offset : t.offset + t.nbytes] for n, t in replica.desc.files.items()}
    )
    replica.chunk_bytes = checksums.HASH_CHUNK_BYTES
    replica.hashes = {n: checksums.chunk_hashes(v) for n, v in views.items()}
    replica.fast = {n: checksums.fast_checksums(v) for n, v in views.items()}

    def no_pass(*_: object) -> list[str]:
        raise AssertionError("hashed again")

    monkeypatch.setattr(rehydrate, "chunk_hashes", no_pass)
    monkeypatch.setattr(rehydrate, "fast_checksums", no_pass)
    reader = ShmReader(tmp_path / "shm-c", RUN, 0)
    desc = install(reader, replica)
    hashes = reader.hashes(desc.slot, desc.seq)
    assert hashes is not None and (hashes.sha256, hashes.fast) == (replica.hashes, replica.fast)
    monkeypatch.undo()
    with reader.open(desc) as snap:
        assert snap is not None and verify_snapshot(snap, hashes) == []
