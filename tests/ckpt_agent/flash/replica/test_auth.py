"""The replica handshake (flash.replica.auth): both sides prove the job's secret for this
namespace and job id; anything else is refused, and both sides say why."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
from replica_helpers import SECRET

from ckpt_agent.errors import ReplicaAuthError, ReplicaError
from ckpt_agent.flash.replica.auth import JobScope, accept, connect_as_client
from ckpt_agent.flash.replica.wire import PREFIX, Conn, Limits

pytestmark = pytest.mark.timeout(30)

OTHER_SECRET = b"another-secret-of-32-bytes-long!"


def _handshake(client: JobScope, server: JobScope) -> tuple[BaseException | None, ...]:
    """Run both sides over a socket pair; (client's error, server's error)."""
    a, b = socket.socketpair()
    errors: dict[str, BaseException | None] = {"client": None, "server": None}

    def serve() -> None:
        try:
            accept(Conn(b, timeout_s=5, peer="client"), server)
        except BaseException as e:
            errors["server"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        connect_as_client(Conn(a, timeout_s=5, peer="server"), client)
    except BaseException as e:
        errors["client"] = e
    t.join()
    a.close()
    b.close()
    return errors["client"], errors["server"]


def test_the_same_job_authenticates_both_ways() -> None:
    scope = JobScope("team-a", "job-1", SECRET)
    assert _handshake(scope, JobScope("team-a", "job-1", SECRET)) == (None, None)


def test_a_wrong_secret_is_refused_on_both_sides() -> None:
    client, server = _handshake(
        JobScope("team-a", "job-1", OTHER_SECRET), JobScope("team-a", "job-1", SECRET)
    )
    assert isinstance(client, ReplicaAuthError) and isinstance(server, ReplicaAuthError)
    assert "did not prove it holds the replica secret of team-a/job-1" in str(client)
    assert "did not prove it holds the replica secret" in str(server)  # the client told it


@pytest.mark.parametrize(
    "client_scope",
    [JobScope("team-a", "job-2", SECRET), JobScope("team-b", "job-1", SECRET)],
    ids=["other-job", "other-namespace"],
)
def test_the_same_secret_under_another_job_is_refused_on_both_sides(
    client_scope: JobScope,
) -> None:
    client, server = _handshake(client_scope, JobScope("team-a", "job-1", SECRET))
    assert isinstance(client, ReplicaAuthError) and isinstance(server, ReplicaAuthError)
    for err in (client, server):
        assert f"is of job {client_scope.label}" in str(err)
        assert "replicates team-a/job-1" in str(err)


def test_proofs_are_bound_to_role_scope_and_nonce() -> None:
    scope = JobScope("team-a", "job-1", SECRET)
    nonce = bytes(32)
    server = scope.proof(nonce, "server")
    assert scope.check(nonce, "server", server)
    assert not scope.check(nonce, "client", server)  # never replayable as the other role
    assert not scope.check(bytes([1] * 32), "server", server)
    assert not JobScope("team-a", "job-2", SECRET).check(nonce, "server", server)
    assert not JobScope("team-a", "job-1", OTHER_SECRET).check(nonce, "server", server)
    assert not scope.check(nonce, "server", None)
    assert not scope.check(nonce, "server", "é" * 64)


def test_a_malformed_hello_is_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        Conn(a, timeout_s=5).send({"t": "hello", "v": 1, "namespace": "team-a", "job": "job-1"})
        with pytest.raises(ReplicaAuthError, match="malformed nonce"):
            accept(Conn(b, timeout_s=5), JobScope("team-a", "job-1", SECRET))


def test_another_protocol_version_is_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        Conn(a, timeout_s=5).send({"t": "hello", "v": 99})
        with pytest.raises(ReplicaError, match="protocol version 99"):
            accept(Conn(b, timeout_s=5), JobScope("team-a", "job-1", SECRET))


@pytest.mark.parametrize(
    ("namespace", "job", "secret", "words"),
    [
        ("Team_A", "job-1", SECRET, "invalid namespace"),
        ("team-a", "../job", SECRET, "invalid run id"),
        ("team-a", "job-1", b"short", "at least 16"),
    ],
)
def test_a_bad_scope_is_refused_when_built(
    namespace: str, job: str, secret: bytes, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        JobScope(namespace, job, secret)


def test_the_secret_is_read_from_a_file_and_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    scope = JobScope.from_file("team-a", "job-1", path)
    assert scope.secret == SECRET
    assert SECRET.decode() not in repr(scope)
    with pytest.raises(ValueError, match="cannot read the replica secret"):
        JobScope.from_file("team-a", "job-1", tmp_path / "missing")


def _bound_pair(role_a: str = "client", role_b: str = "server") -> tuple[Conn, Conn]:
    """Two ends of one connection, both bound to the same session key."""
    a, b = socket.socketpair()
    scope = JobScope("team-a", "job-1", SECRET)
    key = scope.session_key(b"c" * 32, b"s" * 32)
    ca = Conn(a, timeout_s=5, peer="b", limits=Limits())
    cb = Conn(b, timeout_s=5, peer="a", limits=Limits())
    ca.bind(key, role_a)
    cb.bind(key, role_b)
    return ca, cb


def test_a_bound_session_carries_frames_both_ways() -> None:
    client, server = _bound_pair()
    try:
        client.send({"t": "x", "n": 1}, b"payload")
        got = server.recv()
        assert got.header == {"t": "x", "n": 1} and bytes(got.payload) == b"payload"
        server.send({"t": "y"})
        assert client.recv().header == {"t": "y"}
    finally:
        client.close()
        server.close()


def _raw_frame(conn: Conn, header: bytes) -> bytes:
    """The bytes ``conn`` would put on the wire for a header-only frame (tag included)."""
    framed = PREFIX.pack(b"CKR1", len(header), 0) + header
    return framed + conn._tag(conn._out, conn._sent, framed)


@pytest.mark.parametrize("attack", ["untagged", "altered", "replayed", "reflected"])
def test_frames_injected_altered_replayed_or_reflected_on_the_path_are_refused(
    attack: str,
) -> None:
    """After the handshake every frame is tagged under the session key, its direction and
    its sequence number: someone on the network path who cannot compute the tag cannot
    slip a frame in, change one, play one again or send one back to its sender."""
    client, server = _bound_pair()
    try:
        head = b'{"t":"offer","chunks":[1]}'
        genuine = _raw_frame(client, head)
        if attack == "untagged":
            guess = b"\0" * 32  # whatever follows the header is read as its tag
            client.sock.sendall(PREFIX.pack(b"CKR1", len(head), 0) + head + guess)
        elif attack == "altered":
            forged = bytearray(genuine)
            forged[PREFIX.size + head.index(b"1")] = ord("2")  # chunk 2 instead of 1
            client.sock.sendall(bytes(forged))
        elif attack == "replayed":
            client.sock.sendall(genuine + genuine)  # the first is frame 0; its copy is not 1
            assert server.recv().header == {"t": "offer", "chunks": [1]}
        else:  # the server's own frame 0 sent back to it as if from the client
            reflected = _raw_frame(server, head)
            client.sock.sendall(reflected)
        with pytest.raises(ReplicaAuthError, match="failed the session's authentication"):
            server.recv()
    finally:
        client.close()
        server.close()


def test_a_handshake_binds_both_sides_to_the_same_session() -> None:
    a, b = socket.socketpair()
    scope = JobScope("team-a", "job-1", SECRET)
    server_conn = Conn(b, timeout_s=5, peer="client")
    t = threading.Thread(target=accept, args=(server_conn, scope))
    t.start()
    client_conn = Conn(a, timeout_s=5, peer="server")
    connect_as_client(client_conn, scope)
    t.join()
    try:
        assert client_conn.bound and server_conn.bound
        client_conn.send({"t": "hello-again"})
        assert server_conn.recv().header == {"t": "hello-again"}
    finally:
        a.close()
        b.close()
