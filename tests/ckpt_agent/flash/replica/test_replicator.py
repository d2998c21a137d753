"""The sidecar's replication (flash.replica.replicator): snapshots of a real shared-memory
area pushed in the background to a peer's server, failures counted, never raised."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from replica_helpers import CHUNK, RUN, SECRET, make_snap, pattern, write_slot

from ckpt_agent.errors import ReplicaError
from ckpt_agent.flash.checksums import HASH_CHUNK_BYTES
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.replica.fetch import open_local
from ckpt_agent.flash.replica.replicator import ReplicaOptions, Replicator

pytestmark = pytest.mark.timeout(60)

Wait = Callable[..., None]


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "replica-secret"
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def make(tmp_path: Path, secret_file: Path) -> Iterator[Callable[..., Replicator]]:
    made: list[Replicator] = []

    def build(node: str, **kw: object) -> Replicator:
        options = ReplicaOptions(
            node=node,
            namespace="team-a",
            job_id="job-1",
            secret_file=str(secret_file),
            listen_host="127.0.0.1",
            timeout_s=5.0,
            **{"chunk_bytes": CHUNK, **kw},  # type: ignore[arg-type]
        )
        r = Replicator(options, tmp_path / f"shm-{node}", RUN)
        made.append(r)
        return r

    yield build
    for r in made:
        r.close()


def test_a_snapshot_is_pushed_to_the_peer_in_the_background(
    make: Callable[..., Replicator], tmp_path: Path, wait_for: Wait
) -> None:
    b = make("node-b", listen_port=0)
    assert b.server is not None
    host, port = b.server.address
    a = make("node-a", peers=(f"{host}:{port}",))
    snap = make_snap({"w": pattern(3 * CHUNK + 5, 1)}, seq=4, step=40)
    write_slot(tmp_path / "shm-node-a", snap)
    reader = ShmReader(tmp_path / "shm-node-a", RUN, 0)
    a.offer(reader, snap.desc)
    wait_for(lambda: a.pushed == 1 and a.idle())
    assert a.failed == 0 and a.last is not None and a.last.chunks_sent == 4
    with open_local(b.store, "node-a", 0) as replica:
        assert replica.desc == snap.desc and bytes(replica.tensor("w")) == snap.tensor("w")
        del replica
    summary = a.summary()
    assert summary["pushed"] == 1 and summary["peers"] == [f"{host}:{port}"]
    assert b.summary()["served"] == {"stored": 1, "refused": 0}


def test_a_failed_push_is_counted_and_the_next_one_still_goes(
    make: Callable[..., Replicator], tmp_path: Path, wait_for: Wait
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    a = make("node-a", peers=(f"127.0.0.1:{dead}",))
    reader = ShmReader(tmp_path / "shm-node-a", RUN, 0)
    for seq in (1, 2):
        snap = make_snap({"w": pattern(CHUNK, seq)}, seq=seq)
        write_slot(tmp_path / "shm-node-a", snap)
        a.offer(reader, snap.desc)  # returns at once, whatever the peer does
        wait_for(lambda seq=seq: a.failed == seq and a.idle())  # type: ignore[misc]
    assert a.pushed == 0 and "cannot reach replica peer" in a.last_error


def test_a_snapshot_overwritten_before_its_push_is_skipped(
    make: Callable[..., Replicator], tmp_path: Path, wait_for: Wait
) -> None:
    a = make("node-a", peers=("127.0.0.1:9",))
    snap = make_snap({"w": pattern(CHUNK, 1)}, seq=1)
    area = write_slot(tmp_path / "shm-node-a", snap)
    area.desc_path(snap.desc.slot).unlink()  # the trainer took the slot back
    a.offer(ShmReader(tmp_path / "shm-node-a", RUN, 0), snap.desc)
    wait_for(lambda: a.superseded == 1 and a.idle())
    assert a.pushed == 0 and a.failed == 0


def test_without_peers_nothing_is_pushed(make: Callable[..., Replicator], tmp_path: Path) -> None:
    a = make("node-a")
    snap = make_snap({"w": pattern(CHUNK, 1)})
    a.offer(ShmReader(tmp_path / "shm-node-a", RUN, 0), snap.desc)
    assert a.idle() and a.server is None and a.summary()["pushed"] == 0


def test_a_taken_replica_port_is_named(make: Callable[..., Replicator]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ReplicaError, match=f"cannot serve replicas on 127.0.0.1:{port}"):
            make("node-b", listen_port=port)


def test_the_persisters_recorded_hashes_are_used_when_they_fit(
    make: Callable[..., Replicator], tmp_path: Path, wait_for: Wait
) -> None:
    standard = HASH_CHUNK_BYTES  # the persister's chunking: its recorded hashes apply
    b = make("node-b", listen_port=0, chunk_bytes=standard)
    assert b.server is not None
    a = make("node-a", peers=(f"127.0.0.1:{b.server.address[1]}",), chunk_bytes=standard)
    reader = ShmReader(tmp_path / "shm-node-a", RUN, 0)
    snap = make_snap({"w": pattern(3000, 1)}, seq=1)
    write_slot(tmp_path / "shm-node-a", snap)
    wrong = {"w": [hashlib.sha256(b"other bytes").hexdigest()]}
    reader.write_hashes(snap.desc, wrong)  # well-formed, not these bytes: used, refused
    a.offer(reader, snap.desc)
    wait_for(lambda: a.failed == 1 and a.idle())
    assert "does not match its SHA-256" in a.last_error
    reader.write_hashes(snap.desc, {"w": [""]})  # unusable: computed instead
    a.offer(reader, snap.desc)
    wait_for(lambda: a.pushed == 1 and a.idle())
    with open_local(b.store, "node-a", 0) as replica:
        assert bytes(replica.tensor("w")) == snap.tensor("w")
        del replica


def test_a_new_peer_from_the_peer_map_gets_the_newest_snapshot_in_full(
    make: Callable[..., Replicator], tmp_path: Path, wait_for: Wait
) -> None:
    """The ring's peer b first; the operator's map then names c: c gets the snapshot pushed
    already (every chunk: it held none), b nothing more; the next snapshot goes to c only,
    and the step heartbeats follow."""
    b, c = make("node-b", listen_port=0), make("node-c", listen_port=0)
    assert b.server is not None and c.server is not None
    peer_b, peer_c = (f"{h}:{p}" for h, p in (b.server.address, c.server.address))
    peers_file = tmp_path / "peers" / "rank-0"
    a = make("node-a", peers=(peer_b,), peers_file=str(peers_file), peers_refresh_s=0.05)
    assert [str(p) for p in a.peers] == [peer_b] and a.summary()["peers_from"] == "ring"
    shm = tmp_path / "shm-node-a"
    first = make_snap({"w": pattern(3 * CHUNK + 5, 1)}, seq=1, step=10)
    write_slot(shm, first)
    reader = ShmReader(shm, RUN, 0)
    a.offer(reader, first.desc)
    wait_for(lambda: a.pushed == 1 and a.idle())

    peers_file.parent.mkdir()
    peers_file.write_text(peer_c)
    wait_for(lambda: a.pushed == 2 and a.idle())
    assert [str(p) for p in a.peers] == [peer_c] and a.summary()["peers_from"] == "map"
    assert a.last is not None and a.last.peer == peer_c and a.last.chunks_sent == 4
    assert a.marks.peers == a.peers
    assert [str(p) for p in a.named_peers()] == [peer_c, peer_b]
    with open_local(c.store, "node-a", 0) as replica:
        assert replica.desc == first.desc
        del replica

    second = make_snap({"w": pattern(3 * CHUNK + 5, 2)}, seq=2, step=20)
    write_slot(shm, second)
    a.offer(reader, second.desc)
    wait_for(lambda: a.pushed == 3 and a.idle())
    assert a.failed == 0
    with open_local(c.store, "node-a", 0) as replica:
        assert replica.desc == second.desc
        del replica
    with open_local(b.store, "node-a", 0) as replica:  # b: still the first, never the second
        assert replica.desc == first.desc
        del replica
