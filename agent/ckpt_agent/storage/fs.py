"""Local or shared (NFS, CephFS, Lustre, hostPath, PVC) filesystem backend.

Layout: key ``a/b/c`` is the file ``<root>/a/b/c``.

Atomicity: a write goes to a temporary file beside its target
(``.ckpt-tmp.<name>.<random>``, never listed), is fsynced, renamed over the
target with ``os.replace`` (atomic on POSIX filesystems and on NFS, where the
server performs the rename) and the directory is fsynced, as are the parents
of directories the write created. A crash leaves at most a temporary file,
which readers ignore. ``commit`` always fsyncs, whatever ``options.fsync``.

Errors: ENOSPC/EDQUOT/EFBIG, EACCES/EPERM and EROFS become
:class:`PermanentStorageError` with what to fix; the temporary file is removed,
so nothing is half-published. ESTALE/EIO/ETIMEDOUT become
:class:`RetryableStorageError` (this backend does not retry by itself).

NFS caveat: NFS clients cache attributes and directory listings (``actimeo``,
default 3-60 s), so a reader on another node may list a step before its
``COMMIT`` is visible, or keep seeing a deleted file, for that long.
Close-to-open consistency makes the *content* of a file opened after the
writer closed it correct. For checkpoint directories shared between nodes
mount with ``actimeo=0`` (or ``noac``, which also makes writes synchronous and
slower), or at least ``lookupcache=positive``, and let readers trust only
``COMMIT`` files. This backend detects one symptom of a stale listing: a
listed entry whose ``stat`` fails. It re-reads the directory once, skips
entries that are still gone, logs a warning and counts them in
:attr:`LocalStorage.stale_entries`.
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import stat as stat_mod
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from ckpt_agent.storage.base import (
    TEMP_PREFIX,
    NotFoundError,
    ObjectInfo,
    ObjectWriter,
    PermanentStorageError,
    RetryableStorageError,
    Storage,
    StorageError,
    validate_key,
    validate_prefix,
)
from ckpt_agent.storage.options import StorageOptions

__all__ = ["LocalStorage"]

log = logging.getLogger(__name__)

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_PERMISSION = {errno.EACCES, errno.EPERM}
_TRANSIENT = {errno.ESTALE, errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.EBUSY}


class LocalStorage(Storage):
    """Objects as files under a root directory (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], options: StorageOptions | None = None) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.url = self.root.as_uri()
        self.options = options or StorageOptions()
        #: Listed entries whose stat failed even after re-reading their directory
        #: (a stale NFS listing, or a concurrent delete).
        self.stale_entries = 0
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, options: StorageOptions | None = None) -> LocalStorage:
        """``/abs/path``, ``rel/path``, ``file:///abs/path`` or ``file://localhost/abs``."""
        parts = urlsplit(url)
        if parts.scheme == "":
            return cls(url, options)
        if parts.scheme != "file":
            raise ValueError(f"not a file URL: {url!r}")
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"file URL with a host ({url!r}) is not supported: mount the share and use its path"
            )
        if parts.query or parts.fragment:
            raise ValueError(f"file URL must not have a query or fragment: {url!r}")
        return cls(unquote(parts.path), options)

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    # -- paths and errors -----------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def _error(self, e: OSError, action: str, path: Path | str) -> StorageError:
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
        if code in _TRANSIENT:
            return RetryableStorageError(f"{where}: {e.strerror or e} (transient, retry later)")
        return PermanentStorageError(f"{where}: {e.strerror or e}")

    def _ensure_dir(self, directory: Path) -> builtins.list[Path]:
        """``mkdir -p``; returns the directories it created (outermost first)."""
        missing: builtins.list[Path] = []
        d = directory
        while not d.is_dir():
            missing.append(d)
            if d == d.parent:
                break
            d = d.parent
        created: builtins.list[Path] = []
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o777)
                created.append(d)
            except FileExistsError:
                if not d.is_dir():
                    raise _conflict(d) from None
            except NotADirectoryError:
                raise _conflict(next(p for p in d.parents if p.exists())) from None
            except OSError as e:
                raise self._error(e, "creating directory", d) from e
        return created

    def _fsync_dir(self, directory: Path) -> None:
        try:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise self._error(e, "opening directory", directory) from e
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):  # fs without directory fsync
                raise self._error(e, "syncing directory", directory) from e
        finally:
            os.close(fd)

    # -- writing ---------------------------------------------------------------------
    def open_write(self, key: str) -> ObjectWriter:
        return _FileWriter(self, key, self._path(key), fsync=self.options.fsync)

    def commit(self, key: str, data: bytes) -> None:
        with _FileWriter(self, key, self._path(key), fsync=True) as f:
            f.write(data)

    # -- reading ---------------------------------------------------------------------
    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be >= 0")
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                if start:
                    f.seek(start)
                if length is None:
                    return f.readall()  # one allocation of the file's size
                data = f.read(length)
                if data is None or len(data) == length or not data:
                    return data or b""
                parts = [data]  # a short read (possible on network filesystems)
                got = len(data)
                while got < length:
                    more = f.read(length - got)
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                return b"".join(parts)
        except IsADirectoryError:
            raise NotFoundError(f"reading {path}: no such object (a directory)") from None
        except OSError as e:
            raise self._error(e, "reading", path) from e

    def open_read(self, key: str) -> BinaryIO:
        path = self._path(key)
        try:
            f = open(path, "rb")  # noqa: SIM115 - the caller closes it
        except OSError as e:
            raise self._error(e, "opening", path) from e
        return f

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = os.stat(path)
        except OSError as e:
            raise self._error(e, "stat", path) from e
        if not stat_mod.S_ISREG(st.st_mode):
            raise NotFoundError(f"stat {path}: no such object (not a regular file)")
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    # -- listing ---------------------------------------------------------------------
    def list(self, prefix: str = "", *, delimiter: str | None = None) -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        if delimiter is not None and delimiter != "/":
            return _collapse(self.list(prefix), prefix, delimiter)
        dir_part, _, name_prefix = prefix.rpartition("/")
        start = self.root.joinpath(*dir_part.split("/")) if dir_part else self.root
        key_prefix = f"{dir_part}/" if dir_part else ""
        return self._walk(start, key_prefix, name_prefix, recursive=delimiter is None)

    def _walk(
        self, directory: Path, key_prefix: str, name_prefix: str, *, recursive: bool
    ) -> Iterator[ObjectInfo]:
        for name, is_dir, st in self._scan(directory):
            if not name.startswith(name_prefix):
                continue
            key = key_prefix + name
            if is_dir:
                if recursive:
                    yield from self._walk(directory / name, key + "/", "", recursive=True)
                elif self._has_objects(directory / name):
                    yield ObjectInfo(key=key + "/", size=0)
            else:
                assert st is not None
                yield ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    def _scan(self, directory: Path) -> builtins.list[tuple[str, bool, os.stat_result | None]]:
        """One directory's visible entries in key order, stat'ed; re-read once if stale."""
        for attempt in (1, 2):
            try:
                with os.scandir(directory) as it:
                    names = [e.name for e in it if not e.name.startswith(TEMP_PREFIX)]
            except (FileNotFoundError, NotADirectoryError):
                return []
            except OSError as e:
                raise self._error(e, "listing", directory) from e
            out: builtins.list[tuple[str, bool, os.stat_result | None]] = []
            gone: builtins.list[str] = []
            for name in names:
                try:
                    st = os.stat(directory / name)
                except FileNotFoundError:
                    gone.append(name)
                    continue
                except OSError as e:
                    if e.errno == errno.ESTALE:
                        gone.append(name)
                        continue
                    raise self._error(e, "stat", directory / name) from e
                if stat_mod.S_ISDIR(st.st_mode):
                    out.append((name, True, None))
                elif stat_mod.S_ISREG(st.st_mode):
                    out.append((name, False, st))
            if not gone:
                break
            if attempt == 2:
                with self._lock:
                    self.stale_entries += len(gone)
                log.warning(
                    "stale listing in %s: %d entr%s listed but gone (%s); skipped. On NFS "
                    "mount with actimeo=0 or lookupcache=positive.",
                    directory,
                    len(gone),
                    "y" if len(gone) == 1 else "ies",
                    ", ".join(gone[:5]),
                )
        out.sort(key=lambda t: t[0] + "/" if t[1] else t[0])
        return out

    def _has_objects(self, directory: Path) -> bool:
        try:
            with os.scandir(directory) as it:
                for e in it:
                    if e.name.startswith(TEMP_PREFIX):
                        continue
                    try:
                        if e.is_file() or (e.is_dir() and self._has_objects(Path(e.path))):
                            return True
                    except OSError:
                        continue
        except OSError:
            return False
        return False

    # -- deleting --------------------------------------------------------------------
    def delete(self, key: str) -> None:
        path = self._path(key)
        if self._unlink(path) and self.options.fsync:
            self._fsync_dir(path.parent)
        self._prune(path.parent)

    def delete_prefix(self, prefix: str) -> int:
        dirs: set[Path] = set()
        n = 0
        for info in list(self.list(prefix)):
            path = self._path(info.key)
            if self._unlink(path):
                n += 1
                dirs.add(path.parent)
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            if self.options.fsync and d.is_dir():
                self._fsync_dir(d)
            self._prune(d)
        return n

    def _unlink(self, path: Path) -> bool:
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        except OSError as e:
            raise self._error(e, "deleting", path) from e
        return True

    def _prune(self, directory: Path) -> None:
        """Remove now-empty directories up to (not including) the root."""
        d = directory
        while d != self.root and self.root in d.parents:
            try:
                os.rmdir(d)
            except OSError:
                return
            d = d.parent


class _FileWriter(ObjectWriter):
    """Temp file beside the target; fsync, rename, fsync directories on publish."""

    def __init__(self, storage: LocalStorage, key: str, path: Path, *, fsync: bool) -> None:
        super().__init__(storage, key)
        self._fs = storage
        self._target = path
        self._do_fsync = fsync
        self._tmp = path.with_name(f"{TEMP_PREFIX}{path.name}.{uuid.uuid4().hex[:16]}")
        self._fd = -1
        self._created: list[Path] = []
        try:
            # A concurrent delete() may prune the directory between mkdir and open: retry.
            for attempt in range(3):
                self._created += storage._ensure_dir(path.parent)
                try:
                    self._fd = os.open(
                        self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666
                    )
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise RetryableStorageError(
                            f"directory {path.parent} keeps disappearing (concurrent delete?)"
                        ) from None
                except OSError as e:
                    raise storage._error(e, "creating", self._tmp) from e
        except BaseException:
            self.abort()
            raise

    def _write(self, data: memoryview) -> None:
        try:
            while data:
                n = os.write(self._fd, data)
                data = data[n:]
        except OSError as e:
            raise self._fs._error(e, f"writing {self.key!r} to", self._tmp) from e

    def _publish(self) -> None:
        fs = self._fs
        try:
            if self._do_fsync:
                os.fsync(self._fd)
        except OSError as e:
            raise fs._error(e, f"syncing {self.key!r} to", self._tmp) from e
        fd, self._fd = self._fd, -1
        try:
            os.close(fd)  # NFS reports deferred write errors (ENOSPC, EDQUOT) here
        except OSError as e:
            raise fs._error(e, f"closing {self.key!r} at", self._tmp) from e
        try:
            os.replace(self._tmp, self._target)
        except IsADirectoryError:
            raise _conflict(self._target) from None
        except OSError as e:
            raise fs._error(e, f"publishing {self.key!r} as", self._target) from e
        if self._do_fsync:
            fs._fsync_dir(self._target.parent)
            for d in self._created:
                fs._fsync_dir(d.parent)

    def _discard(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self._tmp)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError:
            log.warning("could not remove temporary file %s", self._tmp, exc_info=True)
        for d in reversed(self._created):  # leave no empty directories behind
            try:
                os.rmdir(d)
            except OSError:
                break


def _conflict(path: Path) -> PermanentStorageError:
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


def _collapse(items: Iterator[ObjectInfo], prefix: str, delimiter: str) -> Iterator[ObjectInfo]:
    """S3-style common prefixes over a recursive, key-ordered listing."""
    last: str | None = None
    for info in items:
        rest = info.key[len(prefix) :]
        i = rest.find(delimiter)
        if i < 0:
            yield info
            continue
        common = prefix + rest[: i + len(delimiter)]
        if common != last:
            last = common
            yield ObjectInfo(key=common, size=0)
