"""Reading a replica back, every chunk verified: from a peer over the wire, or from this
node's store.

* :func:`fetch` (recovery on a third node): asks a peer's :class:`~.server.ReplicaServer`
  for its replica of (source, rank) and receives it chunk by chunk into memory, each
  chunk checked against its SHA-256 on arrival.
* :func:`open_local` (recovery on the node that holds it): maps the stored replica
  read-only and checks every chunk before handing it out.

A replica whose bytes do not match (a bit flipped at rest, a chunk garbled in flight) is
*unusable*: :class:`~ckpt_agent.errors.ReplicaIntegrityError` is raised and no byte of it
is returned; recovery takes the next source. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ckpt_agent.errors import ReplicaError, ReplicaIntegrityError
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.client import DEFAULT_TIMEOUT_S, Peer, open_connection
from ckpt_agent.flash.replica.plan import Chunk, Offer
from ckpt_agent.flash.replica.store import ReplicaStore
from ckpt_agent.flash.replica.wire import Limits

__all__ = ["Replica", "fetch", "list_replicas", "open_local"]

log = logging.getLogger(__name__)


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
) -> Replica:
    """``peer``'s replica of rank ``rank`` of node ``source``, verified, in memory.

    ``run_id`` (when given) must be the replica's run; ``max_bytes`` bounds the memory
    this side allocates for it. ``into``: where to receive it (called with the offered
    descriptor once it passed those checks; at least ``data_size`` bytes, writable), e.g. a
    slot of a shared-memory area; default a new buffer. Raises
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
        data = into(desc) if into is not None else memoryview(bytearray(desc.data_size))
        if len(data) < desc.data_size:
            raise ReplicaError(f"{len(data)} bytes to receive a {desc.data_size}-byte replica")
        buf = bytearray(offer.chunk_bytes)
        missing = {c.index for c in chunks}
        while True:
            frame = conn.expect("chunk", "end", into=buf)
            if frame.kind == "end":
                break
            index = frame.header.get("i")
            if not isinstance(index, int) or index not in missing:
                raise ReplicaError(f"replica peer {peer}: an unexpected chunk {index!r}")
            chunk = chunks[index]
            _check(chunk, frame.payload, source, rank, "in flight")
            data[chunk.offset : chunk.offset + chunk.length] = frame.payload
            missing.discard(index)
        if missing:
            raise ReplicaError(
                f"replica peer {peer}: the replica of {source} rank {rank} ended with "
                f"{len(missing)} chunks missing"
            )
    finally:
        conn.close()
    return Replica(source, rank, desc, data, offer.hashes, offer.chunk_bytes)


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
    """This node's replica of (source, rank), mapped read-only and verified chunk by chunk.

    Raises :class:`ReplicaError` when there is none, :class:`ReplicaIntegrityError` when
    any chunk does not match its SHA-256 (the replica is unusable). The mapping is
    released on exit; do not keep views of it.
    """
    replica = store.current(source, rank)
    if replica is None:
        raise ReplicaError(f"no replica of {source} rank {rank} on this node")
    desc = replica.desc
    fd = os.open(replica.data_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < desc.data_size:
            raise ReplicaIntegrityError(
                f"the replica of {source} rank {rank} is truncated; unusable, use another source"
            )
        mm = (
            mmap.mmap(fd, desc.data_size, mmap.MAP_SHARED, mmap.PROT_READ)
            if desc.data_size
            else None
        )
    finally:
        os.close(fd)
    view = memoryview(mm) if mm is not None else memoryview(b"")
    try:
        for chunk in replica.offer().chunks():
            with view[chunk.offset : chunk.offset + chunk.length] as piece:
                _check(chunk, piece, source, rank, "at rest")
        yield Replica(source, rank, desc, view, replica.hashes, replica.chunk_bytes)
    finally:
        view.release()
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view of it is still referenced: unmapped when freed
                log.warning("the replica of %s rank %d is still referenced", source, rank)


def _check(
    chunk: Chunk, data: bytes | bytearray | memoryview, source: str, rank: int, where: str
) -> None:
    if not chunk.ok(data):
        raise ReplicaIntegrityError(
            f"the replica of {source} rank {rank} is corrupted {where}: chunk {chunk.part} "
            f"of {chunk.name!r} does not match its SHA-256; unusable, use another source"
        )
