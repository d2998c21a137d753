"""Framing of the replica protocol: a small JSON header and an optional binary payload.

Every frame on a replica connection is::

    "CKR1"  u32 header length  u64 payload length   (big-endian, 16 bytes)
    header  (UTF-8 JSON object, ``"t"`` names the message)
    payload (raw bytes: a snapshot chunk, or nothing)

Both lengths are checked against the connection's :class:`Limits` *before* anything
is read or allocated: a peer that declares a 2 GiB header is refused after reading
16 bytes. Until the connection is authenticated (:mod:`.auth`) the limits are
:data:`HANDSHAKE_LIMITS` (a few KiB, no payload).

Once authenticated, the connection is **bound to its session** (:meth:`Conn.bind`): every
frame then carries, between header and payload, a 32-byte tag: HMAC-SHA256 under a key
derived from the job's secret and both handshake nonces, over the direction, the frame's
sequence number on the connection, the prefix and the header. A frame injected, altered,
replayed, reordered or reflected by someone on the network path is refused
(:class:`~ckpt_agent.errors.ReplicaAuthError`). The payload (a chunk) is not in the tag:
every chunk is checked against the SHA-256 its authenticated header or offer names.

Every read and write has a timeout, and a connection may carry an overall deadline: a
dead or slow peer never hangs the caller. Torch-free, standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from ckpt_agent.errors import IntegrityError, ReplicaAuthError, ReplicaError, ReplicaIntegrityError

__all__ = [
    "HANDSHAKE_LIMITS",
    "PREFIX",
    "TAG_BYTES",
    "Conn",
    "Frame",
    "FrameTooLargeError",
    "Limits",
    "PeerClosedError",
    "Place",
    "remote_error",
]

MAGIC: Final = b"CKR1"
#: The fixed prefix of every frame: magic, header length, payload length.
PREFIX: Final = struct.Struct(">4sIQ")


class FrameTooLargeError(ReplicaError):
    """A peer declared a header or payload beyond this connection's limits."""


class PeerClosedError(ReplicaError):
    """The peer closed the connection (or it was cut) before a whole frame arrived."""


@dataclass(frozen=True)
class Limits:
    """The largest header and payload a connection accepts."""

    max_header: int = 32 * 1024 * 1024
    """An offer's header carries the snapshot's descriptor and its chunk hashes."""
    max_payload: int = 64 * 1024 * 1024
    """One chunk (the persister's chunk size is 16 MiB)."""


#: The tag every frame of a bound connection carries (HMAC-SHA256).
TAG_BYTES: Final = 32

#: Before authentication: hello and proof messages only, no payload.
HANDSHAKE_LIMITS: Final = Limits(max_header=4096, max_payload=0)


Place: TypeAlias = Callable[[dict[str, object], int], memoryview]
"""Where a frame's payload goes: called with the frame's (authenticated) header and its
payload's length, before any byte of the payload is read; returns a writable view of
exactly that length (empty for a frame without payload), or raises to refuse the frame."""


@dataclass
class Frame:
    header: dict[str, object]
    payload: bytes | bytearray | memoryview = b""

    @property
    def kind(self) -> str:
        return str(self.header.get("t", ""))


class Conn:
    """One framed connection with per-operation timeouts and an optional overall deadline."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        timeout_s: float,
        limits: Limits = HANDSHAKE_LIMITS,
        deadline: float | None = None,
        peer: str = "",
    ) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.limits = limits
        self.deadline = deadline
        """``time.monotonic()`` after which every operation fails (None: no deadline)."""
        self.peer = peer or _peer_name(sock)
        self.sent_bytes = 0
        self._key: bytes | None = None
        self._out = self._in = b""
        self._sent = self._received = 0

    # ------------------------------------------------------------------ the session

    def bind(self, key: bytes, role: str) -> None:
        """From the next frame on, tag every frame sent and require the tag on every frame
        received (``key``: the session key both sides derived; ``role``: this side's,
        ``client`` or ``server``, so that a frame is never accepted in the other direction)."""
        if role not in ("client", "server"):
            raise ValueError(f"role must be client or server, not {role!r}")
        self._key = key
        self._out, self._in = (b"c>s", b"s>c") if role == "client" else (b"s>c", b"c>s")
        self._sent = self._received = 0

    @property
    def bound(self) -> bool:
        return self._key is not None

    def _tag(self, direction: bytes, seq: int, framed: bytes) -> bytes:
        assert self._key is not None
        msg = direction + seq.to_bytes(8, "big") + framed
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    # ------------------------------------------------------------------ timeouts

    def _arm(self) -> None:
        timeout = self.timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ReplicaError(
                    f"replica peer {self.peer}: the deadline passed; the peer is too slow "
                    "or the snapshot too large for the push deadline"
                )
            timeout = min(timeout, left)
        self.sock.settimeout(timeout)

    def _timeout(self, what: str) -> ReplicaError:
        return ReplicaError(
            f"replica peer {self.peer}: no progress {what} within {self.timeout_s:g} s "
            "(peer dead, overloaded or unreachable; check the peer's sidecar and the network)"
        )

    # ------------------------------------------------------------------ sending

    def send(
        self, header: dict[str, object], payload: bytes | bytearray | memoryview = b""
    ) -> None:
        """Send one frame (header, then the payload as it is: no copy of a memoryview)."""
        head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
        size = len(payload)
        framed = PREFIX.pack(MAGIC, len(head), size) + head
        if self._key is not None:
            framed += self._tag(self._out, self._sent, framed)
            self._sent += 1
        try:
            self._arm()
            self.sock.sendall(framed)
            if size:
                self._arm()
                self.sock.sendall(payload)
        except TimeoutError:
            raise self._timeout("sending") from None
        except OSError as e:
            raise PeerClosedError(
                f"replica peer {self.peer}: connection lost while sending ({e})"
            ) from None
        self.sent_bytes += len(framed) + size

    # ------------------------------------------------------------------ receiving

    def recv(self, *, into: bytearray | Place | None = None) -> Frame:
        """Receive one frame; its payload lands in ``into`` when given: a buffer (reused, at
        least ``limits.max_payload`` long), or a :data:`Place` that says where, from the
        header (e.g. straight into the chunk's place in a slot; the caller then releases
        the view it gave). Sizes are checked before any read."""
        prefix = self._read_exact(PREFIX.size)
        magic, head_len, size = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise ReplicaError(
                f"replica peer {self.peer}: not the replica protocol (magic {bytes(magic)!r}); "
                "is the address a replica port?"
            )
        if head_len > self.limits.max_header:
            raise FrameTooLargeError(
                f"replica peer {self.peer}: a header of {head_len} bytes exceeds the "
                f"{self.limits.max_header}-byte limit; refused"
            )
        if size > self.limits.max_payload:
            raise FrameTooLargeError(
                f"replica peer {self.peer}: a payload of {size} bytes exceeds the "
                f"{self.limits.max_payload}-byte limit; refused"
            )
        head = self._read_exact(head_len)
        if self._key is not None:
            tag = self._read_exact(TAG_BYTES)
            want = self._tag(self._in, self._received, bytes(prefix) + head)
            if not hmac.compare_digest(tag, want):
                raise ReplicaAuthError(
                    f"replica peer {self.peer}: frame {self._received} failed the session's "
                    "authentication (altered, injected or replayed on the network path); "
                    "connection dropped"
                )
            self._received += 1
        try:
            header = json.loads(head)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ReplicaError(f"replica peer {self.peer}: a header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ReplicaError(f"replica peer {self.peer}: a header is not a JSON object")
        if callable(into):
            view = into(header, size)
            if len(view) != size:
                raise ReplicaError(f"replica peer {self.peer}: no place for a {size}-byte payload")
            try:
                self._read_into(view)
            except BaseException:
                view.release()  # a view of a mapping must not outlive this frame's failure
                raise
            return Frame(header, view)
        if not size:
            return Frame(header)
        if into is not None:
            if size > len(into):
                raise FrameTooLargeError(
                    f"replica peer {self.peer}: a payload of {size} bytes exceeds the "
                    f"{len(into)}-byte chunk size it announced; refused"
                )
            view = memoryview(into)[:size]
            self._read_into(view)
            return Frame(header, view)
        return Frame(header, self._read_exact(size))

    def _read_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self._read_into(memoryview(buf))
        return buf

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                self._arm()
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                raise self._timeout("receiving") from None
            except OSError as e:
                raise PeerClosedError(
                    f"replica peer {self.peer}: connection lost while receiving ({e})"
                ) from None
            if k == 0:
                raise PeerClosedError(
                    f"replica peer {self.peer}: the connection closed in the middle of a "
                    f"frame ({got} of {len(view)} bytes)"
                    if got
                    else f"replica peer {self.peer}: the connection closed"
                )
            got += k

    def expect(self, *kinds: str, into: bytearray | Place | None = None) -> Frame:
        """The next frame, which must be one of ``kinds``; a peer's ``error`` frame is raised."""
        frame = self.recv(into=into)
        if frame.kind == "error":
            raise remote_error(self.peer, frame.header)
        if frame.kind not in kinds:
            raise ReplicaError(
                f"replica peer {self.peer}: expected {'/'.join(kinds)}, got {frame.kind!r}"
            )
        return frame

    def send_error(self, error: BaseException | str) -> None:
        """Tell the peer why this side gives up (best effort: the connection may be gone);
        an auth refusal or an integrity failure keeps its kind on the other side."""
        try:
            self.send(
                {
                    "t": "error",
                    "error": str(error)[:2000],
                    "auth": isinstance(error, ReplicaAuthError),
                    "integrity": isinstance(error, IntegrityError),
                }
            )
        except ReplicaError:
            pass

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover - close never fails on Linux
            pass


def remote_error(peer: str, header: dict[str, object]) -> ReplicaError:
    """The error a peer's ``error`` frame reports (an auth refusal keeps its type)."""
    text = f"replica peer {peer} refused: {header.get('error', '')}"
    if header.get("auth"):
        return ReplicaAuthError(text)
    if header.get("integrity"):
        return ReplicaIntegrityError(text)
    return ReplicaError(text)


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "?"
    return f"{host}:{port}"
