"""The L0 heartbeat ring: one small object per rank, newest entries last.

A heartbeat records where the run was (step, epoch, data position, RNG),
not its weights; the object stays below ``HEARTBEAT_MAX_BYTES`` by dropping
the oldest entries. The RNG states travel as one compact binary record
(:class:`PackedRng`, base64 in the entry's ``rng_bin``): about 10 KB raw and
13.5 KB in the entry, where the same states as tagged JSON (the ``rng`` of
entries written before it, still read) take 20 KB. Torch-free.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_agent.errors import CheckpointFormatError, NotFoundError
from ckpt_agent.format.layout import (
    FORMAT_HEARTBEAT,
    FORMAT_VERSION,
    HEARTBEAT_MAX_BYTES,
    dumps,
    heartbeat_key,
    loads,
)
from ckpt_agent.format.schema import nonneg_field, required_field
from ckpt_agent.records import Json
from ckpt_agent.storage.base import Storage

__all__ = [
    "Heartbeat",
    "PackedRng",
    "assemble_rng",
    "encode_heartbeats",
    "pack_numpy_rng",
    "pack_python_rng",
    "read_heartbeat",
]

_MT_WORDS = 624
_RNG_MAGIC = b"CKR1"
_GENERATOR_MAX_BYTES = 64 * 1024
"""A torch generator state above this is refused (CPU: 5056 bytes, CUDA: 16)."""
_CUDA_MAX = 64


@dataclass(frozen=True)
class PackedRng:
    """Every global RNG state of one process, as the heartbeat stores it (see :meth:`pack`).

    ``python`` is :func:`random.getstate` (version, 625 words, gauss_next); ``numpy`` the
    legacy ``np.random.get_state()`` with the key as 624 little-endian uint32 bytes
    (name, key, pos, has_gauss, cached_gaussian); ``torch_cpu`` and ``cuda`` the raw bytes
    of ``torch.get_rng_state()`` / ``torch.cuda.get_rng_state_all()``.
    """

    python: tuple[int, tuple[int, ...], float | None] | None = None
    numpy: tuple[str, bytes, int, int, float] | None = None
    torch_cpu: bytes | None = None
    cuda: tuple[bytes, ...] = ()

    def pack(self) -> bytes:
        """``CKR1``, then one flag byte per part present (python, numpy, torch, cuda) and
        each part little-endian: python ``<i 625I ? d`` (version, words, has gauss_next,
        gauss_next); numpy ``<B name 624I i i d``; torch ``<I bytes``; cuda ``<H`` and
        ``<I bytes`` per device."""
        return assemble_rng(
            None if self.python is None else pack_python_rng(self.python),
            None if self.numpy is None else pack_numpy_rng(self.numpy),
            self.torch_cpu,
            self.cuda,
        )

    @classmethod
    def unpack(cls, data: bytes, what: str = "rng") -> PackedRng:
        """Inverse of :meth:`pack`; anything malformed is a :class:`CheckpointFormatError`."""
        reader = _Reader(data, what)
        if reader.take(4) != _RNG_MAGIC:
            raise CheckpointFormatError(f"{what}: not a packed RNG record")
        flags = reader.take(1)[0]
        python = numpy = torch_cpu = None
        cuda: list[bytes] = []
        if flags & 1:
            version, *words = reader.unpack(f"<i{_MT_WORDS + 1}I")
            has_gauss, gauss = reader.unpack("<?d")
            python = (
                int(version),
                tuple(int(w) for w in words),
                float(gauss) if has_gauss else None,
            )
        if flags & 2:
            name = reader.take(reader.take(1)[0]).decode("ascii", errors="replace")
            key = reader.take(_MT_WORDS * 4)
            pos, has_gauss_np, cached = reader.unpack("<iid")
            numpy = (name, key, int(pos), int(has_gauss_np), float(cached))
        if flags & 4:
            torch_cpu = reader.blob()
        if flags & 8:
            (count,) = reader.unpack("<H")
            if count > _CUDA_MAX:
                raise CheckpointFormatError(f"{what}: {count} CUDA generator states")
            cuda = [reader.blob() for _ in range(count)]
        if flags >> 4 or reader.left:
            raise CheckpointFormatError(f"{what}: trailing bytes or unknown parts")
        return cls(python=python, numpy=numpy, torch_cpu=torch_cpu, cuda=tuple(cuda))


_PY_STATE = struct.Struct(f"<i{_MT_WORDS + 1}I")


def pack_python_rng(state: tuple[int, tuple[int, ...], float | None]) -> bytes:
    """The python part of :meth:`PackedRng.pack` (:func:`random.getstate`)."""
    version, words, gauss = state
    if len(words) != _MT_WORDS + 1:
        raise ValueError("python RNG state: 625 words expected")
    return _PY_STATE.pack(version, *words) + struct.pack(
        "<?d", gauss is not None, 0.0 if gauss is None else gauss
    )


def pack_numpy_rng(state: tuple[str, bytes, int, int, float]) -> bytes:
    """The numpy part of :meth:`PackedRng.pack` (the key as 624 little-endian words)."""
    name, key, pos, has_gauss, cached = state
    raw_name = name.encode("ascii")
    if len(key) != _MT_WORDS * 4 or len(raw_name) > 255:
        raise ValueError("numpy RNG state: 624 uint32 words expected")
    return b"".join(
        (bytes([len(raw_name)]), raw_name, key, struct.pack("<iid", pos, has_gauss, cached))
    )


def assemble_rng(
    python: bytes | None, numpy: bytes | None, torch_cpu: bytes | None, cuda: Sequence[bytes]
) -> bytes:
    """:meth:`PackedRng.pack` from its parts (the python and numpy ones already packed: a
    caller that knows they did not change re-uses them)."""
    flags = (
        (python is not None)
        | (numpy is not None) << 1
        | (torch_cpu is not None) << 2
        | bool(cuda) << 3
    )
    out = [_RNG_MAGIC, bytes([flags])]
    if python is not None:
        out.append(python)
    if numpy is not None:
        out.append(numpy)
    if torch_cpu is not None:
        out += [struct.pack("<I", len(torch_cpu)), torch_cpu]
    if cuda:
        out.append(struct.pack("<H", len(cuda)))
        for state in cuda:
            out += [struct.pack("<I", len(state)), state]
    return b"".join(out)


class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = memoryview(data), 0, what

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> bytes:
        if n > self.left:
            raise CheckpointFormatError(f"{self.what}: packed RNG record is truncated")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def blob(self) -> bytes:
        (n,) = self.unpack("<I")
        if n > _GENERATOR_MAX_BYTES:
            raise CheckpointFormatError(f"{self.what}: a generator state of {n} bytes")
        return self.take(n)


@dataclass(frozen=True)
class Heartbeat:
    """One L0 heartbeat: where the run was (step, epoch, data position, RNG)."""

    step: int
    time: float
    epoch: int | None = None
    data: Json = None
    """Tagged-JSON data position (:mod:`ckpt_agent.format.jsontree`)."""
    rng: Json = None
    """Tagged-JSON RNG states (entries written before :attr:`rng_packed`; read only)."""
    rng_packed: PackedRng | None = None
    """The RNG states as the heartbeat writer stores them now (``rng_bin``)."""

    def to_json(self) -> dict[str, Json]:
        out: dict[str, Json] = {
            "step": self.step,
            "time": self.time,
            "epoch": self.epoch,
            "data": self.data,
            "rng": self.rng,
        }
        if self.rng_packed is not None:
            out["rng_bin"] = base64.b64encode(self.rng_packed.pack()).decode("ascii")
        return out

    @classmethod
    def from_json(cls, d: Json, what: str) -> Heartbeat:
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{what}: heartbeat entry is not an object")
        epoch = d.get("epoch")
        packed = d.get("rng_bin")
        if packed is not None and not isinstance(packed, str):
            raise CheckpointFormatError(f"{what}: rng_bin must be a base64 string")
        try:
            rng_packed = (
                PackedRng.unpack(base64.b64decode(packed, validate=True), f"{what}.rng_bin")
                if packed is not None
                else None
            )
        except binascii.Error:
            raise CheckpointFormatError(f"{what}: rng_bin is not base64") from None
        return cls(
            step=nonneg_field(d.get("step"), f"{what}.step"),
            time=float(required_field(d, "time", (int, float), what)),
            epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
            data=d.get("data"),
            rng=d.get("rng"),
            rng_packed=rng_packed,
        )


def encode_heartbeats(run_id: str, rank: int, entries: Sequence[Heartbeat]) -> bytes:
    """The heartbeat object (newest last), dropping the oldest entries to stay < 512 KB."""
    items = [e.to_json() for e in entries]
    while True:
        data = dumps(
            {
                "format": FORMAT_HEARTBEAT,
                "version": FORMAT_VERSION,
                "run_id": run_id,
                "rank": rank,
                "entries": items,
            }
        )
        if len(data) < HEARTBEAT_MAX_BYTES or len(items) <= 1:
            if len(data) >= HEARTBEAT_MAX_BYTES:
                raise ValueError(
                    f"one heartbeat is {len(data)} bytes, over the {HEARTBEAT_MAX_BYTES} limit: "
                    "keep the data position small (ids and offsets, not data)"
                )
            return data
        items = items[1:]


def read_heartbeat(storage: Storage, run_id: str, rank: int = 0) -> list[Heartbeat]:
    """The heartbeat ring of one rank, oldest first (empty when there is none)."""
    try:
        raw = storage.read(heartbeat_key(run_id, rank), 0, HEARTBEAT_MAX_BYTES + 1)
    except NotFoundError:
        return []
    d = loads(raw, "heartbeat", HEARTBEAT_MAX_BYTES)
    if d.get("format") != FORMAT_HEARTBEAT:
        raise CheckpointFormatError("heartbeat: wrong format")
    entries = d.get("entries") or []
    if not isinstance(entries, list):
        raise CheckpointFormatError("heartbeat: entries must be a list")
    return [Heartbeat.from_json(e, "heartbeat") for e in entries]
