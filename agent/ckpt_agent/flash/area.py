"""One rank's shared-memory area: its paths, locks and the shared reads of its files.

:class:`ShmArea` names the files of ``<shm_dir>/<run_id>/rank_<n>/`` (the
layout in :mod:`ckpt_agent.flash.protocol`) and reads the documents both sides
share: descriptors, the persisted mark, the recorded hashes.
:func:`hold_lock` and :func:`read_header` are the slot files' lock and
header. Torch-free; the records themselves are in :mod:`ckpt_agent.flash.protocol`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.flash.checksums import FAST_SCHEME, HASH_CHUNK_BYTES, RecordedHashes
from ckpt_agent.flash.protocol import (
    DEFAULT_SLOTS,
    FORMAT_HASHES,
    HEADER,
    MAGIC,
    Descriptor,
    PersistedMark,
    read_doc,
    read_file,
    try_flock,
)
from ckpt_agent.format.layout import validate_run_id
from ckpt_agent.records import rank_name

__all__ = ["PROBE_GRACE_S", "ShmArea", "hold_lock", "read_header"]

PROBE_GRACE_S = 0.5
"""How long :func:`hold_lock` retries a lock held by someone: longer than any liveness
probe holds it, short for an owner that is really there (its error then comes this late)."""


class ShmArea:
    """Paths and shared reads of one rank's area."""

    def __init__(
        self, root: str | Path, run_id: str, rank: int, *, slots: int = DEFAULT_SLOTS
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.root = Path(root)
        self.run_id = validate_run_id(run_id)
        self.rank = rank
        self.slots = slots
        self.dir = self.root / self.run_id / rank_name(rank)

    @staticmethod
    def ranks(root: str | Path, run_id: str) -> list[int]:
        """Ranks that have an area under ``root`` for ``run_id``."""
        base = Path(root) / validate_run_id(run_id)
        out = []
        with contextlib.suppress(FileNotFoundError):
            for p in base.iterdir():
                name = p.name
                if p.is_dir() and name.startswith("rank_") and name[5:].isdigit():
                    out.append(int(name[5:]))
        return sorted(out)

    def data_path(self, slot: int) -> Path:
        return self.dir / f"slot_{slot}.data"

    def desc_path(self, slot: int) -> Path:
        return self.dir / f"slot_{slot}.json"

    def hashes_path(self, slot: int) -> Path:
        return self.dir / f"slot_{slot}.hashes.json"

    @property
    def persisted_path(self) -> Path:
        return self.dir / "persisted.json"

    @property
    def metrics_path(self) -> Path:
        return self.dir / "persister-metrics.json"

    def descriptor(self, slot: int) -> Descriptor | None:
        raw = read_file(self.desc_path(slot))
        if raw is None:
            return None
        try:
            d = Descriptor.from_bytes(raw, f"{self.desc_path(slot)}")
        except CheckpointFormatError:
            return None
        if d.slot != slot or d.run_id != self.run_id or d.rank != self.rank:
            return None
        return d

    def complete(self) -> list[Descriptor]:
        """Complete snapshots (descriptor present), oldest first."""
        out = []
        for i in self._slot_ids():
            d = self.descriptor(i)
            if d is not None:
                out.append(d)
        return sorted(out, key=lambda d: d.seq)

    def latest(self) -> Descriptor | None:
        c = self.complete()
        return c[-1] if c else None

    def highest_seq(self) -> int:
        """The highest sequence number used in the area: its complete snapshots' and the
        persisted mark's (0: none); the next snapshot takes the one after it."""
        mark = self.persisted()
        return max([*(d.seq for d in self.complete()), mark.seq if mark is not None else 0])

    def write_order(self) -> list[int]:
        """The slots to write the next snapshot into, in order: the empty ones first, then
        the complete ones, oldest first."""
        seqs = {d.slot: d.seq for d in self.complete()}
        return sorted(range(self.slots), key=lambda i: (i in seqs, seqs.get(i, -1)))

    def _slot_ids(self) -> list[int]:
        ids = set(range(self.slots))
        with contextlib.suppress(FileNotFoundError):
            for p in self.dir.iterdir():
                n = p.name
                if n.startswith("slot_") and n.endswith(".data") and n[5:-5].isdigit():
                    ids.add(int(n[5:-5]))
        return sorted(ids)

    def persisted(self) -> PersistedMark | None:
        raw = read_file(self.persisted_path)
        if raw is None:
            return None
        try:
            return PersistedMark.from_bytes(raw)
        except (ValueError, KeyError, TypeError):
            return None

    def _lock_alive(self, name: str) -> bool:
        """Whether some process holds the exclusive lock ``name`` (it is alive)."""
        path = self.dir / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            if try_flock(fd, fcntl.LOCK_SH):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return False
            return True
        finally:
            os.close(fd)

    def trainer_alive(self) -> bool:
        return self._lock_alive("trainer.lock")

    def persister_alive(self) -> bool:
        return self._lock_alive("persister.lock")

    def hashes(self, slot: int, seq: int) -> RecordedHashes | None:
        """The persister's per-chunk hashes of slot ``slot`` when they are for ``seq``."""
        d = read_doc(self.hashes_path(slot), FORMAT_HASHES)
        if d is None or d.get("seq") != seq:
            return None
        if d.get("chunk_bytes") != HASH_CHUNK_BYTES:
            return None
        sha = _hash_lists(d.get("tensors"))
        if sha is None:
            return None
        fast = d.get("fast")
        fast_lists = (
            _hash_lists(fast.get("tensors"))
            if isinstance(fast, dict) and fast.get("scheme") == FAST_SCHEME
            else None
        )
        return RecordedHashes(sha, fast_lists)


def _hash_lists(t: object) -> dict[str, list[str]] | None:
    if not isinstance(t, dict) or not all(isinstance(v, list) for v in t.values()):
        return None
    return {str(k): [str(h) for h in v] for k, v in t.items()}


def hold_lock(path: Path, *, probe_grace_s: float = PROBE_GRACE_S) -> int:
    """Open (create) ``path`` and take its exclusive lock; -1 when held elsewhere.

    The other side's liveness probe (:meth:`ShmArea.trainer_alive`,
    :meth:`ShmArea.persister_alive`) holds a shared lock on the same file for a few
    microseconds: a lock still held after ``probe_grace_s`` of short retries is a live
    owner's, not a probe's."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + probe_grace_s
    while True:
        if try_flock(fd, fcntl.LOCK_EX):
            return fd
        if time.monotonic() >= deadline:
            os.close(fd)
            return -1
        time.sleep(0.005)


def read_header(view: memoryview) -> tuple[int, int, int] | None:
    if len(view) < HEADER.size:
        return None
    magic, a, b, size = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        return None
    return int(a), int(b), int(size)
