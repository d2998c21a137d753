"""The persister's side of the shared-memory protocol (:mod:`ckpt_agent.flash.protocol`).

:class:`ShmReader` claims a rank's area, opens complete snapshots under a shared
lock (never a half-written one), reports what it handled (``persisted.json``) and
records chunk hashes for in-place restarts; :func:`verify_snapshot` checks a
snapshot's bytes (or a copy of them) against them. Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckpt_agent.errors import ShmError
from ckpt_agent.flash.area import ShmArea, hold_lock, read_header
from ckpt_agent.flash.checksums import (
    FAST_SCHEME,
    HASH_CHUNK_BYTES,
    RecordedHashes,
    chunk_hashes,
    fast_checksums,
)
from ckpt_agent.flash.protocol import (
    DEFAULT_SLOTS,
    FORMAT_HASHES,
    VERSION,
    Descriptor,
    PersistedMark,
    atomic_write,
    try_flock,
)

log = logging.getLogger(__name__)

__all__ = ["ShmReader", "ShmSnapshot", "verify_snapshot", "verify_views"]


@dataclass
class ShmSnapshot:
    """A complete snapshot held open (shared lock) for reading."""

    desc: Descriptor
    view: memoryview

    def tensor(self, name: str) -> memoryview:
        t = self.desc.tensors[name]
        return self.view[t.offset : t.offset + t.nbytes]

    def file(self, name: str) -> memoryview:
        t = self.desc.files[name]
        return self.view[t.offset : t.offset + t.nbytes]


class ShmReader(ShmArea):
    """The persister's side: open complete snapshots, report progress."""

    def __init__(
        self, root: str | Path, run_id: str, rank: int, *, slots: int = DEFAULT_SLOTS
    ) -> None:
        super().__init__(root, run_id, rank, slots=slots)
        self._owner_fd = -1

    def claim(self) -> bool:
        """Become this area's persister (exclusive); False when another one is alive."""
        if self._owner_fd >= 0:
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        # no grace: an area another persister holds is tried again at the next pass
        self._owner_fd = hold_lock(self.dir / "persister.lock", probe_grace_s=0.0)
        return self._owner_fd >= 0

    def release(self) -> None:
        if self._owner_fd >= 0:
            os.close(self._owner_fd)
            self._owner_fd = -1

    @contextlib.contextmanager
    def open(self, desc: Descriptor) -> Iterator[ShmSnapshot | None]:
        """Hold ``desc``'s slot (shared lock) and map it; yields None when it is gone or torn.

        A snapshot is yielded only when its descriptor is unchanged under the
        lock and the header says ``seq_begin == seq_end == desc.seq``.
        """
        path = self.data_path(desc.slot)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            yield None
            return
        try:
            if not try_flock(fd, fcntl.LOCK_SH):
                yield None  # the trainer is writing this slot right now
                return
            now = self.descriptor(desc.slot)
            size = os.fstat(fd).st_size
            if now is None or now.seq != desc.seq or size < desc.data_size:
                yield None
                return
            populate = getattr(mmap, "MAP_POPULATE", 0)  # the reader reads it all: map it now
            mm = mmap.mmap(fd, desc.data_size, mmap.MAP_SHARED | populate, mmap.PROT_READ)
            view = memoryview(mm)
            try:
                if read_header(view) != (desc.seq, desc.seq, desc.data_size):
                    yield None
                    return
                yield ShmSnapshot(desc, view)
                if read_header(view) != (desc.seq, desc.seq, desc.data_size):  # pragma: no cover
                    raise ShmError(f"slot {desc.slot} changed while it was read (lock bypassed?)")
            finally:
                # The mapping holds a dup of ``fd`` and with it the shared lock: it must
                # close, or the trainer finds this slot busy. A slice still referenced
                # (a storage client's request body in a reference cycle, a traceback)
                # keeps it open: collect cycles once, then give up loudly.
                if not _unmap(view, mm):
                    gc.collect()
                    if not _unmap(view, mm):
                        log.warning(
                            "slot %d: a view of the snapshot is still referenced; the slot "
                            "stays locked until it is freed",
                            desc.slot,
                        )
        finally:
            os.close(fd)  # drops the shared lock

    def mark(self, mark: PersistedMark) -> None:
        """Tell the trainer which snapshot was handled (atomic replace; the marks before it
        stay in its history)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        prev = self.persisted()
        mark = mark if prev is None else prev.followed_by(mark)
        atomic_write(self.persisted_path, mark.to_bytes())

    def write_hashes(
        self,
        desc: Descriptor,
        tensors: Mapping[str, Sequence[str]],
        fast: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Record the chunk SHA-256s (and fast checksums) of a snapshot for in-place restarts."""
        doc: dict[str, object] = {
            "format": FORMAT_HASHES,
            "version": VERSION,
            "seq": desc.seq,
            "step": desc.step,
            "chunk_bytes": HASH_CHUNK_BYTES,
            "tensors": {k: list(v) for k, v in tensors.items()},
        }
        if fast is not None:
            doc["fast"] = {"scheme": FAST_SCHEME, "tensors": {k: list(v) for k, v in fast.items()}}
        atomic_write(self.hashes_path(desc.slot), json.dumps(doc, sort_keys=True).encode())


def _unmap(view: memoryview, mm: mmap.mmap) -> bool:
    """Release ``view`` and close ``mm``; False while a slice of it is still referenced."""
    try:
        view.release()
        mm.close()
    except BufferError:
        return False
    return True


def verify_views(
    views: Mapping[str, memoryview], expected: RecordedHashes, chunk: int = HASH_CHUNK_BYTES
) -> list[str]:
    """Problems found comparing bytes (name → view) with recorded hashes (empty: intact).

    The fast checksums are compared where the persister recorded them, else the SHA-256s
    (the threat model is in :mod:`ckpt_agent.flash.protocol`).
    """
    table = expected.fast if expected.fast is not None else expected.sha256
    digest = fast_checksums if expected.fast is not None else chunk_hashes
    problems: list[str] = []
    for name in sorted(set(views) - set(table)):
        problems.append(f"{name}: no recorded hash")
    for name in sorted(set(table) & set(views)):
        if digest(views[name], chunk) != list(table[name]):
            problems.append(f"{name}: bytes differ from the recorded hash")
    return problems


def verify_snapshot(
    snap: ShmSnapshot, expected: RecordedHashes, chunk: int = HASH_CHUNK_BYTES
) -> list[str]:
    """Problems found comparing a snapshot's bytes with recorded chunk hashes (empty: intact)."""
    views = {n: snap.tensor(n) for n in snap.desc.tensors}
    views.update({n: snap.file(n) for n in snap.desc.files})
    return verify_views(views, expected, chunk)
