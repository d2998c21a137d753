"""The filesystem backend's atomic write: :class:`FileWriter` (used by
:class:`ckpt_agent.storage.fs.LocalStorage`).

A write goes to a temporary file beside its target (``.ckpt-tmp.<name>.<random>``,
never listed), is fsynced, renamed over the target and the directory is fsynced, as
are the parents of directories the write created; every folder is opened through the
store's :class:`~ckpt_agent.storage.confined.ConfinedTree` (no link followed). An
aborted write removes its temporary file and the folders it created.

Large page-aligned buffers (the agent's host buffers and shared-memory slots are laid
out so) are written with ``O_DIRECT`` where the store allows it (:class:`DirectIO`): the
disk reads them straight from the caller's memory, without the copy into the page cache
that a buffered write makes (on a 2-core machine that copy cost as much CPU as hashing
the bytes). The tail shorter than a page, unaligned buffers and filesystems that refuse
``O_DIRECT`` take buffered writes; the fsync before the rename covers both.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import uuid
from pathlib import Path

from ckpt_agent.errors import RetryableStorageError, StorageError
from ckpt_agent.storage.base import TEMP_PREFIX, ObjectWriter, Storage
from ckpt_agent.storage.confined import O_TEMP, ConfinedTree, close_all, conflict
from ckpt_agent.storage.memory import buffer_address
from ckpt_agent.tuning import DIRECT_IO_ALIGN, DIRECT_IO_MIN_BYTES

__all__ = ["DirectIO", "FileWriter"]

log = logging.getLogger(__name__)

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class DirectIO:
    """Whether a store writes large aligned buffers with ``O_DIRECT``: on when asked for
    and the platform has it, off for good once the filesystem refuses it (``EINVAL``:
    tmpfs before Linux 6.6, some FUSE and network filesystems)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and _O_DIRECT != 0
        #: Bytes written with ``O_DIRECT`` (what tests and benchmarks look at).
        self.bytes_written = 0
        self._lock = threading.Lock()  # blobs are written on several threads at once

    def count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_written += nbytes

    def refused(self, where: Path, e: OSError) -> None:
        if self.enabled:
            log.info("%s refuses O_DIRECT writes (%s): buffered writes from now on", where, e)
        self.enabled = False


class KeyExistsError(Exception):
    """An exclusive publish found the key taken (internal: ``create_exclusive`` says False)."""


class FileWriter(ObjectWriter):
    """Temp file beside the target; fsync, rename, fsync directories on publish."""

    def __init__(
        self,
        storage: Storage,
        tree: ConfinedTree,
        key: str,
        path: Path,
        *,
        fsync: bool,
        direct: DirectIO | None = None,
        exclusive: bool = False,
    ) -> None:
        super().__init__(storage, key)
        self._exclusive = exclusive
        self._tree = tree
        self._direct = direct
        self._target = path
        self._do_fsync = fsync
        self._parts = key.split("/")  # validated by storage._path
        self._tmp_name = f"{TEMP_PREFIX}{self._parts[-1]}.{uuid.uuid4().hex[:16]}"
        self._tmp = path.with_name(self._tmp_name)
        self._fd = -1
        self._dfd = -1
        self._created: list[int] = []  # depths of the folders this writer created
        try:
            # A concurrent delete() may prune the directory between mkdir and open: retry.
            for attempt in range(3):
                fds, created = self._tree.chain(self._parts[:-1], create=True, fsync=fsync)
                self._created += created
                self._dfd = fds.pop()
                close_all(fds)
                try:
                    self._fd = os.open(self._tmp_name, O_TEMP, 0o666, dir_fd=self._dfd)
                    break
                except FileNotFoundError:
                    self._close_dir()
                    if attempt == 2:
                        raise RetryableStorageError(
                            f"directory {path.parent} keeps disappearing (concurrent delete?)"
                        ) from None
                except OSError as e:
                    raise self._tree.error(e, "creating", self._tmp) from e
        except BaseException:
            self.abort()
            raise

    def _write(self, data: memoryview) -> None:
        try:
            if self._direct is not None and self._direct.enabled:
                data = self._write_direct(data, self._direct)
            while data:
                n = os.write(self._fd, data)
                data = data[n:]
        except OSError as e:
            raise self._tree.error(e, f"writing {self.key!r} to", self._tmp) from e

    def _write_direct(self, data: memoryview, direct: DirectIO) -> memoryview:
        """Write the page-aligned head of ``data`` with ``O_DIRECT``; return the rest (all
        of it when ``data``, its address or the file offset is not aligned)."""
        n = len(data) - len(data) % DIRECT_IO_ALIGN
        if (
            n < DIRECT_IO_MIN_BYTES
            or self.tell() % DIRECT_IO_ALIGN
            or buffer_address(data) % DIRECT_IO_ALIGN
        ):
            return data
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | _O_DIRECT)
        except OSError as e:
            direct.refused(self._target.parent, e)
            return data
        head = data[:n]
        try:
            while head:
                try:
                    k = os.write(self._fd, head)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    if len(head) == n:  # the filesystem takes the flag, not the write
                        direct.refused(self._target.parent, e)
                    break
                head = head[k:]
                if k % DIRECT_IO_ALIGN:  # a short write left the rest unaligned
                    break
        finally:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags)
        direct.count(n - len(head))
        return data[n - len(head) :]

    def _publish(self) -> None:
        tree = self._tree
        try:
            if self._do_fsync:
                os.fsync(self._fd)
        except OSError as e:
            raise tree.error(e, f"syncing {self.key!r} to", self._tmp) from e
        fd, self._fd = self._fd, -1
        try:
            os.close(fd)  # NFS reports deferred write errors (ENOSPC, EDQUOT) here
        except OSError as e:
            raise tree.error(e, f"closing {self.key!r} at", self._tmp) from e
        try:
            if self._exclusive:
                self._link()
            else:
                # a rename replaces a link at the target itself, never its target
                os.replace(
                    self._tmp_name, self._parts[-1], src_dir_fd=self._dfd, dst_dir_fd=self._dfd
                )
        except KeyExistsError:
            raise
        except IsADirectoryError:
            raise conflict(self._target) from None
        except OSError as e:
            raise tree.error(e, f"publishing {self.key!r} as", self._target) from e
        if self._do_fsync:
            tree.fsync_fd(self._dfd, self._target.parent)
        self._close_dir()

    def _link(self) -> None:
        """Exclusive publish: a hard link fails with EEXIST when anything (a file, a link, a
        folder) has the name; atomic on POSIX filesystems and on NFS (the server links)."""
        try:
            os.link(
                self._tmp_name,
                self._parts[-1],
                src_dir_fd=self._dfd,
                dst_dir_fd=self._dfd,
                follow_symlinks=False,
            )
        except FileExistsError:
            raise KeyExistsError(self.key) from None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp_name, dir_fd=self._dfd)

    def _close_dir(self) -> None:
        if self._dfd >= 0:
            dfd, self._dfd = self._dfd, -1
            os.close(dfd)

    def _discard(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._dfd >= 0:
            try:
                os.unlink(self._tmp_name, dir_fd=self._dfd)
            except (FileNotFoundError, NotADirectoryError):
                pass
            except OSError:
                log.warning("could not remove temporary file %s", self._tmp, exc_info=True)
            self._close_dir()
        if self._created:  # leave no empty directories behind
            dirs = self._parts[:-1]
            try:
                fds, _ = self._tree.chain(dirs[: max(self._created)])
            except StorageError:
                return
            try:
                for depth in sorted(self._created, reverse=True):
                    os.rmdir(dirs[depth], dir_fd=fds[depth])
            except OSError:
                pass
            finally:
                close_all(fds)
