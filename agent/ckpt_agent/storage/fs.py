"""Local or shared (NFS, CephFS, Lustre, hostPath, PVC) filesystem backend.

Layout: key ``a/b/c`` is the file ``<root>/a/b/c``.

Confinement: this backend never leaves its root. The root is resolved once
(it may itself be a symlink, as mounted volumes often are); below it every
folder is opened relative to its parent's descriptor with ``O_NOFOLLOW``, so
a symbolic link planted in the store (by anyone who can write the volume) is
never followed, for reading, listing, writing or deleting, even if it is
swapped in while we walk. A link on the way to a key (or to a listed or
deleted prefix's folder) raises :class:`UnsafePathError`; one met while
listing is no object: skipped, logged and counted in
:attr:`LocalStorage.unsafe_entries`; one inside a folder being deleted is
removed as a link, never its target. Only regular files are read: a FIFO or
device behind a key is refused (it is opened non-blocking, so nothing hangs),
and a whole-object read stops at the size ``fstat`` reported plus one byte.

Atomicity: a write goes to a temporary file beside its target
(``.ckpt-tmp.<name>.<random>``, never listed), is fsynced, renamed over the
target (atomic on POSIX filesystems and on NFS, where the server performs the
rename) and the directory is fsynced, as are the parents of directories the
write created. A crash leaves at most a temporary file, which readers ignore.
``commit`` always fsyncs, whatever ``options.fsync``.

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
import contextlib
import errno
import logging
import mmap
import os
import stat as stat_mod
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from ckpt_agent.errors import NotFoundError, StorageError
from ckpt_agent.storage.base import (
    TEMP_PREFIX,
    ObjectInfo,
    ObjectWriter,
    Storage,
    validate_key,
    validate_prefix,
)
from ckpt_agent.storage.confined import (
    O_READ,
    ConfinedTree,
    check_regular,
    close_all,
    link_text,
    unsafe,
)
from ckpt_agent.storage.fs_delete import delete_tree, prune, unlink_entry
from ckpt_agent.storage.fs_writer import DirectIO, FileWriter, KeyExistsError
from ckpt_agent.storage.memory import populate
from ckpt_agent.storage.options import StorageOptions
from ckpt_agent.text import clean
from ckpt_agent.tuning import ASSUMED_WRITE_BPS_LOCAL

__all__ = ["LocalStorage"]

log = logging.getLogger(__name__)


class LocalStorage(Storage):
    """Objects as files under a root directory (see the module docstring)."""

    #: Assumed fast until measured (a network filesystem is measured slow within a few
    #: writes, and codec ``auto`` compresses from then on).
    assumed_write_bps = ASSUMED_WRITE_BPS_LOCAL

    def __init__(self, root: str | os.PathLike[str], options: StorageOptions | None = None) -> None:
        given = Path(os.path.abspath(os.fspath(root)))
        #: The root, resolved once: links above it are the mount's business, none below.
        self.root = Path(os.path.realpath(given))
        self.url = given.as_uri()
        self.options = options or StorageOptions()
        #: Listed entries whose stat failed even after re-reading their directory
        #: (a stale NFS listing, or a concurrent delete).
        self.stale_entries = 0
        #: Symbolic links met while listing: skipped (never followed) and logged.
        self.unsafe_entries = 0
        self._tree = ConfinedTree(self.root)
        self._lock = threading.Lock()
        #: ``O_DIRECT`` for large aligned blob writes (durable writes only).
        self.direct_io = DirectIO(self.options.fsync and self.options.direct_io)

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

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    # -- writing ---------------------------------------------------------------------
    def open_write(self, key: str) -> ObjectWriter:
        path = self._path(key)
        return FileWriter(
            self, self._tree, key, path, fsync=self.options.fsync, direct=self.direct_io
        )

    def commit(self, key: str, data: bytes) -> None:
        with FileWriter(self, self._tree, key, self._path(key), fsync=True) as f:
            f.write(data)

    atomic_create = True

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Temp file, fsync, hard link to the key (EEXIST: taken), fsync the folder.

        A taken key is read back: the same bytes mean our own earlier attempt (an NFS
        client may retransmit a LINK whose reply was lost and then report EEXIST)."""
        try:
            with FileWriter(
                self, self._tree, key, self._path(key), fsync=True, exclusive=True
            ) as f:
                f.write(data)
        except KeyExistsError:
            try:
                return self.read(key, 0, len(data) + 1) == data
            except NotFoundError:  # deleted since: another round decides
                return self.create_exclusive(key, data)
        return True

    # -- reading ---------------------------------------------------------------------
    def _open_object(self, key: str, action: str) -> tuple[int, int]:
        """A descriptor of the regular file behind ``key``, and its size.

        Raises :class:`NotFoundError` (missing, or a folder) and
        :class:`UnsafePathError` (a link on the way, or not a regular file).
        """
        parts = validate_key(key).split("/")
        path = self.root.joinpath(*parts)
        try:
            dfd = self._tree.open_dir(parts[:-1])
        except NotFoundError:
            raise NotFoundError(f"{action} {path}: no such object") from None
        try:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            if stat_mod.S_ISLNK(st.st_mode):
                raise unsafe(path, action, link_text(dfd, parts[-1]))
            check_regular(st, path, action)
            fd = os.open(parts[-1], O_READ, dir_fd=dfd)  # O_NOFOLLOW: no link swapped in
        except StorageError:
            raise
        except OSError as e:
            raise self._tree.error(e, action, path) from e
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            check_regular(st, path, action)  # what we opened, not what we looked at
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be >= 0")
        fd, size = self._open_object(key, "reading")
        # Files are immutable once published: never read more than fstat said, plus one byte.
        want = max(size - start, 0) + 1 if length is None else length
        try:
            with open(fd, "rb", buffering=0) as f:
                if start:
                    f.seek(start)
                parts: builtins.list[bytes] = []
                got = 0
                while got < want:
                    more = f.read(want - got)  # short reads happen on network filesystems
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                return parts[0] if len(parts) == 1 else b"".join(parts)
        except OSError as e:
            raise self._tree.error(e, "reading", self._path(key)) from e

    def read_into(
        self,
        key: str,
        out: memoryview,
        on_block: Callable[[memoryview], object] | None = None,
        block: int = 1 << 20,
    ) -> int:
        fd, size = self._open_object(key, "reading")
        try:
            if size != len(out):
                return size
            got = 0
            while got < size:  # block by block: each hashed while in the cache
                piece = out[got : min(got + block, size)]
                populate(piece)  # fresh staging memory: faulted in by one call
                n = os.preadv(fd, [piece], got)  # short reads happen on network filesystems
                if n <= 0:
                    return got  # it shrank meanwhile: a size mismatch for the caller
                got += n
                if on_block is not None:
                    on_block(piece[:n])
            return size
        except OSError as e:
            raise self._tree.error(e, "reading", self._path(key)) from e
        finally:
            os.close(fd)

    def open_read(self, key: str) -> BinaryIO:
        fd, _ = self._open_object(key, "opening")
        # The name stays the path (for messages); the opener hands over our descriptor.
        return open(self._path(key), "rb", opener=lambda _p, _f: fd)

    @contextlib.contextmanager
    def read_view(self, key: str) -> Iterator[memoryview]:
        """The object memory-mapped (no copy), valid inside the ``with`` block."""
        fd, size = self._open_object(key, "reading")
        try:
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            raise self._tree.error(e, "mapping", self._path(key)) from e
        finally:
            os.close(fd)
        if mm is None:
            yield memoryview(b"")
            return
        view = memoryview(mm)
        try:
            yield view
        finally:
            try:
                view.release()
                mm.close()
            except BufferError:
                # A view cut from it is still referenced (by an exception's traceback):
                # closing now would replace that exception; the mapping goes with the view.
                pass

    def stat(self, key: str) -> ObjectInfo:
        parts = validate_key(key).split("/")
        path = self.root.joinpath(*parts)
        try:
            dfd = self._tree.open_dir(parts[:-1])
        except NotFoundError:
            raise NotFoundError(f"stat {path}: no such object") from None
        try:
            st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            if stat_mod.S_ISLNK(st.st_mode):
                raise unsafe(path, "stat", link_text(dfd, parts[-1]))
        except OSError as e:
            raise self._tree.error(e, "stat", path) from e
        finally:
            os.close(dfd)
        check_regular(st, path, "stat")
        return ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)

    # -- listing ---------------------------------------------------------------------
    def list(self, prefix: str = "", *, delimiter: str | None = None) -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        if delimiter is not None and delimiter != "/":
            return _collapse(self.list(prefix), prefix, delimiter)
        dir_part, _, name_prefix = prefix.rpartition("/")
        parts = dir_part.split("/") if dir_part else []
        return self._list(parts, name_prefix, recursive=delimiter is None)

    def _list(
        self, parts: builtins.list[str], name_prefix: str, *, recursive: bool
    ) -> Iterator[ObjectInfo]:
        try:
            fd = self._tree.open_dir(parts)
        except NotFoundError:
            return
        yield from self._walk(fd, parts, name_prefix, recursive=recursive)

    def _walk(
        self, fd: int, parts: builtins.list[str], name_prefix: str, *, recursive: bool
    ) -> Iterator[ObjectInfo]:
        """Objects in the folder ``fd`` (closed when done), in key order."""
        directory = self.root.joinpath(*parts)
        key_prefix = "".join(p + "/" for p in parts)
        try:
            for name, st in self._scan(fd, directory):
                if not name.startswith(name_prefix):
                    continue
                key = key_prefix + name
                if not stat_mod.S_ISDIR(st.st_mode):
                    yield ObjectInfo(key=key, size=st.st_size, mtime=st.st_mtime)
                    continue
                try:
                    sub, _ = self._tree.subdir(fd, name, directory / name)
                except NotFoundError:
                    continue  # deleted meanwhile
                if recursive:
                    yield from self._walk(sub, [*parts, name], "", recursive=True)
                    continue
                try:
                    found = self._has_objects(sub, directory / name)
                finally:
                    os.close(sub)
                if found:
                    yield ObjectInfo(key=key + "/", size=0)
        finally:
            os.close(fd)

    def _scan(self, fd: int, directory: Path) -> builtins.list[tuple[str, os.stat_result]]:
        """One folder's files and subfolders in key order, lstat'ed; re-read once if stale.

        Links, FIFOs, sockets and devices are not objects: skipped (links reported).
        """
        for attempt in (1, 2):
            try:
                with os.scandir(fd) as it:
                    names = [e.name for e in it if not e.name.startswith(TEMP_PREFIX)]
            except OSError as e:
                raise self._tree.error(e, "listing", directory) from e
            out: builtins.list[tuple[str, os.stat_result]] = []
            gone: builtins.list[str] = []
            for name in names:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    gone.append(name)
                    continue
                except OSError as e:
                    if e.errno == errno.ESTALE:
                        gone.append(name)
                        continue
                    raise self._tree.error(e, "stat", directory / name) from e
                if stat_mod.S_ISLNK(st.st_mode):
                    self._skip_link(fd, name, directory)
                elif stat_mod.S_ISDIR(st.st_mode) or stat_mod.S_ISREG(st.st_mode):
                    out.append((name, st))
            if not gone:
                break
            if attempt == 2:
                with self._lock:
                    self.stale_entries += len(gone)
                log.warning(
                    "stale listing in %s: %d entr%s listed but gone (%s); skipped. On NFS "
                    "mount with actimeo=0 or lookupcache=positive.",
                    clean(directory),
                    len(gone),
                    "y" if len(gone) == 1 else "ies",
                    clean(", ".join(gone[:5])),
                )
        out.sort(key=lambda t: t[0] + "/" if stat_mod.S_ISDIR(t[1].st_mode) else t[0])
        return out

    def _skip_link(self, fd: int, name: str, directory: Path) -> None:
        with self._lock:
            self.unsafe_entries += 1
        log.warning(
            "listing %s: skipped %s, %s: never followed. Whoever can write the checkpoint "
            "volume planted it: remove it.",
            clean(directory),
            clean(name),
            clean(link_text(fd, name)),
        )

    def _has_objects(self, fd: int, directory: Path) -> bool:
        """Whether the folder ``fd`` holds an object at any depth (links are not objects)."""
        try:
            with os.scandir(fd) as it:
                names = [e.name for e in it if not e.name.startswith(TEMP_PREFIX)]
        except OSError:
            return False
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat_mod.S_ISLNK(st.st_mode):
                self._skip_link(fd, name, directory)
            elif stat_mod.S_ISREG(st.st_mode):
                return True
            elif stat_mod.S_ISDIR(st.st_mode):
                try:
                    sub, _ = self._tree.subdir(fd, name, directory / name)
                except NotFoundError:
                    continue
                try:
                    if self._has_objects(sub, directory / name):
                        return True
                finally:
                    os.close(sub)
        return False

    # -- deleting --------------------------------------------------------------------
    def delete(self, key: str) -> None:
        parts = validate_key(key).split("/")
        try:
            fds, _ = self._tree.chain(parts[:-1])
        except NotFoundError:
            return
        try:
            if (
                unlink_entry(self._tree, fds[-1], parts[-1], self.root.joinpath(*parts))
                and self.options.fsync
            ):
                self._tree.fsync_fd(fds[-1], self.root.joinpath(*parts[:-1]))
            prune(fds, parts[:-1])
        finally:
            close_all(fds)

    def delete_prefix(self, prefix: str) -> int:
        validate_prefix(prefix)
        dir_part, _, name_prefix = prefix.rpartition("/")
        parts = dir_part.split("/") if dir_part else []
        try:
            fds, _ = self._tree.chain(parts)
        except NotFoundError:
            return 0
        try:
            n = delete_tree(self._tree, fds[-1], parts, name_prefix, fsync=self.options.fsync)
            prune(fds, parts)
        finally:
            close_all(fds)
        return n


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
