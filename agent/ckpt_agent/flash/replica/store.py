"""The receiver's replicas: peers' snapshots kept in this node's memory, never half-written.

Layout, next to the node's own areas (:mod:`ckpt_agent.flash.protocol`)::

    <shm_dir>/<run_id>/replicas/<source>/rank_<nnnnn>/
        seq_<seq>.<random>/          one snapshot of rank n of node <source>
            data                     the slot's bytes (same offsets as the source's slot)
            hashes.json              the SHA-256 of every chunk, and its fast checksum
                                     as it arrived (:mod:`.plan`)
            descriptor.json          the snapshot's descriptor: exists ⇔ complete

**Memory bound.** Per (source, rank) this store holds at most *two* snapshot folders: the
newest complete replica and the one being received. A new offer first removes every
incomplete folder (a push cut earlier); a second concurrent offer for the same (source,
rank) is refused; the older complete folder is deleted right after the new one is
published. A peer-rank therefore costs at most ``2 × data_size`` of memory (tmpfs pages
count against the pod's memory limit), and ``data_size`` once no push is in flight.

**Never half-written.** A replica is written into a new folder: its data file, filled chunk
by chunk (each one checked against its SHA-256 before it is written, and its fast checksum
recorded), then ``hashes.json``, then the descriptor, written to a temporary name and
renamed last. A folder without ``descriptor.json`` is never read and is removed by the
next offer.

**Checked at rest.** Once stored, a replica's chunks are checked against the fast checksums
recorded on arrival (:meth:`StoredReplica.intact`; the SHA-256 for a replica stored
without them) whenever they are read: copied into the next replica, sent to a peer
(:mod:`.server`), read back on this node (:func:`~.fetch.open_local`). What each check
protects against: docs/replicas.md.

**Content addressing.** Chunks whose digest the current complete replica already holds are
copied from it (after checking them there: a replica corrupted at rest is never
propagated) and not asked from the sender (:attr:`Incoming.need`).

Names are checked (``source`` like a run id, ranks as numbers): nothing outside
``<shm_dir>/<run_id>/replicas/`` is ever written or removed, and links are never followed.
Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ckpt_agent.errors import CheckpointFormatError, ReplicaError, ReplicaIntegrityError
from ckpt_agent.flash.protocol import Descriptor, read_file
from ckpt_agent.flash.replica.incoming import Incoming
from ckpt_agent.flash.replica.layout import DATA, DESC, HASHES, remove, snapshot_folders, subdirs
from ckpt_agent.flash.replica.plan import Chunk, Offer, parse_hashes_doc
from ckpt_agent.format.layout import validate_run_id
from ckpt_agent.records import rank_name

__all__ = ["MAX_FOLDERS", "ReplicaStore", "StoredReplica"]

#: Snapshot folders per (source, rank), at most: the complete replica and the incoming one.
MAX_FOLDERS: Final = 2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredReplica:
    """A complete replica in the store (not yet verified: :mod:`.fetch` verifies)."""

    source: str
    rank: int
    path: Path
    desc: Descriptor
    chunk_bytes: int
    hashes: dict[str, list[str]]
    fast: dict[str, list[str]] | None = None
    """The fast checksum of every chunk, recorded on arrival (None: stored without)."""

    @property
    def data_path(self) -> Path:
        return self.path / DATA

    def offer(self) -> Offer:
        return Offer(self.source, self.desc, self.hashes, self.chunk_bytes)

    @contextlib.contextmanager
    def mapped(self) -> Iterator[memoryview]:
        """The replica's bytes (``desc.data_size``), mapped read-only: no copy. Raises
        FileNotFoundError when it was just replaced, :class:`ReplicaIntegrityError` when the
        file is shorter than the snapshot. The mapping is released on exit; do not keep
        views of it."""
        size = self.desc.data_size
        fd = os.open(self.data_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < size:
                raise ReplicaIntegrityError(
                    f"the replica of {self.source} rank {self.rank} (step {self.desc.step}) is "
                    "corrupted at rest: truncated; unusable, use another source"
                )
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
        finally:
            os.close(fd)
        view = memoryview(mm) if mm is not None else memoryview(b"")
        try:
            yield view
        finally:
            view.release()
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view of it is still referenced: unmapped when freed
                    log.warning(
                        "the replica of %s rank %d is still referenced", self.source, self.rank
                    )

    def intact(self, chunk: Chunk, data: bytes | bytearray | memoryview) -> bool:
        """``data``, read from this replica's file, is still ``chunk`` as it arrived: its
        fast checksum recorded then (a bit flipped at rest), else its SHA-256."""
        if self.fast is None:
            return chunk.ok(data)
        return chunk.fast_ok(data, self.fast[chunk.name][chunk.part])


class ReplicaStore:
    """Peers' replicas of one run on this node (see the module doc)."""

    def __init__(
        self, shm_dir: str | Path, run_id: str, *, max_snapshot_bytes: int | None = None
    ) -> None:
        self.run_id = validate_run_id(run_id)
        self.root = Path(shm_dir) / self.run_id / "replicas"
        self.max_snapshot_bytes = max_snapshot_bytes
        self._busy: set[tuple[str, int]] = set()
        self._guard = threading.Lock()

    def rank_dir(self, source: str, rank: int) -> Path:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ReplicaError(f"invalid replica rank {rank!r}")
        return self.root / validate_run_id(source) / rank_name(rank)

    # ------------------------------------------------------------------ reading

    def current(self, source: str, rank: int) -> StoredReplica | None:
        """The complete replica of (source, rank), newest published first; None if none."""
        for path in reversed(snapshot_folders(self.rank_dir(source, rank), complete=True)):
            with contextlib.suppress(CheckpointFormatError, FileNotFoundError):
                return self._load(source, rank, path)
        return None

    def replicas(self) -> list[StoredReplica]:
        """Every complete replica held, by source and rank."""
        out: list[StoredReplica] = []
        for src in subdirs(self.root):
            try:
                validate_run_id(src.name)
            except ValueError:
                continue
            for rd in subdirs(src):
                if rd.name.startswith("rank_") and rd.name[5:].isdigit():
                    found = self.current(src.name, int(rd.name[5:]))
                    if found is not None:
                        out.append(found)
        return out

    def folders(self, source: str, rank: int) -> list[Path]:
        """Every snapshot folder of (source, rank), complete or not (:data:`MAX_FOLDERS`)."""
        return snapshot_folders(self.rank_dir(source, rank), complete=False)

    def _load(self, source: str, rank: int, path: Path) -> StoredReplica:
        raw = read_file(path / DESC)
        hashes_raw = read_file(path / HASHES)
        if raw is None or hashes_raw is None:
            raise FileNotFoundError(path)
        desc = Descriptor.from_bytes(raw, f"replica {path}")
        h = parse_hashes_doc(hashes_raw, f"replica {path}")
        if desc.run_id != self.run_id or desc.rank != rank:
            raise CheckpointFormatError(f"replica {path}: of run {desc.run_id} rank {desc.rank}")
        return StoredReplica(source, rank, path, desc, h.chunk_bytes, h.sha256, h.fast)

    # ------------------------------------------------------------------ receiving

    def begin(self, offer: Offer) -> Incoming:
        """Start receiving ``offer``: a new folder, the chunks this node already holds copied
        into it (checked). Raises :class:`ReplicaError` when the offer does not fit (another
        run, too large, a push of the same (source, rank) in flight)."""
        desc = offer.desc
        if desc.run_id != self.run_id:
            raise ReplicaError(
                f"replica offer of run {desc.run_id!r}: this store holds run {self.run_id!r}"
            )
        if not 0 <= desc.rank < max(1, desc.world_size):
            raise ReplicaError(f"replica offer: rank {desc.rank} of {desc.world_size}")
        if self.max_snapshot_bytes is not None and desc.data_size > self.max_snapshot_bytes:
            raise ReplicaError(
                f"replica offer of {desc.data_size} bytes exceeds this node's "
                f"{self.max_snapshot_bytes}-byte replica bound; raise it or give the peer less"
            )
        chunks = offer.chunks()
        key = (offer.source, desc.rank)
        rank_dir = self.rank_dir(*key)
        with self._guard:
            if key in self._busy:
                raise ReplicaError(
                    f"a replica of {offer.source} rank {desc.rank} is already being received; "
                    "one push per peer-rank at a time"
                )
            self._busy.add(key)

        def release() -> None:
            with self._guard:
                self._busy.discard(key)

        try:
            current = self._sweep(offer.source, desc.rank, rank_dir)
            if (
                current is not None
                and current.desc == desc
                and current.hashes == offer.hashes
                and current.chunk_bytes == offer.chunk_bytes
            ):
                return Incoming(None, offer, chunks, already=current.path, on_done=release)
            folder = rank_dir / f"seq_{desc.seq:012d}.{secrets.token_hex(4)}"
            folder.mkdir(parents=True)
            incoming = Incoming(folder, offer, chunks, on_done=release)
        except BaseException:
            release()
            raise
        try:
            if current is not None:
                incoming.copy_from(current, _chunks_of(current))
        except BaseException:
            incoming.abort()
            raise
        return incoming

    def _sweep(self, source: str, rank: int, rank_dir: Path) -> StoredReplica | None:
        """Remove incomplete folders and all but the newest complete one; return that one."""
        for p in snapshot_folders(rank_dir, complete=False):
            if not (p / DESC).exists():
                remove(p)
        complete = snapshot_folders(rank_dir, complete=True)
        for p in complete[:-1]:
            remove(p)
        if not complete:
            return None
        try:
            return self._load(source, rank, complete[-1])
        except (CheckpointFormatError, FileNotFoundError):
            remove(complete[-1])  # unreadable: useless, and it would break the bound
            return None


def _chunks_of(replica: StoredReplica) -> list[Chunk]:
    try:
        return replica.offer().chunks()
    except ReplicaError:
        return []
