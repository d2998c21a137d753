"""What the replica tests share: small snapshots (a slot's bytes and descriptor, 1 KiB
chunks), the job's secret."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ckpt_agent.flash.area import ShmArea
from ckpt_agent.flash.checksums import chunk_hashes
from ckpt_agent.flash.protocol import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    Descriptor,
    ShmTensor,
    atomic_write,
    place,
)
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Json

CHUNK = 1024
RUN = "run-1"
SECRET = b"0123456789abcdef0123456789abcdef"


@dataclass
class Snap:
    desc: Descriptor
    slot: bytearray
    hashes: dict[str, list[str]]

    @property
    def view(self) -> memoryview:
        return memoryview(self.slot)

    def tensor(self, name: str) -> bytes:
        t = self.desc.tensors.get(name) or self.desc.files[name]
        return bytes(self.slot[t.offset : t.offset + t.nbytes])


def make_snap(
    tensors: Mapping[str, bytes],
    *,
    seq: int = 1,
    step: int = 10,
    rank: int = 0,
    run_id: str = RUN,
    files: Mapping[str, bytes] | None = None,
    world_size: int | None = None,
    slot_index: int | None = None,
    meta: Mapping[str, Json] | None = None,
) -> Snap:
    """A complete snapshot of uint8 tensors (and files) laid out like a slot."""
    layout: dict[str, ShmTensor] = {}
    file_layout: dict[str, ShmTensor] = {}
    off = HEADER_BYTES
    for target, items in ((layout, tensors), (file_layout, files or {})):
        for name, data in items.items():
            off = place(off, len(data))
            target[name] = ShmTensor("uint8", (len(data),), off, len(data))
            off += len(data)
    slot = bytearray(off)
    HEADER.pack_into(slot, 0, MAGIC, seq, seq, off)
    for target, items in ((layout, tensors), (file_layout, files or {})):
        for name, data in items.items():
            slot[target[name].offset : target[name].offset + len(data)] = data
    desc = Descriptor(
        run_id=run_id,
        rank=rank,
        world_size=world_size or max(2, rank + 1),
        seq=seq,
        slot=seq % 2 if slot_index is None else slot_index,
        step=step,
        tier=Tier.PULSE,
        data_size=off,
        tree={"model": {"w": {"__tensor__": "w"}}},
        tensors=layout,
        files=file_layout,
        meta=dict(meta or {}),
    )
    view = memoryview(slot)
    hashes = {
        name: chunk_hashes(view[t.offset : t.offset + t.nbytes], CHUNK)
        for name, t in (*layout.items(), *file_layout.items())
    }
    view.release()
    return Snap(desc, slot, hashes)


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes, different for every seed and in every 1 KiB chunk."""
    return bytes((i * 7 + seed * 131 + i // CHUNK) % 251 for i in range(n))


def write_slot(shm_dir: Path, snap: Snap) -> ShmArea:
    """Publish ``snap`` in its rank's area as the trainer does (data, then descriptor)."""
    area = ShmArea(shm_dir, snap.desc.run_id, snap.desc.rank)
    area.dir.mkdir(parents=True, exist_ok=True)
    area.data_path(snap.desc.slot).write_bytes(snap.slot)
    atomic_write(area.desc_path(snap.desc.slot), snap.desc.to_bytes())
    return area
