"""A folder tree that is never left: the filesystem backend's path handling.

:class:`ConfinedTree` opens the folders below a root one descriptor at a
time, each relative to its parent's, with ``O_NOFOLLOW``: a symbolic link
planted anywhere below the root (by whoever can write the volume) is never
followed, even one swapped in while we walk; meeting one raises
:class:`UnsafePathError`. The root itself is resolved once by the caller
(mounted volumes are often links) and the folders above it are trusted —
unless an ``anchor`` is given: a resolved folder at or above the root (the
operator's grant of a namespace), opened by its path, from which every folder
down to the root is opened the same way, one descriptor at a time with
``O_NOFOLLOW``. Then a link swapped in between the anchor and the root after
the root was checked is refused at the next open too: nothing outside the
anchor is ever reached.
It also maps ``OSError`` to the storage error taxonomy with a message that
says what to fix. Used by :mod:`ckpt_agent.storage.fs`; no other backend
needs it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_mod
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ckpt_agent.errors import (
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageError,
    UnsafePathError,
)

__all__ = [
    "O_DIR",
    "O_READ",
    "O_TEMP",
    "ConfinedTree",
    "check_regular",
    "close_all",
    "conflict",
    "kind_of",
    "link_text",
    "unsafe",
]

#: A folder below the root: never through a symlink.
O_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: An object to read: never through a symlink; a FIFO must not block the open.
O_READ: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: A new temporary file beside its target.
O_TEMP: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_PERMISSION = {errno.EACCES, errno.EPERM}
_TRANSIENT = {errno.ESTALE, errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.EBUSY}


#: Walks from the root again when a folder on the way is pruned concurrently.
_CHAIN_ATTEMPTS: Final = 8


class _VanishedError(Exception):
    """A folder on the way was removed by a concurrent prune (internal: retried)."""


class ConfinedTree:
    """The folders under ``root`` (already resolved), opened without following links.

    ``anchor``: a resolved folder at or above ``root``; the root is then opened from it one
    folder at a time without following links (``ValueError`` when ``root`` is not below it).
    """

    def __init__(self, root: Path, *, anchor: Path | None = None) -> None:
        self.root = root
        #: Where opening the root starts (None: at the root's own path, the folders above
        #: it trusted).
        self.anchor = anchor
        #: The folders from the anchor down to the root.
        self.below_anchor: tuple[str, ...] = (
            () if anchor is None else root.relative_to(anchor).parts
        )

    def error(self, e: OSError, action: str, path: Path | str) -> StorageError:
        """Map an OSError to the storage taxonomy with a message saying what to fix."""
        code = e.errno
        where = f"{action} {path}"
        if isinstance(e, FileNotFoundError | NotADirectoryError | IsADirectoryError):
            return NotFoundError(f"{where}: no such object")
        if code in _NO_SPACE:
            free = _free_bytes(self.root)
            what = {
                errno.ENOSPC: "no space left on device",
                errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large for this filesystem or process limit (RLIMIT_FSIZE)",
            }[code]
            return PermanentStorageError(
                f"{where}: {what} ({free} bytes free under {self.root}); nothing was "
                "published. Free space, enlarge the volume or its quota, or keep fewer "
                "checkpoints (retention)."
            )
        if code in _NO_PERMISSION:
            return PermanentStorageError(
                f"{where}: permission denied for uid {os.geteuid()} gid {os.getegid()}; "
                "nothing was published. Make the checkpoint directory writable for this user "
                "(pod securityContext runAsUser/fsGroup, or chown/chmod the volume)."
            )
        if code == errno.EROFS:
            return PermanentStorageError(
                f"{where}: read-only filesystem; nothing was published. Mount the checkpoint "
                "volume read-write (volumeMounts[].readOnly: false, PVC accessMode RW)."
            )
        if code == errno.ENAMETOOLONG:
            return PermanentStorageError(f"{where}: name too long for this filesystem")
        if code == errno.ELOOP:  # O_NOFOLLOW met a link swapped in after we looked
            return unsafe(path, action, "a symbolic link")
        if code in _TRANSIENT:
            return RetryableStorageError(f"{where}: {e.strerror or e} (transient, retry later)")
        return PermanentStorageError(f"{where}: {e.strerror or e}")

    # -- folders -----------------------------------------------------------------------
    def open_root(self, *, create: bool = False, fsync: bool = False) -> int:
        if self.anchor is not None:
            return self._open_anchored(self.anchor, create=create, fsync=fsync)
        try:
            return os.open(self.root, O_DIR)
        except FileNotFoundError:
            if not create:
                raise NotFoundError(f"opening {self.root}: no such directory") from None
        except NotADirectoryError:
            if os.path.islink(self.root):  # replaced by a link after we resolved it
                raise unsafe(self.root, "opening the root", "a symbolic link") from None
            if create:
                raise conflict(self.root) from None
            raise NotFoundError(f"opening {self.root}: not a directory") from None
        except OSError as e:
            raise self.error(e, "opening directory", self.root) from e
        self._ensure_root(fsync=fsync)
        try:
            return os.open(self.root, O_DIR)
        except OSError as e:
            raise self.error(e, "opening directory", self.root) from e

    def _open_anchored(self, anchor: Path, *, create: bool, fsync: bool) -> int:
        """The root, opened from ``anchor`` one folder at a time, never through a link."""
        for _attempt in range(_CHAIN_ATTEMPTS):
            try:
                fd = os.open(anchor, O_DIR)
            except FileNotFoundError:
                raise NotFoundError(f"opening {anchor}: no such directory") from None
            except OSError as e:
                raise self.error(e, "opening directory", anchor) from e
            try:
                for i, name in enumerate(self.below_anchor):
                    path = anchor.joinpath(*self.below_anchor[: i + 1])
                    sub, _ = self.subdir(fd, name, path, create=create, fsync=fsync)
                    os.close(fd)
                    fd = sub
            except _VanishedError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            return fd
        raise RetryableStorageError(
            f"directory {self.root} keeps disappearing (concurrent delete?)"
        )

    def _ensure_root(self, *, fsync: bool) -> None:
        """``mkdir -p`` of the root (the folders above it are trusted: no confinement)."""
        missing: list[Path] = []
        d = self.root
        while not d.is_dir():
            missing.append(d)
            if d == d.parent:
                break
            d = d.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o777)
            except FileExistsError:
                if not d.is_dir():
                    raise conflict(d) from None
                continue
            except OSError as e:
                raise self.error(e, "creating directory", d) from e
            if fsync:
                self.fsync_dir(d.parent)

    def subdir(
        self, fd: int, name: str, path: Path, *, create: bool = False, fsync: bool = False
    ) -> tuple[int, bool]:
        """Open (or create) folder ``name`` in ``fd`` without following a link.

        Returns the new descriptor and whether this call created the folder.
        Raises :class:`_VanishedError` when ``fd`` itself was removed meanwhile (a
        concurrent prune): :meth:`chain` then starts again from the root.
        """
        created = False
        for _ in range(3):
            try:
                return os.open(name, O_DIR, dir_fd=fd), created
            except FileNotFoundError:
                if not create:
                    raise NotFoundError(f"opening {path}: no such directory") from None
            except NotADirectoryError:
                self.refuse_link(fd, name, path, "opening directory")
                if create:
                    raise conflict(path) from None
                raise NotFoundError(f"opening {path}: not a directory") from None
            except OSError as e:
                if e.errno == errno.ELOOP:  # a link: say where it points
                    self.refuse_link(fd, name, path, "opening directory")
                raise self.error(e, "opening directory", path) from e
            try:
                os.mkdir(name, 0o777, dir_fd=fd)
                created = True
            except FileExistsError:
                continue
            except FileNotFoundError:
                raise _VanishedError(path) from None  # the parent went away under us
            except OSError as e:
                raise self.error(e, "creating directory", path) from e
            if fsync:
                self.fsync_fd(fd, path.parent)
        raise _VanishedError(path)

    def chain(
        self, parts: Sequence[str], *, create: bool = False, fsync: bool = False
    ) -> tuple[list[int], list[int]]:
        """Descriptors of the root and of each folder in ``parts`` (the caller closes
        them), and the depths this call created. Raises :class:`NotFoundError` or
        :class:`UnsafePathError` (a link on the way). With ``create``, a folder that
        another writer prunes while this one walks is created again (a few tries)."""
        created: list[int] = []
        for _attempt in range(_CHAIN_ATTEMPTS):
            fds = [self.open_root(create=create, fsync=fsync)]
            try:
                for i, name in enumerate(parts):
                    path = self.root.joinpath(*parts[: i + 1])
                    fd, made = self.subdir(fds[-1], name, path, create=create, fsync=fsync)
                    fds.append(fd)
                    if made:
                        created.append(i)
            except _VanishedError:
                close_all(fds)
                continue
            except BaseException:
                close_all(fds)
                raise
            return fds, created
        where = self.root.joinpath(*parts)
        raise RetryableStorageError(f"directory {where} keeps disappearing (concurrent delete?)")

    def open_dir(self, parts: Sequence[str]) -> int:
        """A descriptor of the folder ``parts`` (the caller closes it)."""
        fds, _ = self.chain(parts)
        close_all(fds[:-1])
        return fds[-1]

    def refuse_link(self, fd: int, name: str, path: Path, action: str) -> None:
        """Raise :class:`UnsafePathError` if ``name`` in ``fd`` is a symbolic link."""
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return
        if stat_mod.S_ISLNK(st.st_mode):
            raise unsafe(path, action, link_text(fd, name))

    def fsync_fd(self, fd: int, path: Path) -> None:
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # fs without directory fsync
                raise self.error(e, "syncing directory", path) from e

    def fsync_dir(self, directory: Path) -> None:
        """fsync a folder by path (the root and the trusted folders above it)."""
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise self.error(e, "opening directory", directory) from e
        try:
            self.fsync_fd(fd, directory)
        finally:
            os.close(fd)


def check_regular(st: os.stat_result, path: Path, action: str) -> None:
    """Only regular files are objects: a folder is missing, anything else is refused."""
    if stat_mod.S_ISREG(st.st_mode):
        return
    if stat_mod.S_ISDIR(st.st_mode):
        raise NotFoundError(f"{action} {path}: no such object (a directory)")
    raise unsafe(path, action, kind_of(st.st_mode))


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat_mod.S_ISLNK(mode):
        return "symbolic link"
    if stat_mod.S_ISFIFO(mode):
        return "FIFO"
    if stat_mod.S_ISSOCK(mode):
        return "socket"
    if stat_mod.S_ISCHR(mode) or stat_mod.S_ISBLK(mode):
        return "device"
    return "special file"


def link_text(fd: int, name: str) -> str:
    """``a symbolic link to '<target>'`` (read, never followed)."""
    try:
        return f"a symbolic link to {os.readlink(name, dir_fd=fd)!r}"
    except OSError:
        return "a symbolic link"


def unsafe(path: Path | str, action: str, what: str) -> UnsafePathError:
    if not what.startswith("a "):
        what = f"a {what}"
    return UnsafePathError(
        f"{action} {path}: is {what}, not a regular file or folder; the store is never "
        "followed out of its root nor read from anything but regular files. Whoever can "
        "write the checkpoint volume planted it: remove it."
    )


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def conflict(path: Path) -> PermanentStorageError:
    kind = "directory" if path.is_dir() else "file"
    return PermanentStorageError(
        f"{path} is a {kind}: on a filesystem a key cannot be both an object and the "
        "prefix of other keys (a and a/b); choose keys that do not collide"
    )


def _free_bytes(path: Path) -> int:
    p = path
    while True:
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            if p == p.parent:
                return -1
            p = p.parent
