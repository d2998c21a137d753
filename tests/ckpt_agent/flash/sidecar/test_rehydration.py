"""The sidecar answers a restarted trainer's request for its rank's snapshot with a peer's
replica (flash.sidecar.rehydration): installed into the empty area, never persisted again
from this node; nothing found is an answer with the reason, never an error."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from replica_helpers import CHUNK, RUN, SECRET, make_snap, pattern

from ckpt_agent.flash.area import ShmArea
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.client import Peer, push
from ckpt_agent.flash.replica.rehydrate import read_answer, write_request
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore, StoredReplica
from ckpt_agent.flash.sidecar import Sidecar

pytestmark = pytest.mark.timeout(120)

SCOPE = JobScope("team-a", "job-1", SECRET)
PAYLOAD = pattern(5000, 3)


@pytest.fixture
def peer_b(tmp_path: Path) -> Iterator[tuple[ReplicaStore, Peer]]:
    """Node b's replica store and server; it holds node a's rank-0 snapshot of step 42.
    Node c's sidecar is ``sidecar_on("c", ...)`` (conftest), its shared memory empty."""
    store = ReplicaStore(tmp_path / "shm-b", RUN)
    server = ReplicaServer(store, SCOPE, host="127.0.0.1", timeout_s=5.0).start()
    peer = Peer(*server.address)
    snap = make_snap({"w": PAYLOAD}, step=42, seq=9, world_size=1, meta={"token": "t42"})
    push(peer, SCOPE, snap.desc, snap.view, snap.hashes, source="node-a", chunk_bytes=CHUNK)
    yield store, peer
    server.close()


def _events(tmp_path: Path, name: str) -> list[dict[str, object]]:
    lines = (tmp_path / "work-c" / "sidecar.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_a_request_gets_the_peers_replica_installed_and_not_persisted_again(
    tmp_path: Path, peer_b: tuple[ReplicaStore, Peer], sidecar_on: Callable[..., Sidecar]
) -> None:
    _, peer = peer_b
    sidecar = sidecar_on("c", str(peer))
    area = ShmArea(tmp_path / "shm-c", RUN, 0)
    write_request(area, "n1")
    assert sidecar.run_once() == 0  # answered, and nothing to persist
    answer = read_answer(area, "n1")
    assert answer is not None and answer.found, answer
    assert (answer.step, answer.source) == (42, "node-a")
    assert f"peer {peer}" in answer.why
    desc = area.latest()
    assert desc is not None and (desc.step, desc.seq, desc.meta["token"]) == (42, answer.seq, "t42")
    assert area.hashes(desc.slot, desc.seq) is not None
    data = area.data_path(desc.slot).read_bytes()
    t = desc.tensors["w"]
    assert data[t.offset : t.offset + t.nbytes] == PAYLOAD
    assert sidecar.run_once() == 0 and sidecar.persisted == 0  # once; never persisted here
    assert [e["step"] for e in _events(tmp_path, "rehydrated")] == [42]
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("COMMIT"))


def test_this_nodes_own_store_is_read_without_the_network(
    tmp_path: Path, sidecar_on: Callable[..., Sidecar]
) -> None:
    """The rank came back on a node that holds its replica (pushed there before)."""
    own = ReplicaStore(tmp_path / "shm-c", RUN)
    server = ReplicaServer(own, SCOPE, host="127.0.0.1", timeout_s=5.0).start()
    try:
        snap = make_snap({"w": PAYLOAD}, step=17, seq=2, world_size=1, meta={"token": "t17"})
        push(Peer(*server.address), SCOPE, snap.desc, snap.view, snap.hashes, source="node-a",
             chunk_bytes=CHUNK)  # fmt: skip
    finally:
        server.close()
    sidecar = sidecar_on("c")  # no peers at all
    area = ShmArea(tmp_path / "shm-c", RUN, 0)
    write_request(area, "n2")
    sidecar.run_once()
    answer = read_answer(area, "n2")
    assert answer is not None and answer.found and answer.step == 17
    assert "this node's store" in answer.why


def test_a_corrupted_replica_is_not_installed_and_the_answer_says_why(
    tmp_path: Path, peer_b: tuple[ReplicaStore, Peer], sidecar_on: Callable[..., Sidecar]
) -> None:
    store, peer = peer_b
    (held,) = store.replicas()
    raw = bytearray(held.data_path.read_bytes())
    raw[held.desc.tensors["w"].offset + 100] ^= 0xFF  # a bit flipped at rest on node b
    held.data_path.write_bytes(raw)
    sidecar = sidecar_on("c", str(peer))
    area = ShmArea(tmp_path / "shm-c", RUN, 0)
    write_request(area, "n3")
    sidecar.run_once()
    answer = read_answer(area, "n3")
    assert answer is not None and not answer.found
    assert "corrupted" in answer.why and "step 42" in answer.why
    assert area.latest() is None
    assert [e["why"] for e in _events(tmp_path, "rehydrate_none")] == [answer.why]


def test_a_replica_corrupted_at_rest_is_never_installed_even_if_the_sender_does_not_check(
    tmp_path: Path,
    peer_b: tuple[ReplicaStore, Peer],
    sidecar_on: Callable[..., Sidecar],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Node b's own check at rest switched off (a peer of another version, or a malicious
    one): node c's check of every chunk against its SHA-256 refuses the replica."""
    store, peer = peer_b
    (held,) = store.replicas()
    raw = bytearray(held.data_path.read_bytes())
    raw[held.desc.tensors["w"].offset + 100] ^= 0x01
    held.data_path.write_bytes(raw)
    monkeypatch.setattr(StoredReplica, "intact", lambda *_: True)
    sidecar = sidecar_on("c", str(peer))
    area = ShmArea(tmp_path / "shm-c", RUN, 0)
    write_request(area, "n6")
    sidecar.run_once()
    answer = read_answer(area, "n6")
    assert answer is not None and not answer.found
    assert "corrupted in flight or on the peer" in answer.why, answer.why
    assert "does not match its SHA-256" in answer.why
    assert area.latest() is None


def test_nothing_held_an_unreachable_peer_or_replication_off_is_an_answer_not_an_error(
    tmp_path: Path, sidecar_on: Callable[..., Sidecar]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = Peer("127.0.0.1", s.getsockname()[1])
    area = ShmArea(tmp_path / "shm-c", RUN, 0)
    write_request(area, "n4")
    sidecar_on("c", str(dead)).run_once()
    answer = read_answer(area, "n4")
    assert answer is not None and not answer.found and f"peer {dead}" in answer.why

    other = ShmArea(tmp_path / "shm-c", RUN, 1)
    write_request(other, "n5")
    sidecar_on("c", replicating=False).run_once()
    off = read_answer(other, "n5")
    assert off is not None and not off.found and off.why == "peer replication is off on this node"


def test_a_peer_whose_sidecar_is_starting_is_asked_again(
    tmp_path: Path, sidecar_on: Callable[..., Sidecar]
) -> None:
    """Node b refuses connections for the first 0.6 s (its sidecar is starting, as when
    every pod of the job starts at once): node c asks again and gets the replica."""
    store = ReplicaStore(tmp_path / "shm-b", RUN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    snap = make_snap({"w": PAYLOAD}, step=42, seq=9, world_size=1, meta={"token": "t42"})
    started: list[ReplicaServer] = []

    def start_b() -> None:
        time.sleep(0.6)
        server = ReplicaServer(store, SCOPE, host="127.0.0.1", port=port, timeout_s=5.0)
        started.append(server.start())

    area = ShmArea(tmp_path / "shm-c", RUN, 0)
    write_request(area, "n6")
    sidecar = sidecar_on("c", f"127.0.0.1:{port}")
    later = threading.Thread(target=start_b)
    later.start()
    try:
        # node a pushed to b before it was lost: the replica is on b's store already
        push_now = ReplicaServer(store, SCOPE, host="127.0.0.1", timeout_s=5.0).start()
        push(Peer(*push_now.address), SCOPE, snap.desc, snap.view, snap.hashes,
             source="node-a", chunk_bytes=CHUNK)  # fmt: skip
        push_now.close()
        t0 = time.monotonic()
        sidecar.run_once()
        answer = read_answer(area, "n6")
        assert answer is not None and answer.found, answer
        assert answer.step == 42 and 0.5 < time.monotonic() - t0 < 3.5
    finally:
        later.join()
        for server in started:
            server.close()


@pytest.mark.parametrize("holder", ["map", "ring"])
def test_a_recreated_rank_asks_the_peer_map_and_the_ring(
    tmp_path: Path,
    peer_b: tuple[ReplicaStore, Peer],
    sidecar_on: Callable[..., Sidecar],
    holder: str,
) -> None:
    """Rank 0's node lost, the rank recreated on node c. Its peer map (the operator's
    ConfigMap, which keeps a rank's peers when it moves) names the peer that holds its
    replica, b, while the webhook's ring names d, which holds nothing: b's replica is found.
    And the other way round (the replica pushed to the ring before the map existed): found
    too, every peer named is asked."""
    _, peer = peer_b
    empty = ReplicaServer(ReplicaStore(tmp_path / "shm-d", RUN), SCOPE, host="127.0.0.1").start()
    try:
        peer_d = Peer(*empty.address)
        ring, mapped = (peer_d, peer) if holder == "map" else (peer, peer_d)
        peers_file = tmp_path / "peer-map" / "rank-0"
        peers_file.parent.mkdir()
        peers_file.write_text(str(mapped))
        sidecar = sidecar_on("c", str(ring), peers_file=str(peers_file))
        assert sidecar.replicator is not None
        assert sidecar.replicator.peers == [mapped]  # pushes go to the map's peer
        area = ShmArea(tmp_path / "shm-c", RUN, 0)
        write_request(area, "n7")
        sidecar.run_once()
        answer = read_answer(area, "n7")
        assert answer is not None and answer.found, answer
        assert (answer.step, answer.source) == (42, "node-a") and f"peer {peer}" in answer.why
    finally:
        empty.close()
