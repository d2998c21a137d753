"""Reading a replica back, every chunk verified: from a peer over the wire, or from this
node's store.

* :func:`fetch` (recovery on a third node): asks a peer's :class:`~.server.ReplicaServer`
  for its replica of (source, rank) and receives it chunk by chunk straight into its
  place in memory (``into``: a slot; no buffer, no copy), each chunk checked against its
  SHA-256 on arrival — on worker threads, while the next chunk is received (hashlib
  releases the GIL) — and its fast checksum computed from the same bytes
  (:attr:`Replica.fast`: the installed snapshot's, :func:`~.rehydrate.publish`). The
  SHA-256s are the ones of the replica's header, a frame authenticated with the job's
  secret (:mod:`.wire`): this check is what guards the receiver against a peer.
* :func:`open_local` (recovery on the node that holds it): maps the stored replica
  read-only and checks every chunk at rest (:meth:`~.store.StoredReplica.intact`: the
  fast checksum recorded when it arrived, verified with SHA-256 then) before handing it
  out.

A replica whose bytes do not match (a bit flipped at rest, a chunk garbled in flight) is
*unusable*: :class:`~ckpt_agent.errors.ReplicaIntegrityError` is raised and no byte of it
is returned; recovery takes the next source. Torch-free.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

from ckpt_agent.background import usable_cpus
from ckpt_agent.errors import ReplicaError, ReplicaIntegrityError
from ckpt_agent.flash.checksums import fast_checksum
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.client import DEFAULT_TIMEOUT_S, Peer, open_connection
from ckpt_agent.flash.replica.plan import Chunk, Offer, check_disjoint
from ckpt_agent.flash.replica.store import ReplicaStore
from ckpt_agent.flash.replica.wire import Conn, Limits

__all__ = ["VERIFY_THREADS_MAX", "Replica", "fetch", "list_replicas", "open_local"]

log = logging.getLogger(__name__)

#: Threads that verify a fetched replica's chunks while the next ones arrive, at most (and
#: no more than the CPUs this process may use, :func:`~ckpt_agent.background.usable_cpus`).
VERIFY_THREADS_MAX: Final = 4


@dataclass
class Replica:
    """A verified replica: the snapshot's descriptor and its bytes (the slot's offsets)."""

    source: str
    rank: int
    desc: Descriptor
    data: memoryview
    hashes: dict[str, list[str]] = field(default_factory=dict)
    """The chunk SHA-256s its bytes were verified against (by name)."""
    chunk_bytes: int = 0
    """Their chunk size."""
    fast: dict[str, list[str]] | None = None
    """The fast checksum of each of those chunks, of these very bytes (None: not known)."""

    def tensor(self, name: str) -> memoryview:
        t = self.desc.tensors[name]
        return self.data[t.offset : t.offset + t.nbytes]

    def file(self, name: str) -> memoryview:
        t = self.desc.files[name]
        return self.data[t.offset : t.offset + t.nbytes]


def fetch(
    peer: Peer,
    scope: JobScope,
    source: str,
    rank: int,
    *,
    run_id: str | None = None,
    max_bytes: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    limits: Limits | None = None,
    into: Callable[[Descriptor], memoryview] | None = None,
    threads: int | None = None,
) -> Replica:
    """``peer``'s replica of rank ``rank`` of node ``source``, verified, in memory.

    ``run_id`` (when given) must be the replica's run; ``max_bytes`` bounds the memory
    this side allocates for it. ``into``: where to receive it (called with the offered
    descriptor once it passed those checks; at least ``data_size`` bytes, writable), e.g. a
    slot of a shared-memory area; default a new buffer. ``threads``: how many verify the
    chunks (default: the usable CPUs, at most :data:`VERIFY_THREADS_MAX`). Raises
    :class:`ReplicaIntegrityError` when the replica is corrupted (at rest on the peer, or
    in flight), :class:`ReplicaError` otherwise (what was received into ``into`` then is
    not a replica).
    """
    conn = open_connection(peer, scope, timeout_s=timeout_s, limits=limits)
    try:
        conn.send({"t": "fetch", "source": source, "rank": rank})
        head = conn.expect("replica").header
        offer = Offer.from_header(head)
        desc = offer.desc
        if offer.source != source or desc.rank != rank:
            raise ReplicaError(f"replica peer {peer}: sent {offer.source} rank {desc.rank}")
        if run_id is not None and desc.run_id != run_id:
            raise ReplicaError(f"replica peer {peer}: a replica of run {desc.run_id!r}")
        if max_bytes is not None and desc.data_size > max_bytes:
            raise ReplicaError(
                f"the replica of {source} rank {rank} has {desc.data_size} bytes, more than "
                f"the {max_bytes} this side accepts"
            )
        if offer.chunk_bytes > conn.limits.max_payload:
            raise ReplicaError(f"replica peer {peer}: chunks beyond the payload limit")
        chunks = offer.chunks()
        check_disjoint(chunks)  # each chunk is written and verified in its own place
        data = into(desc) if into is not None else memoryview(bytearray(desc.data_size))
        if len(data) < desc.data_size:
            raise ReplicaError(f"{len(data)} bytes to receive a {desc.data_size}-byte replica")
        n = threads if threads is not None else min(VERIFY_THREADS_MAX, usable_cpus())
        with _Verifier(chunks, source, rank, max(1, n)) as verifier:
            _receive(conn, chunks, data, verifier)
            fast = verifier.finish()
    finally:
        conn.close()
    return Replica(source, rank, desc, data, offer.hashes, offer.chunk_bytes, fast)


def _receive(conn: Conn, chunks: list[Chunk], data: memoryview, verifier: _Verifier) -> None:
    """Every chunk of the replica from ``conn``, each read straight into its place in
    ``data`` and handed to ``verifier``, until the peer's ``end``."""
    peer = conn.peer
    missing = {c.index for c in chunks}

    def place(header: dict[str, object], size: int) -> memoryview:
        if header.get("t") != "chunk":
            if size:
                raise ReplicaError(f"replica peer {peer}: a {header.get('t')!r} with a payload")
            return memoryview(b"")
        index = header.get("i")
        if not isinstance(index, int) or index not in missing:
            raise ReplicaError(f"replica peer {peer}: an unexpected chunk {index!r}")
        chunk = chunks[index]
        if size != chunk.length:
            raise verifier.corrupted(chunk, f"{size} bytes sent for its {chunk.length}")
        missing.discard(index)
        return verifier.hold(data[chunk.offset : chunk.offset + chunk.length])

    while True:
        frame = conn.expect("chunk", "end", into=place)
        if frame.kind == "end":
            break
        index = frame.header.get("i")
        assert isinstance(index, int) and isinstance(frame.payload, memoryview)
        verifier.submit(chunks[index], frame.payload)
    if missing:
        raise ReplicaError(
            f"replica peer {peer}: the replica of {verifier.source} rank {verifier.rank} ended "
            f"with {len(missing)} chunks missing"
        )


class _Verifier:
    """Checks received chunks on worker threads, in the order they came; the first failure
    is raised by the next :meth:`submit` or :meth:`finish`. On exit every check has
    finished and every view of the destination it was given is released."""

    def __init__(self, chunks: list[Chunk], source: str, rank: int, threads: int) -> None:
        self.chunks, self.source, self.rank = chunks, source, rank
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-replica-verify")
        self._pending: collections.deque[Future[None]] = collections.deque()
        self._views: list[memoryview] = []
        self._fast = ["" for _ in chunks]

    def __enter__(self) -> _Verifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)  # no check still reads the destination
        for v in self._views:
            v.release()

    def hold(self, view: memoryview) -> memoryview:
        """``view`` (a chunk's place) is released on exit, whatever happened."""
        self._views.append(view)
        return view

    def corrupted(self, chunk: Chunk, how: str) -> ReplicaIntegrityError:
        return ReplicaIntegrityError(
            f"the replica of {self.source} rank {self.rank} is corrupted in flight or on the "
            f"peer: chunk {chunk.part} of {chunk.name!r} {how}; unusable, use another source"
        )

    def submit(self, chunk: Chunk, view: memoryview) -> None:
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()  # a failed check stops the receiving
        self._pending.append(self._pool.submit(self._check, chunk, view))

    def _check(self, chunk: Chunk, view: memoryview) -> None:
        if not chunk.ok(view):
            raise self.corrupted(chunk, "does not match its SHA-256")
        self._fast[chunk.index] = fast_checksum(view)  # of the bytes just verified

    def finish(self) -> dict[str, list[str]]:
        """Wait for every check (the first failure raised); the fast checksums by name."""
        while self._pending:
            self._pending.popleft().result()
        out: dict[str, list[str]] = {}
        for c in self.chunks:
            out.setdefault(c.name, []).append(self._fast[c.index])
        return out


def list_replicas(
    peer: Peer, scope: JobScope, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[dict[str, object]]:
    """The replicas ``peer`` holds: source, rank, seq, step, checkpoint_id, data_size."""
    conn = open_connection(peer, scope, timeout_s=timeout_s)
    try:
        conn.send({"t": "list"})
        held = conn.expect("replicas").header.get("replicas")
    finally:
        conn.close()
    if not isinstance(held, list) or not all(isinstance(r, dict) for r in held):
        raise ReplicaError(f"replica peer {peer}: a malformed list of replicas")
    return [dict(r) for r in held]


@contextlib.contextmanager
def open_local(store: ReplicaStore, source: str, rank: int) -> Iterator[Replica]:
    """This node's replica of (source, rank), mapped read-only and checked chunk by chunk
    at rest (:meth:`~.store.StoredReplica.intact`).

    Raises :class:`ReplicaError` when there is none, :class:`ReplicaIntegrityError` when
    any chunk does not match (the replica is unusable). The mapping is released on exit;
    do not keep views of it.
    """
    replica = store.current(source, rank)
    if replica is None:
        raise ReplicaError(f"no replica of {source} rank {rank} on this node")
    with replica.mapped() as view:
        for chunk in replica.offer().chunks():
            with view[chunk.offset : chunk.offset + chunk.length] as piece:
                if not replica.intact(chunk, piece):
                    raise ReplicaIntegrityError(
                        f"the replica of {source} rank {rank} is corrupted at rest: chunk "
                        f"{chunk.part} of {chunk.name!r} does not match the checksum recorded "
                        "when it arrived; unusable, use another source"
                    )
        yield Replica(
            source, rank, replica.desc, view, replica.hashes, replica.chunk_bytes, replica.fast
        )
