"""Flash checkpoints: snapshots in shared memory that survive the training process.

The trainer copies its state into a memory-backed directory (``/dev/shm`` or
the ``emptyDir`` with ``medium: Memory`` the operator injects as
``CKPT_SHM_DIR``) and returns; a separate process (the sidecar container, or
a local subprocess) persists each complete snapshot (:mod:`ckpt_agent.flash.sidecar`).
When the trainer dies — SIGKILL, OOM — the snapshot is still there, and the
persister writes it.

Layout (one *area* per rank)::

    <shm_dir>/<run_id>/
        health.json                      sidecar → trainer: system signals (latency, GPU errors)
        rank_<00000>/
            trainer.lock                 flock(EX) held by the live trainer for its whole life
            persister.lock               flock(EX) held by the live persister of this area
            slot_<i>.data                64-byte header + tensor bytes (mmap'ed by both sides)
            slot_<i>.json                descriptor: exists ⇔ slot i holds a complete snapshot
            slot_<i>.hashes.json         persister: raw SHA-256 per chunk, for in-place restarts
            persisted.json               persister → trainer: the newest snapshot it handled

**Never a half-written snapshot.** Slot *i* is written only under an
exclusive ``flock`` on ``slot_<i>.data``: the trainer deletes the descriptor
(the commit marker) first, writes the sequence number into the header
(``seq_begin``), copies the tensors, writes ``seq_end``, and publishes the
new descriptor (write + rename) last. A reader takes a shared ``flock`` on
the slot, then reads the descriptor and checks ``seq_begin == seq_end ==
descriptor.seq`` before and after reading. A trainer killed mid-copy leaves a
slot without descriptor (and the kernel drops its lock), which no reader
ever takes; the previous complete snapshot is in another slot.

**Never losing the newest complete snapshot.** The trainer never overwrites
the newest complete snapshot that the persister has not handled yet, nor a
slot the persister is reading. With two slots the trainer can snapshot while
the previous snapshot is persisted; when no slot is free the save is
deferred (or waited for), exactly like the in-process persister's
back-pressure.

Everything here except :class:`ShmWriter` (which copies torch tensors) is
torch-free: the sidecar never imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ckpt_agent.errors import ShmError
from ckpt_agent.format.manifest import DTYPE_ITEMSIZE, CheckpointFormatError, validate_run_id
from ckpt_agent.records import Tier, rank_name

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ckpt_agent.runtime.serialization import LiveArray

__all__ = [
    "HEADER_BYTES",
    "Descriptor",
    "PersistedMark",
    "ShmArea",
    "ShmError",
    "ShmReader",
    "ShmSnapshot",
    "ShmTensor",
    "ShmWriter",
    "chunk_hashes",
    "read_health",
    "write_health",
]

Json = Any

FORMAT_DESCRIPTOR: Final = "ckpt-operator.shm-snapshot"
FORMAT_PERSISTED: Final = "ckpt-operator.shm-persisted"
FORMAT_HASHES: Final = "ckpt-operator.shm-hashes"
FORMAT_HEALTH: Final = "ckpt-operator.shm-health"
VERSION: Final = 1
MAGIC: Final = b"CKPTSHM1"
#: Header at the start of every slot file: magic, seq_begin, seq_end, data_size.
_HEADER = struct.Struct("<8sQQQ")
#: Tensor data starts here (page aligned).
HEADER_BYTES: Final = 4096
ALIGN: Final = 64
DEFAULT_SLOTS: Final = 2
#: Chunk size of the hashes a persister records (the writer's blob chunk size).
HASH_CHUNK_BYTES: Final = 16 * 1024 * 1024


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ShmTensor:
    """Where one tensor (or file) lies in a slot."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> Json:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, d: Json, what: str) -> ShmTensor:
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{what}: not an object")
        dtype = d.get("dtype")
        shape = d.get("shape")
        if dtype not in DTYPE_ITEMSIZE or not isinstance(shape, list):
            raise CheckpointFormatError(f"{what}: bad dtype/shape")
        n = 1
        for s in shape:
            if not isinstance(s, int) or s < 0:
                raise CheckpointFormatError(f"{what}: bad shape")
            n *= s
        nbytes, offset = d.get("nbytes"), d.get("offset")
        if not isinstance(nbytes, int) or not isinstance(offset, int) or offset < HEADER_BYTES:
            raise CheckpointFormatError(f"{what}: bad offset/size")
        if n * DTYPE_ITEMSIZE[str(dtype)] != nbytes:
            raise CheckpointFormatError(f"{what}: nbytes does not match the shape")
        return cls(str(dtype), tuple(shape), offset, nbytes)


@dataclass(frozen=True)
class Descriptor:
    """A complete snapshot in a slot (the commit marker's content)."""

    run_id: str
    rank: int
    world_size: int
    seq: int
    slot: int
    step: int
    tier: Tier
    data_size: int
    tree: dict[str, Json]
    """Section name → tagged-JSON tree (tensors by reference to :attr:`tensors`)."""
    tensors: dict[str, ShmTensor]
    files: dict[str, ShmTensor] = field(default_factory=dict)
    meta: dict[str, Json] = field(default_factory=dict)
    """What the COMMIT will say: score, components, reason, anomaly, lightweight,
    approximate, emergency, prev_hash, versions, token (same on every rank)."""
    created_at: float = 0.0
    stall_s: float = 0.0
    pid: int = 0

    @property
    def checkpoint_id(self) -> str:
        from ckpt_agent.records import checkpoint_id

        return checkpoint_id(self.tier, self.step)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT_DESCRIPTOR,
                "version": VERSION,
                "run_id": self.run_id,
                "rank": self.rank,
                "world_size": self.world_size,
                "seq": self.seq,
                "slot": self.slot,
                "step": self.step,
                "tier": self.tier.value,
                "data_size": self.data_size,
                "tree": self.tree,
                "tensors": {k: v.to_json() for k, v in self.tensors.items()},
                "files": {k: v.to_json() for k, v in self.files.items()},
                "meta": self.meta,
                "created_at": self.created_at,
                "stall_s": self.stall_s,
                "pid": self.pid,
            },
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "shm descriptor") -> Descriptor:
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointFormatError(f"{what}: not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_DESCRIPTOR:
            raise CheckpointFormatError(f"{what}: not a snapshot descriptor")
        if d.get("version") != VERSION:
            raise CheckpointFormatError(f"{what}: unsupported version {d.get('version')!r}")
        try:
            tensors = {
                str(k): ShmTensor.from_json(v, f"{what}: {k}") for k, v in d["tensors"].items()
            }
            files = {str(k): ShmTensor.from_json(v, f"{what}: {k}") for k, v in d["files"].items()}
            out = cls(
                run_id=str(d["run_id"]),
                rank=int(d["rank"]),
                world_size=int(d["world_size"]),
                seq=int(d["seq"]),
                slot=int(d["slot"]),
                step=int(d["step"]),
                tier=Tier(d["tier"]),
                data_size=int(d["data_size"]),
                tree=dict(d["tree"]),
                tensors=tensors,
                files=files,
                meta=dict(d.get("meta") or {}),
                created_at=float(d.get("created_at") or 0.0),
                stall_s=float(d.get("stall_s") or 0.0),
                pid=int(d.get("pid") or 0),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFormatError(f"{what}: malformed ({e})") from None
        for name, t in (*out.tensors.items(), *out.files.items()):
            if t.offset + t.nbytes > out.data_size:
                raise CheckpointFormatError(f"{what}: {name} lies outside the slot")
        return out


@dataclass(frozen=True)
class PersistedMark:
    """The newest snapshot a persister handled (``ok`` or not)."""

    seq: int
    step: int
    checkpoint_id: str
    ok: bool
    error: str = ""
    manifest_hash: str | None = None
    """The COMMIT's hash (the coordinator's area; None when this area only wrote a part)."""
    committed: bool = False
    persist_s: float = 0.0
    size_bytes: int = 0
    time: float = 0.0

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT_PERSISTED,
                "version": VERSION,
                "seq": self.seq,
                "step": self.step,
                "checkpoint_id": self.checkpoint_id,
                "ok": self.ok,
                "error": self.error,
                "manifest_hash": self.manifest_hash,
                "committed": self.committed,
                "persist_s": self.persist_s,
                "size_bytes": self.size_bytes,
                "time": self.time,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PersistedMark:
        d = json.loads(data)
        if not isinstance(d, dict) or d.get("format") != FORMAT_PERSISTED:
            raise CheckpointFormatError("persisted.json: wrong format")
        mh = d.get("manifest_hash")
        return cls(
            seq=int(d["seq"]),
            step=int(d["step"]),
            checkpoint_id=str(d["checkpoint_id"]),
            ok=bool(d["ok"]),
            error=str(d.get("error") or ""),
            manifest_hash=str(mh) if mh else None,
            committed=bool(d.get("committed")),
            persist_s=float(d.get("persist_s") or 0.0),
            size_bytes=int(d.get("size_bytes") or 0),
            time=float(d.get("time") or 0.0),
        )


# --------------------------------------------------------------------------- helpers


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def chunk_hashes(data: memoryview, chunk: int = HASH_CHUNK_BYTES) -> list[str]:
    """SHA-256 of each ``chunk``-byte piece (the writer's blob chunking; one hash if empty)."""
    if len(data) == 0:
        return [hashlib.sha256(b"").hexdigest()]
    return [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]


def write_health(root: str | Path, run_id: str, signals: Mapping[str, Json]) -> None:
    """Publish the sidecar's system signals for the trainer (atomic replace)."""
    d = Path(root) / validate_run_id(run_id)
    d.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT_HEALTH, "version": VERSION, "time": time.time(), **signals}
    _atomic_write(d / "health.json", json.dumps(doc, sort_keys=True, allow_nan=False).encode())


def read_health(root: str | Path, run_id: str) -> dict[str, Json] | None:
    raw = _read(Path(root) / validate_run_id(run_id) / "health.json")
    if raw is None:
        return None
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    return d if isinstance(d, dict) and d.get("format") == FORMAT_HEALTH else None


# --------------------------------------------------------------------------- area


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

    def descriptor(self, slot: int) -> Descriptor | None:
        raw = _read(self.desc_path(slot))
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

    def _slot_ids(self) -> list[int]:
        ids = set(range(self.slots))
        with contextlib.suppress(FileNotFoundError):
            for p in self.dir.iterdir():
                n = p.name
                if n.startswith("slot_") and n.endswith(".data") and n[5:-5].isdigit():
                    ids.add(int(n[5:-5]))
        return sorted(ids)

    def persisted(self) -> PersistedMark | None:
        raw = _read(self.persisted_path)
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
            if _try_flock(fd, fcntl.LOCK_SH):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return False
            return True
        finally:
            os.close(fd)

    def trainer_alive(self) -> bool:
        return self._lock_alive("trainer.lock")

    def persister_alive(self) -> bool:
        return self._lock_alive("persister.lock")

    def hashes(self, slot: int, seq: int) -> dict[str, list[str]] | None:
        """The persister's per-chunk raw hashes of slot ``slot`` when they are for ``seq``."""
        raw = _read(self.hashes_path(slot))
        if raw is None:
            return None
        try:
            d = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(d, dict) or d.get("format") != FORMAT_HASHES or d.get("seq") != seq:
            return None
        if d.get("chunk_bytes") != HASH_CHUNK_BYTES:
            return None
        t = d.get("tensors")
        return {str(k): [str(h) for h in v] for k, v in t.items()} if isinstance(t, dict) else None


def _hold(path: Path) -> int:
    """Open (create) ``path`` and take its exclusive lock, non-blocking; -1 when held elsewhere."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    if _try_flock(fd, fcntl.LOCK_EX):
        return fd
    os.close(fd)
    return -1


# --------------------------------------------------------------------------- reader


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
        self._owner_fd = _hold(self.dir / "persister.lock")
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
            if not _try_flock(fd, fcntl.LOCK_SH):
                yield None  # the trainer is writing this slot right now
                return
            now = self.descriptor(desc.slot)
            size = os.fstat(fd).st_size
            if now is None or now.seq != desc.seq or size < desc.data_size:
                yield None
                return
            mm = mmap.mmap(fd, desc.data_size, mmap.MAP_SHARED, mmap.PROT_READ)
            view = memoryview(mm)
            try:
                if _header(view) != (desc.seq, desc.seq, desc.data_size):
                    yield None
                    return
                yield ShmSnapshot(desc, view)
                if _header(view) != (desc.seq, desc.seq, desc.data_size):  # pragma: no cover
                    raise ShmError(f"slot {desc.slot} changed while it was read (lock bypassed?)")
            finally:
                view.release()
                mm.close()
        finally:
            os.close(fd)  # drops the shared lock

    def mark(self, mark: PersistedMark) -> None:
        """Tell the trainer which snapshot was handled (atomic replace)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.persisted_path, mark.to_bytes())

    def write_hashes(self, desc: Descriptor, tensors: Mapping[str, Sequence[str]]) -> None:
        doc = {
            "format": FORMAT_HASHES,
            "version": VERSION,
            "seq": desc.seq,
            "step": desc.step,
            "chunk_bytes": HASH_CHUNK_BYTES,
            "tensors": {k: list(v) for k, v in tensors.items()},
        }
        _atomic_write(self.hashes_path(desc.slot), json.dumps(doc, sort_keys=True).encode())


def _header(view: memoryview) -> tuple[int, int, int] | None:
    if len(view) < _HEADER.size:
        return None
    magic, a, b, size = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        return None
    return int(a), int(b), int(size)


# --------------------------------------------------------------------------- writer (trainer)


@dataclass
class _Slot:
    fd: int
    mm: mmap.mmap | None = None
    size: int = 0


class ShmWriter(ShmArea):
    """The trainer's side: copy a snapshot into a free slot and publish it.

    Holds ``trainer.lock`` for its whole life (the persister learns that the
    trainer died when the lock is free).
    """

    def __init__(
        self,
        root: str | Path,
        run_id: str,
        rank: int,
        *,
        world_size: int = 1,
        slots: int = DEFAULT_SLOTS,
    ) -> None:
        super().__init__(root, run_id, rank, slots=slots)
        self.world_size = world_size
        self.dir.mkdir(parents=True, exist_ok=True)
        self._trainer_fd = _hold(self.dir / "trainer.lock")
        if self._trainer_fd < 0:
            raise ShmError(
                f"another live process holds {self.dir / 'trainer.lock'}: two trainers of run "
                f"{run_id!r} rank {rank} on one node?"
            )
        self._slots: dict[int, _Slot] = {}
        last = max((d.seq for d in self.complete()), default=0)
        mark = self.persisted()
        self._seq = max(last, mark.seq if mark is not None else 0)
        self.writes = 0

    # ------------------------------------------------------------------ slots

    def _slot(self, i: int) -> _Slot:
        s = self._slots.get(i)
        if s is None:
            fd = os.open(self.data_path(i), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            s = _Slot(fd=fd, size=os.fstat(fd).st_size)
            self._slots[i] = s
        return s

    def _protected(self) -> int | None:
        """The slot holding the newest complete snapshot nobody persisted yet."""
        newest = self.latest()
        if newest is None:
            return None
        mark = self.persisted()
        if mark is not None and mark.seq >= newest.seq:
            return None
        return newest.slot

    def _order(self) -> list[int]:
        """Slots to try: empty ones first, then the oldest complete one."""
        seqs = {d.slot: d.seq for d in self.complete()}
        return sorted(range(self.slots), key=lambda i: (i in seqs, seqs.get(i, -1)))

    def free_slot(self) -> int | None:
        """A slot a snapshot could be written to now (None: busy, the save must wait)."""
        protect = self._protected()
        for i in self._order():
            if i == protect:
                continue
            s = self._slot(i)
            if _try_flock(s.fd, fcntl.LOCK_EX):
                fcntl.flock(s.fd, fcntl.LOCK_UN)
                return i
        return None

    @property
    def busy(self) -> bool:
        return self.free_slot() is None

    def _acquire(self) -> int | None:
        protect = self._protected()
        for i in self._order():
            if i == protect:
                continue
            if _try_flock(self._slot(i).fd, fcntl.LOCK_EX):
                return i
        return None

    def _map(self, s: _Slot, size: int) -> mmap.mmap:
        if s.mm is not None and s.size >= size:
            return s.mm
        if s.mm is not None:
            s.mm.close()
            s.mm = None
        size = max(size, s.size)
        if s.size < size:
            os.ftruncate(s.fd, size)
            with contextlib.suppress(OSError):  # tmpfs: allocate the pages now, not mid-copy
                os.posix_fallocate(s.fd, 0, size)
            s.size = size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        s.mm = mmap.mmap(s.fd, s.size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        return s.mm

    def prepare(self, sections: Mapping[str, object], *, files_bytes: int = 0) -> int:
        """Size and map every slot for a state like ``sections`` (outside the training loop),
        so that the first snapshot stalls no more than the others; returns the slot size."""
        from ckpt_agent.runtime.serialization import flatten

        live: dict[str, LiveArray] = {}
        for name, value in sections.items():
            flatten(value, name, live)
        size = HEADER_BYTES
        for a in live.values():
            size = _align(size + _nbytes(a.value))
        size = _align(size + files_bytes)
        import numpy as np

        for i in range(self.slots):
            s = self._slot(i)
            if _try_flock(s.fd, fcntl.LOCK_EX):
                try:
                    mm = self._map(s, size)
                    # MAP_POPULATE maps shared pages read-only: the first write to each page
                    # would still fault. Rewrite one byte per page (same value) now, so the
                    # first snapshot's copy runs at memory speed like the later ones.
                    pages = np.frombuffer(mm, dtype=np.uint8)
                    pages[:: mmap.PAGESIZE] = pages[:: mmap.PAGESIZE].copy()
                    del pages
                finally:
                    fcntl.flock(s.fd, fcntl.LOCK_UN)
        return size

    # ------------------------------------------------------------------ writing

    def write(
        self,
        step: int,
        tier: Tier,
        sections: Mapping[str, object],
        *,
        files: Mapping[str, bytes] | None = None,
        meta: Mapping[str, Json] | None = None,
        reserve: int = 0,
    ) -> Descriptor | None:
        """Copy ``sections`` into a free slot and publish it; None when no slot is free.

        ``reserve``: extra bytes to allocate (so a growing state does not
        reallocate at every save).
        """
        import torch

        from ckpt_agent.runtime.serialization import flatten

        t0 = time.perf_counter()
        live: dict[str, LiveArray] = {}
        tree: dict[str, Json] = {}
        for name, value in sections.items():
            tree[name] = flatten(value, name, live)
        layout: dict[str, ShmTensor] = {}
        off = HEADER_BYTES
        for a in live.values():
            nbytes = _nbytes(a.value)
            layout[a.name] = ShmTensor(a.dtype, a.shape, off, nbytes)
            off = _align(off + nbytes)
        flayout: dict[str, ShmTensor] = {}
        for fname, payload in (files or {}).items():
            flayout[fname] = ShmTensor("uint8", (len(payload),), off, len(payload))
            off = _align(off + len(payload))
        size = off
        slot = self._acquire()
        if slot is None:
            return None
        s = self._slots[slot]
        try:
            self.desc_path(slot).unlink(missing_ok=True)  # unpublish first: the slot is torn now
            self.hashes_path(slot).unlink(missing_ok=True)
            mm = self._map(s, size + reserve)
            seq = self._seq + 1
            _HEADER.pack_into(mm, 0, MAGIC, seq, 0, size)
            cuda = False
            for a in live.values():
                t = layout[a.name]
                cuda = self._copy(mm, t, a.value) or cuda
            if cuda:
                torch.cuda.synchronize()
            for fname, payload in (files or {}).items():
                t = flayout[fname]
                mm[t.offset : t.offset + t.nbytes] = payload
            _HEADER.pack_into(mm, 0, MAGIC, seq, seq, size)
            stall = time.perf_counter() - t0
            desc = Descriptor(
                run_id=self.run_id,
                rank=self.rank,
                world_size=self.world_size,
                seq=seq,
                slot=slot,
                step=step,
                tier=Tier(tier),
                data_size=size,
                tree=tree,
                tensors=layout,
                files=flayout,
                meta=dict(meta or {}),
                created_at=time.time(),
                stall_s=stall,
                pid=os.getpid(),
            )
            _atomic_write(self.desc_path(slot), desc.to_bytes())  # the commit marker, last
            self._seq = seq
            self.writes += 1
            return desc
        finally:
            fcntl.flock(s.fd, fcntl.LOCK_UN)

    @staticmethod
    def _copy(mm: mmap.mmap, t: ShmTensor, value: torch.Tensor | np.ndarray) -> bool:
        import numpy as np
        import torch

        if t.nbytes == 0:
            return False
        if isinstance(value, np.ndarray):
            dst_np = np.frombuffer(mm, dtype=value.dtype, count=value.size, offset=t.offset)
            np.copyto(dst_np.reshape(value.shape), value)
            del dst_np
            return False
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
        dst = raw.view(value.dtype).view(value.shape)
        src = value.detach()
        cuda = src.device.type == "cuda"
        dst.copy_(src, non_blocking=cuda)
        del raw, dst
        return cuda

    def wait_persisted(self, seq: int, timeout: float | None = None) -> PersistedMark | None:
        """Wait until the persister handled snapshot ``seq`` (or a newer one); None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while True:
            mark = self.persisted()
            if mark is not None and mark.seq >= seq:
                return mark
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def close(self) -> None:
        for s in self._slots.values():
            if s.mm is not None:
                with contextlib.suppress(BufferError):
                    s.mm.close()
            os.close(s.fd)
        self._slots.clear()
        if self._trainer_fd >= 0:
            os.close(self._trainer_fd)
            self._trainer_fd = -1


def _nbytes(v: torch.Tensor | np.ndarray) -> int:
    import numpy as np

    if isinstance(v, np.ndarray):
        return int(v.nbytes)
    return int(v.numel() * v.element_size())


# --------------------------------------------------------------------------- in-place restart


def verify_snapshot(
    snap: ShmSnapshot, expected: Mapping[str, Sequence[str]], chunk: int = HASH_CHUNK_BYTES
) -> list[str]:
    """Problems found comparing a snapshot's bytes with recorded chunk hashes (empty: intact)."""
    problems: list[str] = []
    names = set(snap.desc.tensors) | set(snap.desc.files)
    for name in sorted(names - set(expected)):
        problems.append(f"{name}: no recorded hash")
    for name in sorted(set(expected) & names):
        view = snap.tensor(name) if name in snap.desc.tensors else snap.file(name)
        if chunk_hashes(view, chunk) != list(expected[name]):
            problems.append(f"{name}: bytes differ from the recorded hash")
    return problems
