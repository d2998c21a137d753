"""Flash checkpoints' shared-memory protocol: snapshots that survive the training process.

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
            slot_<i>.hashes.json         persister: raw SHA-256 and a fast checksum per chunk,
                                         for in-place restarts
            persisted.json               persister → trainer: the newest snapshots it handled
            persister-metrics.json       persister → trainer: its metrics, which a trainer
                                         with a local persister serves (:mod:`ckpt_agent.metrics`)

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

**Checking a snapshot before an in-place restart.** The persister records,
per chunk of every tensor, the raw SHA-256 (the chunk's content address in
storage) and a fast checksum (:func:`ckpt_agent.flash.checksums.fast_checksum`:
two position-weighted 64-bit sums over 4 KiB rows, several GB/s with numpy). A restart loading
from memory checks the fast checksums (SHA-256 where none were recorded):
they catch what can happen to a snapshot in the node's memory — a torn or
stale region, a page from another snapshot, a flipped bit (any single-word
change always changes both sums) — but not a forgery, which needs write
access to the pod's memory, i.e. the pod itself. Storage keeps SHA-256.

This module is the protocol (records, layout, locks; torch-free); one rank's area
(paths, slot locks and headers, shared reads) is :mod:`ckpt_agent.flash.area`, the
checksums are :mod:`ckpt_agent.flash.checksums`. The persister's
side is :mod:`ckpt_agent.flash.reader`, the trainer's (which copies torch
tensors) :mod:`ckpt_agent.runtime.shm.writer`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.layout import DTYPE_ITEMSIZE, validate_run_id
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Json, checkpoint_id
from ckpt_agent.tuning import DIRECT_IO_ALIGN, DIRECT_IO_MIN_BYTES

__all__ = [
    "ALIGN",
    "DEFAULT_SLOTS",
    "HEADER",
    "HEADER_BYTES",
    "MAGIC",
    "MARK_HISTORY",
    "Descriptor",
    "PersistedMark",
    "ShmTensor",
    "align",
    "atomic_write",
    "place",
    "read_file",
    "read_health",
    "try_flock",
    "write_health",
]

FORMAT_DESCRIPTOR: Final = "ckpt-operator.shm-snapshot"
FORMAT_PERSISTED: Final = "ckpt-operator.shm-persisted"
FORMAT_HASHES: Final = "ckpt-operator.shm-hashes"
FORMAT_HEALTH: Final = "ckpt-operator.shm-health"
VERSION: Final = 1
MAGIC: Final = b"CKPTSHM1"
#: Header at the start of every slot file: magic, seq_begin, seq_end, data_size.
HEADER = struct.Struct("<8sQQQ")
#: Tensor data starts here (page aligned).
HEADER_BYTES: Final = 4096
ALIGN: Final = 64
DEFAULT_SLOTS: Final = 2
#: How many earlier results ``persisted.json`` carries (:attr:`PersistedMark.earlier`).
MARK_HISTORY: Final = 32


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
        return checkpoint_id(self.tier, self.step)

    @property
    def jit(self) -> bool:
        """A just-in-time save (``jit`` in its metadata): written without the other ranks."""
        return self.meta.get("jit") is True

    @property
    def memory_only(self) -> bool:
        """Never written to storage: a memory-tier snapshot (``memory_only`` in its metadata)
        or a just-in-time save (the dead rank's part is missing: it could never commit). Its
        persister records its hashes and replicates it."""
        return self.meta.get("memory_only") is True or self.jit

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
    """The newest snapshot a persister handled (``ok`` or not), and the ones before it."""

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
    earlier: tuple[PersistedMark, ...] = ()
    """The :data:`MARK_HISTORY` marks before this one, oldest first: a trainer that polls
    after several saves were handled still sees every result (:meth:`after`)."""

    def followed_by(self, mark: PersistedMark) -> PersistedMark:
        """``mark`` with this mark (and its history) as its history."""
        history = [m for m in (*self.earlier, replace(self, earlier=())) if m.seq < mark.seq]
        return replace(mark, earlier=tuple(history[-MARK_HISTORY:]))

    def after(self, seq: int) -> list[PersistedMark]:
        """The marks newer than ``seq`` (this one and its history), oldest first."""
        return [m for m in (*self.earlier, replace(self, earlier=())) if m.seq > seq]

    def _fields(self) -> dict[str, Json]:
        return {
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
        }

    def to_bytes(self) -> bytes:
        earlier: list[Json] = [m._fields() for m in self.earlier]
        return json.dumps(
            {"format": FORMAT_PERSISTED, "version": VERSION, **self._fields(), "earlier": earlier},
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PersistedMark:
        d = json.loads(data)
        if not isinstance(d, dict) or d.get("format") != FORMAT_PERSISTED:
            raise CheckpointFormatError("persisted.json: wrong format")
        earlier = d.get("earlier") or []
        if not isinstance(earlier, list) or not all(isinstance(e, dict) for e in earlier):
            raise CheckpointFormatError("persisted.json: 'earlier' is not a list of marks")
        return replace(cls._from_dict(d), earlier=tuple(cls._from_dict(e) for e in earlier))

    @classmethod
    def _from_dict(cls, d: dict[str, Json]) -> PersistedMark:
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


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def read_file(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def read_doc(path: Path, fmt: str) -> dict[str, Json] | None:
    """The JSON object in ``path`` when its ``format`` is ``fmt`` (None: missing, not
    JSON, or another document)."""
    raw = read_file(path)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    return d if isinstance(d, dict) and d.get("format") == fmt else None


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def place(off: int, nbytes: int) -> int:
    """Where a tensor (or file) of ``nbytes`` starts in a slot, at or after ``off``:
    page-aligned when it is large enough for the persister to write it to storage with
    ``O_DIRECT`` (:class:`ckpt_agent.storage.fs_writer.DirectIO`), else ``ALIGN``-aligned."""
    step = DIRECT_IO_ALIGN if nbytes >= DIRECT_IO_MIN_BYTES else ALIGN
    return (off + step - 1) // step * step


def try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def write_health(root: str | Path, run_id: str, signals: Mapping[str, Json]) -> None:
    """Publish the sidecar's system signals for the trainer (atomic replace)."""
    d = Path(root) / validate_run_id(run_id)
    d.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT_HEALTH, "version": VERSION, "time": time.time(), **signals}
    atomic_write(d / "health.json", json.dumps(doc, sort_keys=True, allow_nan=False).encode())


def read_health(root: str | Path, run_id: str) -> dict[str, Json] | None:
    return read_doc(Path(root) / validate_run_id(run_id) / "health.json", FORMAT_HEALTH)
