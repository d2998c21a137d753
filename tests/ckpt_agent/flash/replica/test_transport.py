"""Push, store and fetch over real sockets on 127.0.0.1 (flash.replica.client, .server,
.fetch): round trips, content addressing, job scoping, cuts, corruption, dead peers."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import pytest
from replica_helpers import CHUNK, RUN, SECRET, make_snap, pattern

from ckpt_agent.errors import ReplicaAuthError, ReplicaError, ReplicaIntegrityError
from ckpt_agent.flash.checksums import fast_checksum
from ckpt_agent.flash.replica.auth import JobScope, connect_as_client
from ckpt_agent.flash.replica.client import Peer, open_connection, push
from ckpt_agent.flash.replica.fetch import fetch, list_replicas, open_local
from ckpt_agent.flash.replica.layout import DATA, HASHES
from ckpt_agent.flash.replica.plan import Offer, hashes_doc
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore, StoredReplica
from ckpt_agent.flash.replica.wire import HANDSHAKE_LIMITS, PREFIX, Conn, Limits

pytestmark = pytest.mark.timeout(60)

Serve = Callable[..., tuple[ReplicaServer, Peer]]
Wait = Callable[..., None]


def test_a_multi_chunk_snapshot_round_trips(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    snap = make_snap({"w": pattern(5 * CHUNK + 300, 1), "b": pattern(2 * CHUNK, 2), "e": b""})
    server, peer = serve()
    result = push(
        peer, scope, snap.desc, snap.view, snap.hashes, source="node-a", chunk_bytes=CHUNK
    )
    assert result.chunks_sent == 6 + 2 + 1 and result.chunks_skipped == 0
    assert result.bytes_sent == 7 * CHUNK + 300 and not result.already
    assert server.stats.stored == 1
    with open_local(store, "node-a", 0) as local:
        assert local.desc == snap.desc
        for name in ("w", "b", "e"):
            assert bytes(local.tensor(name)) == snap.tensor(name)
        del local
    remote = fetch(peer, scope, "node-a", 0, run_id=RUN)
    assert remote.desc == snap.desc
    for name in ("w", "b", "e"):
        assert bytes(remote.tensor(name)) == snap.tensor(name)
    assert server.stats.fetched == 1
    held = list_replicas(peer, scope)
    assert [(r["source"], r["rank"], r["seq"], r["step"]) for r in held] == [("node-a", 0, 1, 10)]


def test_a_second_push_sends_only_the_changed_chunks(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    w1 = bytearray(pattern(5 * CHUNK + 300, 1))
    first = make_snap({"w": bytes(w1), "b": pattern(2 * CHUNK, 2)}, seq=1)
    _, peer = serve()
    push(peer, scope, first.desc, first.view, first.hashes, source="node-a", chunk_bytes=CHUNK)
    w1[2 * CHUNK + 5] ^= 0xFF  # one chunk of w changed, b unchanged
    second = make_snap({"w": bytes(w1), "b": pattern(2 * CHUNK, 2)}, seq=2, step=20)
    result = push(
        peer, scope, second.desc, second.view, second.hashes, source="node-a", chunk_bytes=CHUNK
    )
    assert result.chunks_sent == 1 and result.chunks_skipped == 7
    assert result.bytes_sent == CHUNK
    with open_local(store, "node-a", 0) as local:
        assert local.desc.seq == 2
        assert bytes(local.tensor("w")) == bytes(w1)
        assert bytes(local.tensor("b")) == pattern(2 * CHUNK, 2)
        del local
    assert len(store.folders("node-a", 0)) == 1  # the older replica is gone once published
    again = push(
        peer, scope, second.desc, second.view, second.hashes, source="node-a", chunk_bytes=CHUNK
    )
    assert again.already and again.chunks_sent == 0


@pytest.mark.parametrize(
    "client_scope",
    [
        JobScope("team-a", "job-1", b"another-secret-of-32-bytes-long!"),
        JobScope("team-a", "job-2", SECRET),
        JobScope("team-b", "job-1", SECRET),
    ],
    ids=["wrong-secret", "other-job", "other-namespace"],
)
def test_a_peer_of_another_job_is_refused_on_both_sides(
    serve: Serve, store: ReplicaStore, wait_for: Wait, client_scope: JobScope
) -> None:
    snap = make_snap({"w": pattern(3 * CHUNK, 1)})
    server, peer = serve()
    with pytest.raises(ReplicaAuthError) as err:
        push(
            peer,
            client_scope,
            snap.desc,
            snap.view,
            snap.hashes,
            source="node-a",
            chunk_bytes=CHUNK,
        )
    assert "refused" in str(err.value)
    wait_for(lambda: server.stats.refused == 1)
    reason = server.stats.errors[-1]
    assert "job" in reason and ("secret" in reason or client_scope.label in reason)
    assert store.replicas() == []
    with pytest.raises(ReplicaAuthError):
        fetch(peer, client_scope, "node-a", 0)


def test_a_server_of_another_job_is_refused_by_the_client(serve: Serve, scope: JobScope) -> None:
    other = JobScope("team-a", "job-1", b"another-secret-of-32-bytes-long!")
    _, peer = serve(scope=other)
    with pytest.raises(ReplicaAuthError, match="did not prove it holds the replica secret"):
        list_replicas(peer, scope)


def test_an_oversize_header_is_refused_before_anything_is_read(
    serve: Serve, wait_for: Wait
) -> None:
    server, peer = serve()
    with socket.create_connection((peer.host, peer.port), timeout=5) as sock:
        sock.sendall(struct.pack(">4sIQ", b"CKR1", 2**31, 0))  # a 2 GiB header, never sent
        conn = Conn(sock, timeout_s=5, limits=HANDSHAKE_LIMITS)
        answer = conn.recv()
    assert answer.kind == "error" and "exceeds" in str(answer.header["error"])
    wait_for(lambda: server.stats.refused == 1)
    assert "2147483648" in server.stats.errors[-1]


def test_a_connection_cut_mid_chunk_keeps_the_previous_replica(
    serve: Serve, scope: JobScope, store: ReplicaStore, wait_for: Wait
) -> None:
    first = make_snap({"w": pattern(4 * CHUNK, 1)}, seq=1)
    server, peer = serve()
    push(peer, scope, first.desc, first.view, first.hashes, source="node-a", chunk_bytes=CHUNK)
    second = make_snap({"w": pattern(4 * CHUNK, 2)}, seq=2, step=20)
    offer = Offer("node-a", second.desc, second.hashes, CHUNK)
    conn = open_connection(peer, scope)
    try:
        conn.send(offer.to_header())
        need = conn.expect("need").header["chunks"]
        assert need == [0, 1, 2, 3]
        conn.send({"t": "chunk", "i": 0}, second.view[second.desc.tensors["w"].offset :][:CHUNK])
        head = b'{"t":"chunk","i":1}'
        framed = PREFIX.pack(b"CKR1", len(head), CHUNK) + head
        tag = conn._tag(conn._out, conn._sent, framed)  # a genuine frame of this session
        conn.sock.sendall(framed + tag + b"x" * 100)
    finally:
        conn.close()  # cut in the middle of chunk 1
    wait_for(lambda: server.stats.failed == 1)
    assert "closed in the middle of a frame" in server.stats.errors[-1]
    folders = store.folders("node-a", 0)
    assert len(folders) == 1  # the partial replica was removed, never published
    with open_local(store, "node-a", 0) as local:
        assert local.desc.seq == 1 and bytes(local.tensor("w")) == first.tensor("w")
        del local


def test_a_chunk_corrupted_in_flight_is_refused(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    snap = make_snap({"w": pattern(6 * CHUNK, 1)})
    bad = {"w": list(snap.hashes["w"])}
    bad["w"][3] = bad["w"][2]  # the bytes sent for chunk 3 do not match what was offered
    server, peer = serve()
    with pytest.raises(ReplicaIntegrityError, match="does not match its SHA-256"):
        push(peer, scope, snap.desc, snap.view, bad, source="node-a", chunk_bytes=CHUNK)
    assert server.stats.failed == 1 and server.stats.stored == 0
    assert store.replicas() == [] and store.folders("node-a", 0) == []


def test_a_replica_corrupted_at_rest_is_unusable(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    snap = make_snap({"w": pattern(4 * CHUNK, 1)})
    server, peer = serve()
    push(peer, scope, snap.desc, snap.view, snap.hashes, source="node-a", chunk_bytes=CHUNK)
    replica = store.current("node-a", 0)
    assert replica is not None
    data = replica.path / DATA
    raw = bytearray(data.read_bytes())
    raw[snap.desc.tensors["w"].offset + 2 * CHUNK + 17] ^= 0x01  # one bit flipped in memory
    data.write_bytes(raw)
    with pytest.raises(ReplicaIntegrityError, match="corrupted at rest"):
        fetch(peer, scope, "node-a", 0)
    with pytest.raises(ReplicaIntegrityError, match="corrupted at rest"):
        with open_local(store, "node-a", 0):
            pass
    assert server.stats.fetched == 0 and "corrupted at rest" in server.stats.errors[-1]
    # the next push does not copy the corrupted chunk: it asks for it again
    again = make_snap({"w": pattern(4 * CHUNK, 1)}, seq=2)
    result = push(
        peer, scope, again.desc, again.view, again.hashes, source="node-a", chunk_bytes=CHUNK
    )
    assert result.chunks_sent == 1 and result.chunks_skipped == 3
    assert bytes(fetch(peer, scope, "node-a", 0).tensor("w")) == snap.tensor("w")


def _flip_at_rest(replica: StoredReplica, offset: int) -> None:
    """One bit of ``replica``'s data flipped in memory (tmpfs), at ``offset`` in the slot."""
    data = replica.path / DATA
    raw = bytearray(data.read_bytes())
    raw[offset] ^= 0x01
    data.write_bytes(raw)


def test_the_fast_checksum_of_every_chunk_is_recorded_on_arrival(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    first = make_snap({"w": pattern(4 * CHUNK, 1), "e": b""}, seq=1)
    _, peer = serve()
    push(peer, scope, first.desc, first.view, first.hashes, source="node-a", chunk_bytes=CHUNK)
    w = bytearray(first.tensor("w"))
    w[CHUNK + 3] ^= 0xFF  # the second push copies 3 chunks of w, receives 1
    second = make_snap({"w": bytes(w), "e": b""}, seq=2)
    push(peer, scope, second.desc, second.view, second.hashes, source="node-a", chunk_bytes=CHUNK)
    replica = store.current("node-a", 0)
    assert replica is not None and replica.desc.seq == 2
    t = second.desc.tensors["w"]
    assert replica.fast == {
        "w": [fast_checksum(w[i : i + CHUNK]) for i in range(0, t.nbytes, CHUNK)],
        "e": [fast_checksum(b"")],
    }


def test_a_replica_corrupted_at_rest_past_the_senders_check_is_refused_by_the_receiver(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    """The receiver's SHA-256 (against the authenticated header) is the check that guards
    it: a peer that sends corrupted bytes, its own check fooled (here: its recorded fast
    checksums rewritten to match them) or skipped, gets them refused."""
    snap = make_snap({"w": pattern(4 * CHUNK, 1)})
    server, peer = serve()
    push(peer, scope, snap.desc, snap.view, snap.hashes, source="node-a", chunk_bytes=CHUNK)
    replica = store.current("node-a", 0)
    assert replica is not None and replica.fast is not None
    _flip_at_rest(replica, snap.desc.tensors["w"].offset + 2 * CHUNK + 17)
    raw = (replica.path / DATA).read_bytes()
    t = snap.desc.tensors["w"]
    fooled = {
        "w": [
            fast_checksum(raw[t.offset + i : t.offset + i + CHUNK])
            for i in range(0, t.nbytes, CHUNK)
        ]
    }
    (replica.path / HASHES).write_bytes(hashes_doc(replica.offer(), fooled))
    into = bytearray(snap.desc.data_size)
    with pytest.raises(ReplicaIntegrityError, match="chunk 2 of 'w' does not match its SHA-256"):
        fetch(peer, scope, "node-a", 0, into=lambda _: memoryview(into))
    assert server.stats.fetched == 1  # the sender saw nothing wrong


def test_a_replica_stored_without_fast_checksums_is_checked_at_rest_by_its_sha256(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    """A replica stored by an older version (its hash list has no fast checksums)."""
    snap = make_snap({"w": pattern(4 * CHUNK, 1)})
    server, peer = serve()
    push(peer, scope, snap.desc, snap.view, snap.hashes, source="node-a", chunk_bytes=CHUNK)
    replica = store.current("node-a", 0)
    assert replica is not None
    (replica.path / HASHES).write_bytes(hashes_doc(replica.offer()))
    older = store.current("node-a", 0)
    assert older is not None and older.fast is None
    assert bytes(fetch(peer, scope, "node-a", 0).tensor("w")) == snap.tensor("w")
    _flip_at_rest(older, snap.desc.tensors["w"].offset + CHUNK)
    with pytest.raises(ReplicaIntegrityError, match="corrupted at rest"):
        fetch(peer, scope, "node-a", 0)
    with pytest.raises(ReplicaIntegrityError, match="corrupted at rest"):
        with open_local(store, "node-a", 0):
            pass
    assert server.stats.fetched == 1


def test_never_more_than_two_snapshot_folders_per_peer_rank(
    serve: Serve, scope: JobScope, store: ReplicaStore, wait_for: Wait
) -> None:
    server, peer = serve()
    counts = []
    for seq in range(1, 6):
        snap = make_snap({"w": pattern(3 * CHUNK, seq)}, seq=seq)
        if seq == 3:  # an abandoned push leaves an incomplete folder behind
            conn = open_connection(peer, scope)
            conn.send(Offer("node-a", snap.desc, snap.hashes, CHUNK).to_header())
            conn.expect("need")
            counts.append(len(store.folders("node-a", 0)))  # complete + incoming
            conn.close()
            wait_for(lambda: server.stats.failed == 1)
        push(peer, scope, snap.desc, snap.view, snap.hashes, source="node-a", chunk_bytes=CHUNK)
        counts.append(len(store.folders("node-a", 0)))
    assert counts == [1, 1, 2, 1, 1, 1]
    assert max(counts) <= 2


def test_a_dead_peer_makes_push_fail_within_its_timeout(scope: JobScope) -> None:
    snap = make_snap({"w": pattern(2 * CHUNK, 1)})

    def push_to(port: int) -> None:
        push(
            Peer("127.0.0.1", port),
            scope,
            snap.desc,
            snap.view,
            snap.hashes,
            source="node-a",
            chunk_bytes=CHUNK,
            timeout_s=0.3,
        )

    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with pytest.raises(ReplicaError, match=r"no progress receiving within 0\.3 s"):
            push_to(listener.getsockname()[1])
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(ReplicaError, match="cannot reach replica peer"):
        push_to(port)


def test_fetch_of_a_missing_replica_says_so(serve: Serve, scope: JobScope) -> None:
    _, peer = serve()
    with pytest.raises(ReplicaError, match="no replica of node-z rank 0"):
        fetch(peer, scope, "node-z", 0)


def test_an_offer_of_another_run_is_refused(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    snap = make_snap({"w": pattern(CHUNK, 1)}, run_id="run-other")
    _, peer = serve()
    with pytest.raises(ReplicaError, match="this store holds run 'run-1'"):
        push(peer, scope, snap.desc, snap.view, snap.hashes, source="node-a", chunk_bytes=CHUNK)
    assert store.replicas() == []


def test_the_handshake_alone_authenticates(serve: Serve, scope: JobScope) -> None:
    """A bare connection that proves the job's secret is served: both ends are bound to the
    session afterwards and the server answers a request on it, refusing nothing."""
    server, peer = serve()
    with socket.create_connection((peer.host, peer.port), timeout=5) as sock:
        conn = Conn(sock, timeout_s=5)
        connect_as_client(conn, scope)
        assert conn.bound
        conn.limits = Limits()  # past the handshake: the session's limits
        conn.send({"t": "list"})
        assert conn.expect("replicas").header["replicas"] == []
    assert server.stats.refused == 0 and server.stats.failed == 0


def test_a_view_kept_past_open_local_does_not_break_it(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    snap = make_snap({"w": pattern(2 * CHUNK, 1)})
    _, peer = serve()
    push(peer, scope, snap.desc, snap.view, snap.hashes, source="node-a", chunk_bytes=CHUNK)
    with open_local(store, "node-a", 0) as local:
        kept = local.tensor("w")
    assert bytes(kept) == snap.tensor("w")  # still mapped until freed
    del kept
