"""The sender: push one complete snapshot to one peer, only the chunks it lacks.

:func:`push` offers a snapshot (its descriptor and per-chunk SHA-256, the ones the
persister recorded) to a peer's :class:`~.server.ReplicaServer`; the peer answers with the
chunks it does not hold (it copies the others from its previous replica), and only those
are sent, straight from the slot's mapping (no copy). Every socket operation has a timeout
and the whole push an optional deadline: a dead, slow or unreachable peer makes it raise
:class:`~ckpt_agent.errors.ReplicaError`, never hang. Torch-free.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpt_agent.errors import PeerUnreachableError, ReplicaError
from ckpt_agent.flash.checksums import HASH_CHUNK_BYTES, RecordedHashes, chunk_hashes
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.flash.replica.auth import JobScope, connect_as_client
from ckpt_agent.flash.replica.plan import Offer
from ckpt_agent.flash.replica.wire import (
    HANDSHAKE_LIMITS,
    Conn,
    Limits,
    PeerClosedError,
    remote_error,
)

__all__ = ["DEFAULT_TIMEOUT_S", "Peer", "PushResult", "open_connection", "push"]

#: Seconds without progress after which a peer is given up (per socket operation).
DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Peer:
    """A peer sidecar's replica address."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Peer:
        """``host:port`` (``[v6]:port`` for IPv6)."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"replica peer {text!r}: expected host:port")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class PushResult:
    """What one push sent."""

    peer: str
    seq: int
    step: int
    chunks_sent: int
    chunks_skipped: int
    """Chunks the peer already held (copied from its previous replica)."""
    bytes_sent: int
    """Chunk bytes sent (the framing and the offer not counted)."""
    wire_bytes: int
    """Every byte this side sent (offer, framing, handshake included)."""
    seconds: float
    already: bool
    """The peer already held this very snapshot."""


def open_connection(
    peer: Peer,
    scope: JobScope,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline: float | None = None,
    limits: Limits | None = None,
) -> Conn:
    """A connection to ``peer``, authenticated as this job's (:mod:`.auth`)."""
    try:
        sock = socket.create_connection((peer.host, peer.port), timeout=timeout_s)
    except OSError as e:
        raise PeerUnreachableError(
            f"cannot reach replica peer {peer}: {e} (is its sidecar running, the port open "
            "and allowed by the NetworkPolicy?)",
            refused=isinstance(e, ConnectionRefusedError),
        ) from None
    conn = Conn(sock, timeout_s=timeout_s, limits=HANDSHAKE_LIMITS, deadline=deadline)
    conn.peer = str(peer)
    try:
        connect_as_client(conn, scope)
    except BaseException:
        conn.close()
        raise
    conn.limits = limits or Limits()
    return conn


def push(
    peer: Peer,
    scope: JobScope,
    desc: Descriptor,
    view: memoryview,
    hashes: RecordedHashes | Mapping[str, Sequence[str]] | None,
    *,
    source: str,
    chunk_bytes: int = HASH_CHUNK_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    deadline_s: float | None = None,
) -> PushResult:
    """Replicate one complete snapshot to ``peer``; what was sent, or :class:`ReplicaError`.

    ``view`` is the slot's bytes (as :meth:`~ckpt_agent.flash.reader.ShmReader.open`
    maps them; at least ``desc.data_size`` long), held stable by the caller for the push.
    ``hashes`` are the per-chunk SHA-256 at ``chunk_bytes`` (the persister's
    :class:`RecordedHashes`); None computes them here. ``source`` is this node's name.
    """
    t0 = time.monotonic()
    if len(view) < desc.data_size:
        raise ReplicaError(
            f"push of {desc.checkpoint_id}: {len(view)} bytes given for a "
            f"{desc.data_size}-byte snapshot"
        )
    table = hashes.sha256 if isinstance(hashes, RecordedHashes) else hashes
    if table is None:
        table = _compute(desc, view, chunk_bytes)
    offer = Offer(source, desc, {k: list(v) for k, v in table.items()}, chunk_bytes)
    chunks = offer.chunks()
    deadline = None if deadline_s is None else t0 + deadline_s
    conn = open_connection(peer, scope, timeout_s=timeout_s, deadline=deadline)
    sent = payload = 0
    try:
        conn.send(offer.to_header())
        answer = conn.expect("need").header
        need = answer.get("chunks")
        if not isinstance(need, list) or not all(
            isinstance(i, int) and 0 <= i < len(chunks) for i in need
        ):
            raise ReplicaError(f"replica peer {peer}: a malformed list of chunks it needs")
        try:
            for i in need:
                c = chunks[int(i)]
                with view[c.offset : c.offset + c.length] as piece:
                    conn.send({"t": "chunk", "i": c.index}, piece)
                sent += 1
                payload += c.length
                _raise_if_refused(conn)
        except PeerClosedError:
            _raise_if_refused(conn, wait_s=min(timeout_s, 2.0))
            raise
        done = conn.expect("stored")
        if done.header.get("seq") != desc.seq:
            raise ReplicaError(f"replica peer {peer}: stored another snapshot than offered")
    finally:
        conn.close()
    return PushResult(
        peer=str(peer),
        seq=desc.seq,
        step=desc.step,
        chunks_sent=sent,
        chunks_skipped=len(chunks) - sent,
        bytes_sent=payload,
        wire_bytes=conn.sent_bytes,
        seconds=time.monotonic() - t0,
        already=bool(answer.get("already")),
    )


def _raise_if_refused(conn: Conn, *, wait_s: float = 0.0) -> None:
    """Raise the peer's error when it already answered (it refused a chunk, gave up):
    a push stops at once instead of sending the rest into a closed connection."""
    try:
        readable, _, _ = select.select([conn.sock], [], [], wait_s)
    except (OSError, ValueError):
        return
    if readable:
        try:
            frame = conn.recv()
        except ReplicaError:
            return
        if frame.kind == "error":
            raise remote_error(conn.peer, frame.header)
        raise ReplicaError(f"replica peer {conn.peer}: sent {frame.kind!r} in the middle of a push")


def _compute(desc: Descriptor, view: memoryview, chunk_bytes: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, t in (*desc.tensors.items(), *desc.files.items()):
        with view[t.offset : t.offset + t.nbytes] as piece:
            out[name] = chunk_hashes(piece, chunk_bytes)
    return out
