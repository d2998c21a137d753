"""The receiver's replicas (flash.replica.store, .incoming, .layout): never half-written,
at most two folders per (source, rank), content-addressed copies checked, names confined."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from replica_helpers import CHUNK, RUN, make_snap, pattern

from ckpt_agent.errors import ReplicaError, ReplicaIntegrityError
from ckpt_agent.flash.protocol import HEADER, MAGIC
from ckpt_agent.flash.replica.layout import DATA, DESC
from ckpt_agent.flash.replica.plan import Offer
from ckpt_agent.flash.replica.store import MAX_FOLDERS, ReplicaStore


def _offer(seq: int, w: bytes, *, source: str = "node-a", rank: int = 0) -> tuple[Offer, object]:
    snap = make_snap({"w": w}, seq=seq, step=seq * 10, rank=rank)
    return Offer(source, snap.desc, snap.hashes, CHUNK), snap


def _receive(store: ReplicaStore, offer: Offer, snap: object) -> int:
    """Receive what the store asks for (from ``snap``'s bytes), publish; chunks sent."""
    incoming = store.begin(offer)
    view = snap.view  # type: ignore[attr-defined]
    for i in incoming.need:
        c = incoming.chunks[i]
        incoming.put(i, view[c.offset : c.offset + c.length])
    incoming.publish()
    return len(incoming.need)


def test_a_replica_is_published_only_when_complete(store: ReplicaStore) -> None:
    offer, snap = _offer(1, pattern(3 * CHUNK, 1))
    incoming = store.begin(offer)
    assert incoming.need == [0, 1, 2]
    assert incoming.folder is not None and incoming.folder.parent == store.rank_dir("node-a", 0)
    c = incoming.chunks[0]
    incoming.put(0, snap.view[c.offset : c.offset + c.length])  # type: ignore[attr-defined]
    assert not (incoming.folder / DESC).exists() and store.current("node-a", 0) is None
    with pytest.raises(ReplicaError, match="2 chunks missing"):
        incoming.publish()
    with pytest.raises(ReplicaError, match="not asked for"):
        incoming.put(0, b"")
    for i in (1, 2):
        c = incoming.chunks[i]
        incoming.put(i, snap.view[c.offset : c.offset + c.length])  # type: ignore[attr-defined]
    path = incoming.publish()
    held = store.current("node-a", 0)
    assert held is not None and held.path == path and held.desc == offer.desc
    data = (path / DATA).read_bytes()
    assert len(data) == offer.desc.data_size
    assert HEADER.unpack_from(data, 0) == (MAGIC, 1, 1, offer.desc.data_size)  # reads like a slot
    assert [r.desc.seq for r in store.replicas()] == [1]


def test_a_chunk_that_does_not_match_its_digest_is_refused(store: ReplicaStore) -> None:
    offer, _ = _offer(1, pattern(2 * CHUNK, 1))
    incoming = store.begin(offer)
    with pytest.raises(ReplicaIntegrityError, match="chunk 1 of 'w'"):
        incoming.put(1, b"\0" * CHUNK)
    with pytest.raises(ReplicaIntegrityError):
        incoming.put(1, b"")  # a short chunk too
    incoming.abort()
    assert store.folders("node-a", 0) == []


def test_chunks_held_are_copied_and_only_the_others_asked_for(store: ReplicaStore) -> None:
    w = bytearray(pattern(4 * CHUNK, 1))
    assert _receive(store, *_offer(1, bytes(w))) == 4
    w[CHUNK + 1] ^= 0x10
    offer, snap = _offer(2, bytes(w))
    incoming = store.begin(offer)
    assert incoming.need == [1] and incoming.copied == 3
    c = incoming.chunks[1]
    incoming.put(1, snap.view[c.offset : c.offset + c.length])  # type: ignore[attr-defined]
    incoming.publish()
    held = store.current("node-a", 0)
    assert held is not None and held.desc.seq == 2
    data = (held.path / DATA).read_bytes()
    t = held.desc.tensors["w"]
    assert data[t.offset : t.offset + t.nbytes] == bytes(w)
    assert len(store.folders("node-a", 0)) == 1


def test_a_corrupted_held_chunk_is_asked_for_again_not_copied(store: ReplicaStore) -> None:
    w = pattern(3 * CHUNK, 1)
    _receive(store, *_offer(1, w))
    held = store.current("node-a", 0)
    assert held is not None
    t = held.desc.tensors["w"]
    with open(held.path / DATA, "r+b") as f:
        f.seek(t.offset + 2 * CHUNK + 3)
        f.write(b"\xff")
    incoming = store.begin(_offer(2, w)[0])
    assert incoming.need == [2] and incoming.copied == 2
    incoming.abort()


def test_the_same_snapshot_again_needs_nothing_and_keeps_the_folder(store: ReplicaStore) -> None:
    offer, snap = _offer(1, pattern(2 * CHUNK, 1))
    _receive(store, offer, snap)
    before = store.folders("node-a", 0)
    incoming = store.begin(offer)
    assert incoming.need == [] and incoming.already == before[0]
    assert incoming.publish() == before[0] and store.folders("node-a", 0) == before


def test_at_most_two_folders_per_peer_rank(tmp_path: Path) -> None:
    seen = []
    for seq in range(1, 6):
        store = ReplicaStore(tmp_path, RUN)  # a sidecar restarted after each push
        offer, snap = _offer(seq, pattern(2 * CHUNK, seq))
        if seq % 2:  # a push abandoned half-way: the process died, its folder stays behind
            store.begin(offer)
            seen.append(len(store.folders("node-a", 0)))
            store = ReplicaStore(tmp_path, RUN)
        incoming = store.begin(offer)
        seen.append(len(store.folders("node-a", 0)))
        for i in incoming.need:
            c = incoming.chunks[i]
            incoming.put(i, snap.view[c.offset : c.offset + c.length])  # type: ignore[attr-defined]
        incoming.publish()
        seen.append(len(store.folders("node-a", 0)))
    assert seen == [1, 1, 1, 2, 1, 2, 2, 1, 2, 1, 2, 2, 1]
    assert max(seen) <= MAX_FOLDERS == 2


def test_one_push_per_peer_rank_at_a_time(store: ReplicaStore) -> None:
    offer, _ = _offer(1, pattern(CHUNK, 1))
    first = store.begin(offer)
    with pytest.raises(ReplicaError, match="already being received"):
        store.begin(offer)
    other = store.begin(_offer(1, pattern(CHUNK, 1), rank=1)[0])  # another rank is fine
    other.abort()
    first.abort()
    store.begin(offer).abort()  # free again


def test_offers_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    small = ReplicaStore(tmp_path, RUN, max_snapshot_bytes=1000)
    with pytest.raises(ReplicaError, match="replica bound"):
        small.begin(_offer(1, pattern(CHUNK, 1))[0])
    other_run = ReplicaStore(tmp_path, "run-2")
    with pytest.raises(ReplicaError, match="holds run 'run-2'"):
        other_run.begin(_offer(1, pattern(CHUNK, 1))[0])


def test_names_never_leave_the_replica_root(store: ReplicaStore, tmp_path: Path) -> None:
    for source in ("..", "../x", "a/b", ""):
        with pytest.raises(ValueError):
            store.rank_dir(source, 0)
    with pytest.raises(ReplicaError, match="invalid replica rank"):
        store.rank_dir("node-a", -1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    rank_dir = store.rank_dir("node-a", 0)
    rank_dir.mkdir(parents=True)
    os.symlink(outside, rank_dir / "seq_000000000009.evil")  # a planted link is not followed
    _receive(store, *_offer(1, pattern(CHUNK, 1)))
    assert (outside / "keep").exists()


def test_replicas_lists_every_source_and_rank(store: ReplicaStore) -> None:
    _receive(store, *_offer(1, pattern(CHUNK, 1), source="node-a", rank=0))
    _receive(store, *_offer(2, pattern(CHUNK, 2), source="node-a", rank=1))
    _receive(store, *_offer(3, pattern(CHUNK, 3), source="node-c", rank=0))
    (store.root / "not a source!").mkdir()
    assert [(r.source, r.rank, r.desc.seq) for r in store.replicas()] == [
        ("node-a", 0, 1),
        ("node-a", 1, 2),
        ("node-c", 0, 3),
    ]
