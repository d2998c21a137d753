"""Replica framing (flash.replica.wire): frames, bounds checked before allocating, cuts,
timeouts, the peer's errors."""

from __future__ import annotations

import socket
import struct
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from ckpt_agent.errors import ReplicaAuthError, ReplicaError, ReplicaIntegrityError
from ckpt_agent.flash.replica.wire import (
    HANDSHAKE_LIMITS,
    PREFIX,
    Conn,
    FrameTooLargeError,
    Limits,
    PeerClosedError,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair() -> Iterator[tuple[Conn, Conn]]:
    a, b = socket.socketpair()
    limits = Limits(max_header=1024, max_payload=4096)
    left = Conn(a, timeout_s=5, limits=limits, peer="left")
    right = Conn(b, timeout_s=5, limits=limits, peer="right")
    yield left, right
    left.close()
    right.close()


def test_a_frame_round_trips_with_and_without_payload(pair: tuple[Conn, Conn]) -> None:
    left, right = pair
    left.send({"t": "hello", "n": 1})
    left.send({"t": "chunk", "i": 3}, memoryview(b"abc" * 100))
    left.send({"t": "chunk", "i": 4}, b"xyz")
    first = right.recv()
    assert first.kind == "hello" and first.header["n"] == 1 and first.payload == b""
    assert bytes(right.recv().payload) == b"abc" * 100
    buf = bytearray(4096)
    into = right.recv(into=buf)
    assert bytes(into.payload) == b"xyz" and bytes(buf[:3]) == b"xyz"  # landed in the buffer
    assert (
        left.sent_bytes
        == 3 * PREFIX.size
        + sum(
            len(h) for h in (b'{"t":"hello","n":1}', b'{"t":"chunk","i":3}', b'{"t":"chunk","i":4}')
        )
        + 303
    )


def test_a_declared_oversize_header_is_refused_without_allocating_it() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">4sIQ", b"CKR1", 1 << 30, 0))  # 1 GiB declared, never sent
        conn = Conn(b, timeout_s=5, limits=HANDSHAKE_LIMITS)
        tracemalloc.start()
        try:
            with pytest.raises(FrameTooLargeError, match="1073741824 bytes exceeds the 4096"):
                conn.recv()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20


def test_a_declared_oversize_payload_is_refused(pair: tuple[Conn, Conn]) -> None:
    left, right = pair
    left.sock.sendall(struct.pack(">4sIQ", b"CKR1", 2, 1 << 40) + b"{}")
    with pytest.raises(FrameTooLargeError, match="payload of 1099511627776 bytes"):
        right.recv()


def test_handshake_limits_allow_no_payload(pair: tuple[Conn, Conn]) -> None:
    left, right = pair
    right.limits = HANDSHAKE_LIMITS
    left.send({"t": "hello"}, b"x")
    with pytest.raises(FrameTooLargeError):
        right.recv()


def test_another_protocol_is_named(pair: tuple[Conn, Conn]) -> None:
    left, right = pair
    left.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(ReplicaError, match="not the replica protocol"):
        right.recv()


@pytest.mark.parametrize("head", [b"not json", b"[1, 2]"])
def test_a_header_that_is_not_a_json_object_is_refused(
    pair: tuple[Conn, Conn], head: bytes
) -> None:
    left, right = pair
    left.sock.sendall(PREFIX.pack(b"CKR1", len(head), 0) + head)
    with pytest.raises(ReplicaError, match="header is not"):
        right.recv()


def test_a_cut_in_the_middle_of_a_frame_is_reported(pair: tuple[Conn, Conn]) -> None:
    left, right = pair
    left.sock.sendall(PREFIX.pack(b"CKR1", 2, 100) + b"{}" + b"x" * 10)
    left.sock.close()
    with pytest.raises(PeerClosedError, match="closed in the middle of a frame"):
        right.recv()


def test_a_silent_peer_times_out(pair: tuple[Conn, Conn]) -> None:
    _, right = pair
    right.timeout_s = 0.1
    with pytest.raises(ReplicaError, match="no progress receiving"):
        right.recv()


def test_a_passed_deadline_fails_every_operation(pair: tuple[Conn, Conn]) -> None:
    left, _ = pair
    left.deadline = time.monotonic() - 1
    with pytest.raises(ReplicaError, match="deadline passed"):
        left.send({"t": "x"})


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ReplicaAuthError("not this job"), ReplicaAuthError),
        (ReplicaIntegrityError("bad bytes"), ReplicaIntegrityError),
        ("plain words", ReplicaError),
    ],
)
def test_the_peers_error_keeps_its_kind(
    pair: tuple[Conn, Conn], error: BaseException | str, kind: type[ReplicaError]
) -> None:
    left, right = pair
    left.send_error(error)
    with pytest.raises(kind, match="replica peer right refused") as got:
        right.expect("need")
    assert type(got.value) is kind
    assert str(error) in str(got.value)


def test_an_unexpected_message_is_named(pair: tuple[Conn, Conn]) -> None:
    left, right = pair
    left.send({"t": "stored"})
    with pytest.raises(ReplicaError, match="expected need/chunk, got 'stored'"):
        right.expect("need", "chunk")


def test_a_payload_larger_than_the_receive_buffer_is_refused(pair: tuple[Conn, Conn]) -> None:
    left, right = pair
    left.send({"t": "chunk", "i": 0}, b"x" * 200)
    with pytest.raises(FrameTooLargeError, match="200 bytes exceeds the 100-byte chunk size"):
        right.recv(into=bytearray(100))
