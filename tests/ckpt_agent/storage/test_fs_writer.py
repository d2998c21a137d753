"""The filesystem backend's write path: O_DIRECT for large aligned buffers
(:class:`ckpt_agent.storage.fs_writer.DirectIO`), buffered writes for everything else, the
same bytes published either way."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckpt_agent.storage import PermanentStorageError
from ckpt_agent.storage import fs_writer as fs_writer_mod
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.memory import buffer_address
from ckpt_agent.storage.options import StorageOptions
from ckpt_agent.tuning import DIRECT_IO_ALIGN, DIRECT_IO_MIN_BYTES

from .conftest import all_files

MIB = 1024 * 1024
pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def aligned(nbytes: int, *, shift: int = 0, seed: int = 0) -> memoryview:
    """``nbytes`` random bytes at a page-aligned address (plus ``shift``)."""
    raw = np.empty(nbytes + 2 * DIRECT_IO_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_IO_ALIGN + shift
    out = raw[skip : skip + nbytes]
    out[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    assert buffer_address(out.data) % DIRECT_IO_ALIGN == shift % DIRECT_IO_ALIGN
    return out.data


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStorage]:
    with LocalStorage(tmp_path / "ckpt") as s:
        yield s


def test_large_aligned_buffer_is_written_direct_and_reads_back(store: LocalStorage) -> None:
    data = aligned(2 * MIB + 123)  # the tail (not a whole page) goes through the page cache
    store.write("blobs/a", data)
    assert store.read("blobs/a") == bytes(data)
    assert store.direct_io.bytes_written == 2 * MIB
    assert store.direct_io.enabled


@pytest.mark.parametrize(
    ("why", "make"),
    [
        ("unaligned address", lambda: aligned(2 * MIB, shift=64)),
        ("small", lambda: aligned(DIRECT_IO_MIN_BYTES - DIRECT_IO_ALIGN)),
        ("read-only bytes", lambda: memoryview(bytes(aligned(2 * MIB)))),
    ],
)
def test_other_buffers_take_buffered_writes(
    store: LocalStorage, why: str, make: Callable[[], memoryview]
) -> None:
    data = make()
    store.write("blobs/b", data)
    assert store.read("blobs/b") == bytes(data), why
    if buffer_address(data) % DIRECT_IO_ALIGN or len(data) < DIRECT_IO_MIN_BYTES:
        assert store.direct_io.bytes_written == 0, why


def test_unaligned_file_offset_is_buffered_then_aligned_parts_direct(
    store: LocalStorage,
) -> None:
    head, body = b"h" * 100, aligned(2 * MIB, seed=1)
    with store.open_write("blobs/c") as f:
        f.write(head)  # offset 100: the next write cannot be direct
        f.write(body)
    assert store.direct_io.bytes_written == 0
    page, rest = aligned(DIRECT_IO_ALIGN, seed=2), aligned(2 * MIB, seed=3)
    with store.open_write("blobs/d") as f:
        f.write(page)  # small, buffered; the offset stays page-aligned
        f.write(rest)
    assert store.direct_io.bytes_written == 2 * MIB
    assert store.read("blobs/c") == head + bytes(body)
    assert store.read("blobs/d") == bytes(page) + bytes(rest)


def test_read_only_mapping_is_written_direct(store: LocalStorage, tmp_path: Path) -> None:
    """Shared-memory slots reach the persister as read-only mappings."""
    src = tmp_path / "slot"
    payload = bytes(aligned(3 * MIB, seed=4))
    src.write_bytes(payload)
    with open(src, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            store.write("blobs/e", view[MIB:])
        finally:
            view.release()
    assert store.read("blobs/e") == payload[MIB:]
    assert store.direct_io.bytes_written == 2 * MIB


def test_off_without_fsync_or_when_disabled(tmp_path: Path) -> None:
    data = aligned(2 * MIB)
    for opts in (StorageOptions(fsync=False), StorageOptions(direct_io=False)):
        with LocalStorage(tmp_path / str(opts.fsync), opts) as s:
            s.write("x", data)
            assert s.read("x") == bytes(data)
            assert not s.direct_io.enabled and s.direct_io.bytes_written == 0
    assert StorageOptions.from_env({"CKPT_FS_DIRECT_IO": "false"}).direct_io is False


def _refuse(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the filesystem refuse O_DIRECT, at the flag (``fcntl``) or at the write."""
    if where == "flag":
        real_fcntl = fcntl.fcntl

        def fake_fcntl(fd: int, cmd: int, arg: Any = 0) -> Any:
            if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_fcntl(fd, cmd, arg)

        monkeypatch.setattr(fs_writer_mod.fcntl, "fcntl", fake_fcntl)
        return
    real_write = os.write

    def fake_write(fd: int, data: Any) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(fs_writer_mod.os, "write", fake_write)


@pytest.mark.parametrize("where", ["flag", "write"])
def test_a_filesystem_refusing_o_direct_gets_buffered_writes_from_then_on(
    store: LocalStorage,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=fs_writer_mod.__name__)
    _refuse(where, monkeypatch)
    data = aligned(2 * MIB + 5)
    store.write("blobs/f", data)
    assert not store.direct_io.enabled
    assert "refuses O_DIRECT" in caplog.text
    store.write("blobs/g", data)
    monkeypatch.undo()
    assert store.read("blobs/f") == store.read("blobs/g") == bytes(data)
    assert store.direct_io.bytes_written == 0


def test_enospc_on_a_direct_write_publishes_nothing(tiny_tmpfs: Path) -> None:
    store = LocalStorage(tiny_tmpfs / "ckpt")
    store.write("steps/1/blob", b"x" * 1000)
    with pytest.raises(PermanentStorageError, match="no space left on device"):
        store.write("steps/2/blob", aligned(2 * MIB))
    assert all_files(tiny_tmpfs) == ["ckpt/steps/1/blob"]
    assert store.read("steps/1/blob") == b"x" * 1000
