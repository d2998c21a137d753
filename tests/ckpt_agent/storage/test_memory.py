"""``storage.memory``: buffer addresses (O_DIRECT alignment) and faulting pages in."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from ckpt_agent.storage import memory
from ckpt_agent.storage.memory import buffer_address, populate

MIB = 1024 * 1024


def test_buffer_address_matches_numpy_for_writable_and_read_only_buffers() -> None:
    arr = np.arange(1000, dtype=np.int64)
    assert buffer_address(memoryview(arr)) == arr.ctypes.data
    assert buffer_address(memoryview(arr).cast("B")[8:]) == arr.ctypes.data + 8
    ro = np.frombuffer(b"read only bytes!", dtype=np.uint8)
    assert buffer_address(memoryview(b"read only bytes!")) != 0
    assert buffer_address(ro.data) == ro.ctypes.data


def _resident_kib(field: str = "RssAnon") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def test_populate_faults_fresh_memory_in_and_keeps_its_bytes() -> None:
    if memory.populate.madvise is None:
        return  # not Linux >= 5.14: populate is documented as a no-op there
    fresh = np.empty(64 * MIB, dtype=np.uint8)  # private anonymous memory, untouched
    view = fresh.data
    before = _resident_kib()
    populate(view[MIB:])
    grown = _resident_kib() - before
    assert grown >= 60 * 1024, f"only {grown} KiB faulted in"
    fresh[MIB : MIB + 5] = np.frombuffer(b"hello", dtype=np.uint8)
    populate(view[MIB:])  # populated memory keeps its contents
    assert bytes(view[MIB : MIB + 5]) == b"hello"


def test_populate_keeps_small_read_only_and_shared_buffers_intact() -> None:
    small = bytearray(b"0123456789")
    populate(memoryview(small))  # under a page: nothing to do
    assert small == b"0123456789"
    ro = bytes(range(256)) * (8 * MIB // 256)
    populate(memoryview(ro))  # a bytes object's heap pages: populated, never written
    assert ro == bytes(range(256)) * (8 * MIB // 256)
    if memory.populate.madvise is None:
        return
    with mmap.mmap(-1, 4 * MIB) as mm:  # shared anonymous memory (shmem) is faulted in too
        view = memoryview(mm)
        try:
            before = _resident_kib("RssShmem")
            populate(view)
            assert _resident_kib("RssShmem") - before >= 3 * 1024
            assert bytes(view[:16]) == bytes(16)
        finally:
            view.release()


def test_a_refused_range_does_not_turn_populate_off(tmp_path: Path) -> None:
    """A read-only file mapping refuses MADV_POPULATE_WRITE (EINVAL): that range only."""
    enabled = memory.populate.madvise is not None
    path = tmp_path / "ro"
    path.write_bytes(bytes(4 * MIB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            populate(view)
        finally:
            view.release()
    assert (memory.populate.madvise is not None) == enabled
