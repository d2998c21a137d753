"""Every step's heartbeat in a rank's shared-memory area: what a just-in-time save needs.

A just-in-time (JIT) save restores a rank that died mid-step from the surviving ranks'
copy of the replicated state (docs/replicas.md, "Just-in-time saves"). What only the dead
rank had — its RNG states and data position at the last step it completed — is written
here at every ``Checkpointer.step()`` when ``spec.agent.jitSave`` is on: a memory copy into
``<area>/step_heartbeat.bin`` (no fsync, no system call), which survives the process.

The file is two fixed-size halves written alternately (:data:`HALF_BYTES` each); each half
is ``header | payload``:

* header ``<8s I Q q q I I``: magic ``CKPTSHB1``, format version, sequence number, step,
  resume lineage epoch, payload length, CRC-32 of the header's fields and the payload;
* payload: ``<d`` the wall time, ``<I`` and the :class:`~ckpt_agent.format.heartbeat.PackedRng`
  record, then the data position as tagged JSON (:mod:`ckpt_agent.format.jsontree`; empty:
  none).

The writer fills the payload first and the header last, into the half the previous record
is not in, so a process killed mid-write leaves that half failing its CRC and the previous
record whole in the other half. The reader takes the valid half with the highest sequence
number. CRC-32 guards against a torn or stale record in the node's memory, not against a
forgery (that needs write access to the pod's memory: the same threat model as the
snapshots' fast checksums, :mod:`ckpt_agent.flash.protocol`). Torch-free.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.heartbeat import Heartbeat, PackedRng
from ckpt_agent.format.layout import dumps, loads

__all__ = [
    "HALF_BYTES",
    "STEP_HEARTBEAT_FILE",
    "StepHeartbeat",
    "StepHeartbeatSlot",
    "decode_record",
    "encode_payload",
    "install_record",
    "newest_record",
    "peek_seq",
    "read_step_heartbeat",
]

STEP_HEARTBEAT_FILE = "step_heartbeat.bin"
HALF_BYTES = 256 * 1024
"""One record's room (header included): RNG states are ~10 KB; the rest is the data position."""
_MAGIC = b"CKPTSHB1"
_VERSION = 1
_HEADER = struct.Struct("<8sIQqqII")
_FIELDS = struct.Struct("<Qqq I")
_TIME = struct.Struct("<dI")


@dataclass(frozen=True)
class StepHeartbeat:
    """One step's record: the heartbeat (step, time, data position, packed RNG) and the
    resume lineage epoch it was taken in."""

    heartbeat: Heartbeat
    epoch: int
    seq: int = 0


def _crc(seq: int, step: int, epoch: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(_FIELDS.pack(seq, step, epoch, len(payload))))


def encode_payload(time_s: float, rng: bytes, data: object) -> bytes:
    """The payload of one record (see the module doc); ``data`` is tagged JSON or None."""
    tail = b"" if data is None else dumps({"data": data})
    return b"".join((_TIME.pack(time_s, len(rng)), rng, tail))


class StepHeartbeatSlot:
    """The trainer's writer of ``step_heartbeat.bin`` in its own area (see the module doc)."""

    def __init__(self, area_dir: str | Path) -> None:
        self.path = Path(area_dir) / STEP_HEARTBEAT_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(fd).st_size < 2 * HALF_BYTES:
                os.ftruncate(fd, 2 * HALF_BYTES)
            self._mm = mmap.mmap(fd, 2 * HALF_BYTES)
        finally:
            os.close(fd)
        self._seq = max((r.seq for r in _records(self._mm)), default=0)

    def write(self, step: int, epoch: int, payload: bytes) -> None:
        """Publish one record (a memory copy); a payload over the room raises ValueError."""
        if _HEADER.size + len(payload) > HALF_BYTES:
            raise ValueError(
                f"a step heartbeat of {len(payload)} bytes is over the {HALF_BYTES}-byte room: "
                "keep the data position small (ids and offsets, not data)"
            )
        seq = self._seq + 1
        off = (seq % 2) * HALF_BYTES
        start = off + _HEADER.size
        mm = self._mm
        mm[start : start + len(payload)] = payload
        _HEADER.pack_into(
            mm,
            off,
            _MAGIC,
            _VERSION,
            seq,
            step,
            epoch,
            len(payload),
            _crc(seq, step, epoch, payload),
        )
        self._seq = seq

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()


def _records(mm: mmap.mmap | bytes) -> list[StepHeartbeat]:
    out = []
    for half in (0, 1):
        off = half * HALF_BYTES
        magic, version, seq, step, epoch, length, crc = _HEADER.unpack_from(mm, off)
        if magic != _MAGIC or version != _VERSION or length > HALF_BYTES - _HEADER.size:
            continue
        payload = bytes(mm[off + _HEADER.size : off + _HEADER.size + length])
        if seq < 1 or step < 0 or _crc(seq, step, epoch, payload) != crc:
            continue  # torn (killed mid-write) or stale
        try:
            out.append(_decode(seq, step, epoch, payload))
        except (CheckpointFormatError, ValueError, struct.error):
            continue
    return out


def _decode(seq: int, step: int, epoch: int, payload: bytes) -> StepHeartbeat:
    time_s, n = _TIME.unpack_from(payload, 0)
    rng = PackedRng.unpack(payload[_TIME.size : _TIME.size + n], "step heartbeat rng")
    tail = payload[_TIME.size + n :]
    data = loads(tail, "step heartbeat data", HALF_BYTES).get("data") if tail else None
    hb = Heartbeat(step=step, time=time_s, data=data, rng_packed=rng)
    return StepHeartbeat(heartbeat=hb, epoch=epoch, seq=seq)


def peek_seq(area_dir: str | Path) -> int:
    """The highest sequence number in the two headers (0: none), without checking them: a
    cheap "did it change" for a poller, which then reads :func:`newest_record`."""
    try:
        with open(Path(area_dir) / STEP_HEARTBEAT_FILE, "rb") as f:
            first = f.read(_HEADER.size)
            f.seek(HALF_BYTES)
            second = f.read(_HEADER.size)
    except FileNotFoundError:
        return 0
    seqs = [
        _HEADER.unpack(h)[2]
        for h in (first, second)
        if len(h) == _HEADER.size and h.startswith(_MAGIC)
    ]
    return max(seqs, default=0)


def _newest(area_dir: str | Path) -> tuple[bytes, StepHeartbeat] | None:
    """The area's file and its newest whole record (None: no file, or neither half intact)."""
    try:
        with open(Path(area_dir) / STEP_HEARTBEAT_FILE, "rb") as f:
            raw = f.read(2 * HALF_BYTES)
    except FileNotFoundError:
        return None
    if len(raw) < 2 * HALF_BYTES:
        return None
    best = max(_records(raw), key=lambda r: r.seq, default=None)
    return None if best is None else (raw, best)


def newest_record(area_dir: str | Path) -> bytes | None:
    """The newest whole record of an area as it lies in the file (header and payload: what
    a peer keeps for this rank and :func:`install_record` writes back), None: none intact."""
    found = _newest(area_dir)
    if found is None:
        return None
    raw, best = found
    off = (best.seq % 2) * HALF_BYTES
    length = _HEADER.unpack_from(raw, off)[5]
    return raw[off : off + _HEADER.size + length]


def decode_record(raw: bytes) -> StepHeartbeat:
    """A record from :func:`newest_record` (a peer's copy), checked; ValueError if it is not
    one whole record."""
    if len(raw) < _HEADER.size or len(raw) > HALF_BYTES:
        raise ValueError(f"a step heartbeat record of {len(raw)} bytes")
    found = _records(raw + bytes(2 * HALF_BYTES - len(raw)))  # as the first half of a file
    if len(found) != 1 or len(raw) != _HEADER.size + _HEADER.unpack_from(raw, 0)[5]:
        raise ValueError("not a whole step heartbeat record (torn, or its CRC does not match)")
    return found[0]


def install_record(area_dir: str | Path, raw: bytes) -> StepHeartbeat:
    """Write a peer's copy of a rank's record into the rank's (new) area, checked first; the
    area's reader then finds it as its newest record. Returns it."""
    got = decode_record(raw)
    slot = StepHeartbeatSlot(area_dir)
    try:
        slot.write(got.heartbeat.step, got.epoch, raw[_HEADER.size :])
    finally:
        slot.close()
    return got


def read_step_heartbeat(area_dir: str | Path) -> StepHeartbeat | None:
    """The newest whole record of an area (None: none, or neither half intact)."""
    found = _newest(area_dir)
    return None if found is None else found[1]
