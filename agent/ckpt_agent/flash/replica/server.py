"""The receiver: a threaded TCP server that stores peers' replicas and serves them back.

One request per connection, after the handshake (:mod:`.auth`):

* ``offer`` (a peer pushes a snapshot, :mod:`.client`): the store starts a new replica
  (:meth:`~.store.ReplicaStore.begin`), the server answers ``need`` with the chunks it
  lacks, receives them (each checked against its SHA-256), publishes the replica and
  answers ``stored``; anything else (a cut connection, a bad chunk, a timeout) drops the
  partial replica and keeps the previous one.
* ``fetch`` (recovery on another node, :mod:`.fetch`): the replica's descriptor and hashes,
  then every chunk, sent from the replica's file mapped read-only (no copy), each checked
  at rest before it is sent (:meth:`~.store.StoredReplica.intact`: the fast checksum
  recorded when it arrived): a replica corrupted at rest is reported unusable (``error``
  with ``integrity``), never sent. The receiver checks every chunk against its SHA-256
  again: that check, not this one, is what guards it against a peer.
* ``list``: the replicas this node holds (source, rank, seq, step).
* ``mark`` / ``get_mark``: a rank's step heartbeat record (JIT saves), kept and served
  back (:mod:`.marks`).

:meth:`ReplicaServer.start` serves on its own thread (and one thread per connection, at
most ``max_connections``); nothing blocks the caller. Every refusal and failure is counted
and its reason kept (:attr:`ReplicaServer.stats`). Torch-free.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ckpt_agent.errors import ReplicaAuthError, ReplicaError, ReplicaIntegrityError
from ckpt_agent.flash.replica.auth import JobScope, accept
from ckpt_agent.flash.replica.marks import MarkStore, serve_mark
from ckpt_agent.flash.replica.plan import Chunk, Offer
from ckpt_agent.flash.replica.store import ReplicaStore, StoredReplica
from ckpt_agent.flash.replica.wire import HANDSHAKE_LIMITS, Conn, Frame, Limits
from ckpt_agent.text import clean

__all__ = ["ReplicaServer", "ServerStats"]

log = logging.getLogger(__name__)

#: Seconds a peer has for the handshake (it holds a connection slot meanwhile).
HANDSHAKE_TIMEOUT_S = 10.0


@dataclass
class ServerStats:
    """What a server did (counters, and the last reasons it refused or failed)."""

    connections: int = 0
    refused: int = 0
    """Connections refused by the handshake (another job, wrong secret) or when busy."""
    stored: int = 0
    failed: int = 0
    """Requests that failed after the handshake (cut, timeout, bad chunk, corrupted replica)."""
    fetched: int = 0
    chunks_received: int = 0
    chunks_copied: int = 0
    bytes_received: int = 0
    errors: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=32))


class ReplicaServer:
    """Serves one job's replicas on ``host:port`` (see the module doc)."""

    def __init__(
        self,
        store: ReplicaStore,
        scope: JobScope,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        timeout_s: float = 60.0,
        limits: Limits | None = None,
        max_connections: int = 8,
        marks: MarkStore | None = None,
    ) -> None:
        self.store = store
        self.marks = marks
        """Peers' step heartbeat records (``mark``, ``get_mark``: JIT saves); None: refused."""
        self.scope = scope
        self.timeout_s = timeout_s
        self.limits = limits or Limits()
        self.stats = ServerStats()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._active: dict[socket.socket, threading.Thread] = {}
        self._thread: threading.Thread | None = None
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> ReplicaServer:
        """Serve on a background thread; returns at once."""
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},  # how soon close() stops the accept loop
            name="ckpt-replica-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving; connections in flight are cut (their partial replicas dropped)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        with self._lock:
            active = dict(self._active)
        for sock, thread in active.items():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            thread.join(self.timeout_s)
        self._server.server_close()

    # ------------------------------------------------------------------ one connection

    def _handle(self, sock: socket.socket) -> None:
        # an unauthenticated peer holds a connection slot briefly (HANDSHAKE_TIMEOUT_S)
        conn = Conn(
            sock, timeout_s=min(self.timeout_s, HANDSHAKE_TIMEOUT_S), limits=HANDSHAKE_LIMITS
        )
        if not self._slots.acquire(blocking=False):
            self._record("refused", f"{conn.peer}: too many connections")
            conn.send_error("too many replica connections; try again later")
            _linger(sock, limit_s=1.0)
            return
        with self._lock:
            self.stats.connections += 1
            self._active[sock] = threading.current_thread()
        try:
            try:
                accept(conn, self.scope)
            except ReplicaError as e:  # an auth refusal was already told to the client
                self._record("refused", str(e))
                if not isinstance(e, ReplicaAuthError):
                    conn.send_error(e)
                    _linger(sock, limit_s=1.0)
                return
            try:
                conn.limits = self.limits
                conn.timeout_s = self.timeout_s
                self._dispatch(conn, conn.recv())
            except (ReplicaError, OSError, ValueError) as e:
                self._record("failed", str(e))
                if not isinstance(e, ReplicaAuthError):
                    conn.send_error(e)
                    _linger(sock)
        finally:
            with self._lock:
                self._active.pop(sock, None)
            self._slots.release()

    def _dispatch(self, conn: Conn, req: Frame) -> None:
        if req.kind in ("mark", "get_mark") and self.marks is not None:
            serve_mark(self.marks, conn, req)
        elif req.kind == "offer":
            self._receive(conn, Offer.from_header(req.header))
        elif req.kind == "fetch":
            source, rank = req.header.get("source"), req.header.get("rank")
            if not isinstance(source, str) or not isinstance(rank, int):
                raise ReplicaError("a fetch names a source node and a rank")
            self._send(conn, source, rank)
        elif req.kind == "list":
            held = [
                {
                    "source": r.source,
                    "rank": r.rank,
                    "seq": r.desc.seq,
                    "step": r.desc.step,
                    "checkpoint_id": r.desc.checkpoint_id,
                    "data_size": r.desc.data_size,
                }
                for r in self.store.replicas()
            ]
            conn.send({"t": "replicas", "replicas": held})
        else:
            raise ReplicaError(f"unknown replica request {req.kind!r}")

    def _receive(self, conn: Conn, offer: Offer) -> None:
        if offer.chunk_bytes > self.limits.max_payload:
            raise ReplicaError(
                f"replica chunks of {offer.chunk_bytes} bytes exceed this node's "
                f"{self.limits.max_payload}-byte limit"
            )
        incoming = self.store.begin(offer)
        try:
            conn.send(
                {
                    "t": "need",
                    "chunks": incoming.need,
                    "copied": incoming.copied,
                    "already": incoming.already is not None,
                }
            )
            buf = bytearray(offer.chunk_bytes)
            received = 0
            while not incoming.complete:
                frame = conn.expect("chunk", into=buf)
                index = frame.header.get("i")
                if not isinstance(index, int):
                    raise ReplicaError("a chunk frame without its index")
                incoming.put(index, frame.payload)
                received += 1
                with self._lock:
                    self.stats.chunks_received += 1
                    self.stats.bytes_received += len(frame.payload)
            incoming.publish()
        except BaseException:
            incoming.abort()
            raise
        with self._lock:
            self.stats.stored += 1
            self.stats.chunks_copied += incoming.copied
        conn.send({"t": "stored", "seq": offer.desc.seq, "received": received})

    def _send(self, conn: Conn, source: str, rank: int) -> None:
        for _ in range(3):  # a push may replace the replica between listing and opening
            replica = self.store.current(source, rank)
            if replica is None:
                raise ReplicaError(f"no replica of {source} rank {rank} on this node")
            with contextlib.ExitStack() as stack:
                try:
                    view = stack.enter_context(replica.mapped())
                except FileNotFoundError:
                    continue
                self._stream(conn, replica, view)
            return
        raise ReplicaError(f"the replica of {source} rank {rank} kept changing; try again")

    def _stream(self, conn: Conn, replica: StoredReplica, view: memoryview) -> None:
        """The replica's chunks, each checked at rest (on a helper thread, the next chunk
        while this one is sent) before it is sent."""
        offer = replica.offer()
        chunks = offer.chunks()

        def check(chunk: Chunk) -> None:
            with view[chunk.offset : chunk.offset + chunk.length] as piece:
                if not replica.intact(chunk, piece):
                    raise ReplicaIntegrityError(
                        f"the replica of {replica.source} rank {replica.rank} (step "
                        f"{replica.desc.step}) is corrupted at rest: chunk {chunk.part} of "
                        f"{chunk.name!r} does not match the checksum recorded when it arrived; "
                        "unusable, use another source"
                    )

        conn.send({**offer.to_header(), "t": "replica"})
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-replica-check") as checker:
            checked = checker.submit(check, chunks[0]) if chunks else None
            for i, chunk in enumerate(chunks):
                assert checked is not None
                checked.result()
                if i + 1 < len(chunks):
                    checked = checker.submit(check, chunks[i + 1])
                with view[chunk.offset : chunk.offset + chunk.length] as piece:
                    conn.send({"t": "chunk", "i": chunk.index}, piece)
        conn.send({"t": "end"})
        with self._lock:
            self.stats.fetched += 1

    def _record(self, what: str, why: str) -> None:
        with self._lock:
            if what == "refused":
                self.stats.refused += 1
            else:
                self.stats.failed += 1
            self.stats.errors.append(why)
        log.warning("replica server: %s: %s", what, clean(why))


def _linger(sock: socket.socket, *, limit_s: float = 5.0) -> None:
    """Let the client read the error: stop sending, then read (and drop) what it still
    sends until it closes, a few seconds at most. Closing with its chunks unread would
    reset the connection, and the client would see a cut instead of the reason."""
    deadline = time.monotonic() + limit_s
    try:
        sock.shutdown(socket.SHUT_WR)
        buf = bytearray(64 * 1024)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(min(1.0, left))
            if not sock.recv_into(buf):
                return
    except OSError:
        return
