"""The trainer's side of the shared-memory protocol: :class:`ShmWriter`.

Copies a snapshot's tensors (torch or numpy) into a free slot of the rank's area
and publishes its descriptor last (:mod:`ckpt_agent.flash.protocol` describes the
layout and the locking); the persister reads it with
:class:`~ckpt_agent.flash.reader.ShmReader`.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ckpt_agent.errors import ShmError
from ckpt_agent.flash.area import ShmArea, hold_lock
from ckpt_agent.flash.protocol import (
    DEFAULT_SLOTS,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    Descriptor,
    PersistedMark,
    ShmTensor,
    align,
    atomic_write,
    place,
    try_flock,
)
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Json
from ckpt_agent.runtime.core.devices import synchronize_copies
from ckpt_agent.runtime.core.serialization import LiveArray, flatten

__all__ = ["ShmWriter"]


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
        self._trainer_fd = hold_lock(self.dir / "trainer.lock")
        if self._trainer_fd < 0:
            raise ShmError(
                f"another live process holds {self.dir / 'trainer.lock'}: two trainers of run "
                f"{run_id!r} rank {rank} on one node?"
            )
        self._slots: dict[int, _Slot] = {}
        self._slots_lock = threading.Lock()
        self._seq = self.highest_seq()
        self.writes = 0

    # ------------------------------------------------------------------ slots

    def _slot(self, i: int) -> _Slot:
        s = self._slots.get(i)
        if s is None:
            with self._slots_lock:  # prepare() may run on a background thread meanwhile
                s = self._slots.get(i)
                if s is None:
                    fd = os.open(self.data_path(i), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                    s = _Slot(fd=fd, size=os.fstat(fd).st_size)
                    self._slots[i] = s
        return s

    def _protected(self) -> set[int]:
        """The slots no snapshot may overwrite: the newest complete snapshot nobody handled
        yet, and the newest durable one nobody handled yet (a newer memory-only snapshot
        must not take a pulse or a full out of storage's reach)."""
        mark = self.persisted()
        handled = mark.seq if mark is not None else 0
        todo = [d for d in self.complete() if d.seq > handled]
        if not todo:
            return set()
        out = {todo[-1].slot}
        durable = [d for d in todo if not d.memory_only]
        if durable:
            out.add(durable[-1].slot)
        return out

    def free_slot(self) -> int | None:
        """A slot a snapshot could be written to now (None: busy, the save must wait)."""
        protect = self._protected()
        for i in self.write_order():
            if i in protect:
                continue
            s = self._slot(i)
            if try_flock(s.fd, fcntl.LOCK_EX):
                fcntl.flock(s.fd, fcntl.LOCK_UN)
                return i
        return None

    @property
    def busy(self) -> bool:
        return self.free_slot() is None

    def _acquire(self) -> int | None:
        protect = self._protected()
        for i in self.write_order():
            if i in protect:
                continue
            if try_flock(self._slot(i).fd, fcntl.LOCK_EX):
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
        live: dict[str, LiveArray] = {}
        for name, value in sections.items():
            flatten(value, name, live)
        size = HEADER_BYTES
        for n in [*(_nbytes(a.value) for a in live.values()), files_bytes]:
            size = place(size, n) + n
        size = align(size)
        for i in range(self.slots):
            s = self._slot(i)
            if try_flock(s.fd, fcntl.LOCK_EX):
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
        t0 = time.perf_counter()
        live: dict[str, LiveArray] = {}
        tree: dict[str, Json] = {}
        for name, value in sections.items():
            tree[name] = flatten(value, name, live)
        layout: dict[str, ShmTensor] = {}
        off = HEADER_BYTES
        for a in live.values():
            nbytes = _nbytes(a.value)
            start = place(off, nbytes)
            layout[a.name] = ShmTensor(a.dtype, a.shape, start, nbytes)
            off = start + nbytes
        flayout: dict[str, ShmTensor] = {}
        for fname, payload in (files or {}).items():
            start = place(off, len(payload))
            flayout[fname] = ShmTensor("uint8", (len(payload),), start, len(payload))
            off = start + len(payload)
        size = align(off)
        slot = self._acquire()
        if slot is None:
            return None
        s = self._slots[slot]
        try:
            self.desc_path(slot).unlink(missing_ok=True)  # unpublish first: the slot is torn now
            self.hashes_path(slot).unlink(missing_ok=True)
            mm = self._map(s, size + reserve)
            seq = self._seq + 1
            HEADER.pack_into(mm, 0, MAGIC, seq, 0, size)
            for a in live.values():
                self._copy(mm, layout[a.name], a.value)
            synchronize_copies(a.value for a in live.values())  # every device a copy is on
            for fname, payload in (files or {}).items():
                t = flayout[fname]
                mm[t.offset : t.offset + t.nbytes] = payload
            HEADER.pack_into(mm, 0, MAGIC, seq, seq, size)
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
            atomic_write(self.desc_path(slot), desc.to_bytes())  # the commit marker, last
            self._seq = seq
            self.writes += 1
            return desc
        finally:
            fcntl.flock(s.fd, fcntl.LOCK_UN)

    @staticmethod
    def _copy(mm: mmap.mmap, t: ShmTensor, value: torch.Tensor | np.ndarray) -> None:
        if t.nbytes == 0:
            return
        if isinstance(value, np.ndarray):
            dst_np = np.frombuffer(mm, dtype=value.dtype, count=value.size, offset=t.offset)
            np.copyto(dst_np.reshape(value.shape), value)
            del dst_np
            return
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
        dst = raw.view(value.dtype).view(value.shape)
        src = value.detach()
        dst.copy_(src, non_blocking=src.device.type == "cuda")
        del raw, dst

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
    if isinstance(v, np.ndarray):
        return int(v.nbytes)
    return int(v.numel() * v.element_size())
