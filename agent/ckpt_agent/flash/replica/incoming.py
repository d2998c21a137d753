"""One replica being received: chunks checked and written, then published or dropped.

:meth:`.store.ReplicaStore.begin` makes an :class:`Incoming` in a new snapshot folder;
it copies the chunks the current replica holds (:meth:`Incoming.copy_from`, each checked
there as it is at rest), takes the others from the sender (:meth:`Incoming.put`, each
checked against its SHA-256), records the fast checksum of every chunk it wrote (what the
replica is checked with at rest from then on), and is published with its descriptor
renamed into place last (:meth:`Incoming.publish`) or removed (:meth:`Incoming.abort`).
Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ckpt_agent.errors import ReplicaError, ReplicaIntegrityError
from ckpt_agent.flash.checksums import fast_checksum
from ckpt_agent.flash.protocol import HEADER, MAGIC, atomic_write
from ckpt_agent.flash.replica.layout import DATA, DESC, HASHES, remove, snapshot_folders
from ckpt_agent.flash.replica.plan import Chunk, Offer, hashes_doc

__all__ = ["HeldReplica", "Incoming"]


class HeldReplica(Protocol):
    """What :meth:`Incoming.copy_from` reads of the replica held
    (:class:`~.store.StoredReplica`; a protocol, so the store and this module do not import
    each other)."""

    @property
    def fast(self) -> dict[str, list[str]] | None: ...

    @property
    def data_path(self) -> Path: ...

    def intact(self, chunk: Chunk, data: bytes | bytearray | memoryview) -> bool: ...


class Incoming:
    """A replica being received (see :meth:`.store.ReplicaStore.begin`); publish or abort it."""

    def __init__(
        self,
        folder: Path | None,
        offer: Offer,
        chunks: list[Chunk],
        *,
        already: Path | None = None,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        self.folder = folder
        self.offer = offer
        self.chunks = chunks
        self.already = already
        """The complete replica that is this very snapshot (nothing to receive), or None."""
        self.need: list[int] = [] if already is not None else [c.index for c in chunks]
        self._pending = set(self.need)
        self._fast: list[str] = ["" for _ in chunks]
        """The fast checksum of each chunk written (by index)."""
        self.copied = 0
        self._fd = -1
        self._done = False
        self._on_done = on_done
        if folder is not None:
            self._fd = os.open(folder / DATA, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(self._fd, offer.desc.data_size)
            seq, size = offer.desc.seq, offer.desc.data_size
            if size >= HEADER.size:  # the slot's header: the data file reads like a slot file
                _write_at(self._fd, HEADER.pack(MAGIC, seq, seq, size), 0)

    def copy_from(self, current: HeldReplica, held: list[Chunk]) -> None:
        """Copy the chunks the ``current`` replica holds (``held``, its chunks) by digest,
        each one checked there (:meth:`~.store.StoredReplica.intact`): a replica corrupted
        at rest is never copied; such a chunk is asked from the sender."""
        have = {c.sha256: c for c in held}
        if not have:
            return
        with open(current.data_path, "rb") as src:
            fd = src.fileno()
            need: list[int] = []
            for i in self.need:
                chunk = self.chunks[i]
                old = have.get(chunk.sha256)
                data = os.pread(fd, old.length, old.offset) if old is not None else b""
                if old is not None and old.length == chunk.length and current.intact(old, data):
                    _write_at(self._fd, data, chunk.offset)
                    was = current.fast  # the same bytes: their checksum as recorded
                    self._fast[i] = fast_checksum(data) if was is None else was[old.name][old.part]
                    self.copied += 1
                else:
                    need.append(i)
        self.need = need
        self._pending = set(need)

    def put(self, index: int, data: bytes | bytearray | memoryview) -> None:
        """Write chunk ``index`` after checking its SHA-256 (:class:`ReplicaIntegrityError`);
        its fast checksum is recorded."""
        if index not in self._pending:
            raise ReplicaError(f"replica chunk {index} was not asked for (or sent twice)")
        chunk = self.chunks[index]
        if not chunk.ok(data):
            raise ReplicaIntegrityError(
                f"replica chunk {chunk.part} of {chunk.name!r} (rank {self.offer.desc.rank}, "
                f"seq {self.offer.desc.seq}) does not match its SHA-256: corrupted in flight "
                "or in the sender's memory; refused"
            )
        self._fast[index] = fast_checksum(data)
        _write_at(self._fd, data, chunk.offset)
        self._pending.discard(index)

    @property
    def complete(self) -> bool:
        return not self._pending

    def publish(self) -> Path:
        """Publish the replica (descriptor renamed last), then delete the older one."""
        if self.already is not None:
            self._finish()
            return self.already
        if self._pending or self.folder is None:
            raise ReplicaError(f"replica not complete: {len(self._pending)} chunks missing")
        os.close(self._fd)
        self._fd = -1
        fast: dict[str, list[str]] = {}
        for c in self.chunks:
            fast.setdefault(c.name, []).append(self._fast[c.index])
        (self.folder / HASHES).write_bytes(hashes_doc(self.offer, fast))
        atomic_write(self.folder / DESC, self.offer.desc.to_bytes())
        rank_dir = self.folder.parent
        for p in snapshot_folders(rank_dir, complete=False):
            if p != self.folder:
                remove(p)
        self._finish()
        return self.folder

    def abort(self) -> None:
        """Drop what was received (the previous complete replica stays)."""
        if self._done:
            return
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.folder is not None:
            remove(self.folder)
        self._finish()

    def _finish(self) -> None:
        self._done = True
        self._on_done()


def _write_at(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        k = os.pwrite(fd, view, offset)
        view, offset = view[k:], offset + k
