"""The filesystem backend's atomic write: :class:`FileWriter` (used by
:class:`ckpt_agent.storage.fs.LocalStorage`).

A write goes to a temporary file beside its target (``.ckpt-tmp.<name>.<random>``,
never listed), is fsynced, renamed over the target and the directory is fsynced, as
are the parents of directories the write created; every folder is opened through the
store's :class:`~ckpt_agent.storage.confined.ConfinedTree` (no link followed). An
aborted write removes its temporary file and the folders it created.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from pathlib import Path

from ckpt_agent.storage.base import (
    TEMP_PREFIX,
    ObjectWriter,
    RetryableStorageError,
    Storage,
    StorageError,
)
from ckpt_agent.storage.confined import O_TEMP, ConfinedTree, close_all, conflict

__all__ = ["FileWriter"]

log = logging.getLogger(__name__)


class FileWriter(ObjectWriter):
    """Temp file beside the target; fsync, rename, fsync directories on publish."""

    def __init__(
        self, storage: Storage, tree: ConfinedTree, key: str, path: Path, *, fsync: bool
    ) -> None:
        super().__init__(storage, key)
        self._tree = tree
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
            while data:
                n = os.write(self._fd, data)
                data = data[n:]
        except OSError as e:
            raise self._tree.error(e, f"writing {self.key!r} to", self._tmp) from e

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
            # a rename replaces a link at the target itself, never its target
            os.replace(self._tmp_name, self._parts[-1], src_dir_fd=self._dfd, dst_dir_fd=self._dfd)
        except IsADirectoryError:
            raise conflict(self._target) from None
        except OSError as e:
            raise tree.error(e, f"publishing {self.key!r} as", self._target) from e
        if self._do_fsync:
            tree.fsync_fd(self._dfd, self._target.parent)
        self._close_dir()

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
