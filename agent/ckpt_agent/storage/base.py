"""The storage interface every backend implements.

The engine and the operator talk to storage only through :class:`Storage`.
Backends live one per module or package (``fs.py``, ``s3/``) and are chosen by URL
scheme (see :func:`ckpt_agent.storage.open_storage`). Keys are ``/``-separated
relative paths under the backend's root (see :func:`validate_key`); backends
never interpret them.

Commit protocol: a checkpoint's payload blobs are written with :meth:`write`
(or :meth:`open_write`); the manifest is published *last* with
:meth:`commit`, which is atomic: readers either see the whole object or none.
Anything without a committed manifest does not exist for readers.

Call order for one checkpoint (any number of threads may write different keys
concurrently; one key has one writer at a time)::

    for blob in payload:                 # ranks in parallel
        with storage.open_write(blob_key) as f:   # or storage.write(key, data)
            f.write(...)                 # streaming; published atomically on close
    storage.commit(manifest_key, data)   # last: the checkpoint now exists

:meth:`Storage.create_exclusive` is the one conditional write: it publishes like
``commit`` but only where nothing exists yet (claims of a run's writer generations,
``COMMIT`` files; see docs/security.md, "Fencing").

Errors: every failure is a :class:`StorageError`. :class:`PermanentStorageError`
means retrying cannot help and its message says what to fix;
:class:`RetryableStorageError` means the backend already retried (where it
retries) and the caller may try again later; :class:`NotFoundError` is a
missing key. After a failed write nothing was published under the key.

Observability: each completed write/commit records how long the backend spent
on it in :attr:`Storage.last_write_latency_s` and calls
:attr:`Storage.on_write_latency` (the scheduler's system layer hooks in here).
"""

from __future__ import annotations

import abc
import builtins
import contextlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, BinaryIO, Self

from ckpt_agent.errors import (
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageError,
    UnsafePathError,
)
from ckpt_agent.text import clean
from ckpt_agent.tuning import ASSUMED_WRITE_BPS_REMOTE

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from ckpt_agent.storage.options import StorageOptions

__all__ = ["ObjectInfo", "ObjectWriter", "Storage", "WriteLatencyHook", "validate_key"]

log = logging.getLogger(__name__)

#: Serializes the default :meth:`Storage.create_exclusive` (in-process stores only).
_EXCLUSIVE_LOCK = threading.Lock()

#: Reserved name prefix for in-flight temporary objects; keys may not use it.
TEMP_PREFIX = ".ckpt-tmp."


@dataclass(frozen=True)
class ObjectInfo:
    """What :meth:`Storage.stat` and :meth:`Storage.list` report about one object."""

    key: str
    size: int
    mtime: float | None = None

    @property
    def is_prefix(self) -> bool:
        """A "directory" returned by a delimiter listing (its key ends with ``/``)."""
        return self.key.endswith("/")


#: Called with the seconds a completed write or commit spent in the backend.
WriteLatencyHook = Callable[[float], None]


def validate_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise :class:`PermanentStorageError`.

    Valid: non-empty, ``/``-separated, relative (no leading ``/``), no empty,
    ``.`` or ``..`` segments, no NUL or backslash, no segment starting with
    the reserved temp prefix, at most 1024 UTF-8 bytes (the S3 limit).
    """
    if not isinstance(key, str) or not key:
        raise PermanentStorageError(f"invalid key {key!r}: keys are non-empty strings")
    if key.startswith("/") or key.endswith("/"):
        raise PermanentStorageError(
            f"invalid key {key!r}: keys are relative paths without a leading or trailing '/'"
        )
    if "\x00" in key or "\\" in key:
        raise PermanentStorageError(f"invalid key {key!r}: NUL and backslash are not allowed")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise PermanentStorageError(
                f"invalid key {key!r}: empty, '.' and '..' path segments are not allowed"
            )
        if seg.startswith(TEMP_PREFIX):
            raise PermanentStorageError(
                f"invalid key {key!r}: segments starting with {TEMP_PREFIX!r} are reserved"
            )
    if len(key.encode("utf-8")) > 1024:
        raise PermanentStorageError(f"invalid key {key[:64]!r}...: longer than 1024 bytes")
    return key


def delete_failures(failed: Sequence[tuple[str, StorageError]], total: int) -> StorageError:
    """One error for the keys :meth:`Storage.delete_many` could not delete: retryable
    when every failure was, else permanent; names the first few keys and why."""
    shown = "; ".join(f"{k}: {e}" for k, e in failed[:3])
    more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
    msg = f"{len(failed)} of {total} key(s) not deleted: {shown}{more}"
    if any(isinstance(e, UnsafePathError) for _, e in failed):
        # a planted link is a security finding: callers (and people) must see it as one
        return UnsafePathError(msg + "; the rest were deleted")
    if all(isinstance(e, RetryableStorageError) for _, e in failed):
        return RetryableStorageError(msg + "; the rest were deleted, try again later")
    return PermanentStorageError(msg + "; the rest were deleted")


def validate_prefix(prefix: str) -> str:
    """Listing prefixes: like keys, but empty and a trailing ``/`` are fine."""
    if prefix:
        body = prefix[:-1] if prefix.endswith("/") else prefix
        if body:
            validate_key(body)
        elif prefix == "/":
            raise PermanentStorageError("invalid prefix '/': prefixes are relative")
    return prefix


class ObjectWriter(io.BufferedIOBase, BinaryIO):
    """A write-only stream whose object is published atomically by :meth:`close`.

    * ``close()`` (or leaving a ``with`` block normally) publishes the object;
      if publishing fails, partial data is cleaned up and the error raised.
    * Leaving a ``with`` block by an exception, :meth:`abort`, or dropping the
      writer without closing it publishes nothing and cleans up.

    Subclasses implement :meth:`_write`, :meth:`_publish` and :meth:`_discard`.
    The time spent inside ``write``/``close`` (not the caller's time between
    writes) is reported to the storage as the write latency.
    """

    def __init__(self, storage: Storage, key: str) -> None:
        super().__init__()
        self.key = key
        self._storage = storage
        self._busy_s = 0.0
        self._nbytes = 0
        self._finished = False

    # -- to implement --------------------------------------------------------
    @abc.abstractmethod
    def _write(self, data: memoryview) -> None:
        """Take all of ``data`` (may block for back-pressure)."""

    @abc.abstractmethod
    def _publish(self) -> None:
        """Make the object visible atomically and durably."""

    @abc.abstractmethod
    def _discard(self) -> None:
        """Remove partial data; must be safe to call more than once."""

    # -- io protocol ------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._nbytes

    @property
    def mode(self) -> str:
        return "wb"

    @property
    def name(self) -> str:
        return self.key

    def write(self, data: ReadableBuffer) -> int:
        if self.closed:
            raise ValueError(f"write to a closed writer for {self.key!r}")
        mv = memoryview(data).cast("B")
        n = len(mv)
        if n:
            t0 = time.perf_counter()
            try:
                self._write(mv)
            except BaseException:
                self.abort()
                raise
            finally:
                self._busy_s += time.perf_counter() - t0
            self._nbytes += n
        return n

    def close(self) -> None:
        if self.closed:
            return
        if self._finished:  # aborted
            super().close()
            return
        self._finished = True
        t0 = time.perf_counter()
        try:
            self._publish()
        except BaseException:
            try:
                self._discard()
            except Exception:  # the publish error is the one to report
                log.warning(
                    "cleanup after a failed write of %s failed", clean(self.key), exc_info=True
                )
            raise
        finally:
            super().close()
        self._busy_s += time.perf_counter() - t0
        self._storage._record_write(self.key, self._busy_s, self._nbytes)

    def abort(self) -> None:
        """Publish nothing and remove partial data (idempotent)."""
        if self._finished:
            if not self.closed:
                super().close()
            return
        self._finished = True
        try:
            self._discard()
        finally:
            super().close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        # io.IOBase.__del__ would call close() and so *publish* a partial object.
        if not getattr(self, "_finished", True):
            try:
                self.abort()
            except Exception:
                pass


class Storage(abc.ABC):
    """A flat key/value object store with an atomic publish primitive.

    Thread-safe: one instance may be shared by the threads of a process.
    """

    #: URL this backend was opened with (``file:///x`` or ``s3://bucket/prefix``).
    url: str

    #: Seconds the most recent completed write/commit spent in the backend.
    last_write_latency_s: float | None = None
    #: Bytes of the most recent completed write/commit.
    last_write_bytes: int = 0
    #: Called after each completed write/commit with its latency in seconds (from the
    #: writing thread; keep it cheap, exceptions are logged and ignored).
    on_write_latency: WriteLatencyHook | None = None
    #: Write throughput (bytes/s) to assume before the writer has timed a write of its
    #: own (codec ``auto``): "slow" unless a backend knows better (a local filesystem).
    assumed_write_bps: float = ASSUMED_WRITE_BPS_REMOTE

    @classmethod
    def from_url(cls, url: str, options: StorageOptions | None = None) -> Storage:
        """Open the backend for ``url`` (used by :func:`ckpt_agent.storage.open_storage`)."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_url()")

    @abc.abstractmethod
    def open_write(self, key: str) -> ObjectWriter:
        """Stream bytes to ``key``; the object appears (atomically) on ``close()``.

        On an exception inside a ``with`` block nothing is published and
        partial data is cleaned up (temp file removed / multipart aborted);
        :meth:`ObjectWriter.abort` does the same explicitly. An existing object
        under ``key`` is replaced atomically. (An :class:`ObjectWriter` is a
        ``BinaryIO``.)
        """

    def write(self, key: str, data: bytes | memoryview) -> None:
        """Write a whole object atomically."""
        with self.open_write(key) as f:
            f.write(data)

    @abc.abstractmethod
    def commit(self, key: str, data: bytes) -> None:
        """Publish a small object (a manifest / commit marker) atomically and durably.

        After it returns, every reader sees the object; before it, none does.
        """

    #: Whether :meth:`create_exclusive` is atomic across processes and machines (the
    #: filesystem: a hard link; S3: a conditional PUT). The default implementation is
    #: atomic only among the users of this process's backends (an in-memory store).
    atomic_create: bool = False

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """Publish a small object like :meth:`commit`, but only if ``key`` holds none.

        True when this call created it, or when ``key`` already holds exactly ``data``
        (a retried request whose first attempt did create it: callers that must know
        they won put something unique in ``data``); False when another object is
        there, which is left untouched. Atomic where :attr:`atomic_create` says so:
        of two concurrent calls with different data exactly one returns True. The
        default (check, then commit, under a process-wide lock) is for in-process
        stores; backends shared between processes override it.
        """
        with _EXCLUSIVE_LOCK:
            try:
                existing = self.read(key)
            except NotFoundError:
                self.commit(key, data)
                return True
            return existing == data

    @abc.abstractmethod
    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes from ``start`` (the whole rest when ``None``).

        Reading past the end returns fewer bytes (``b""`` from beyond the end).
        """

    def read_view(self, key: str) -> contextlib.AbstractContextManager[memoryview]:
        """The whole object as a read-only view, valid inside the ``with`` block.

        ``with storage.read_view(key) as view: ...``. The default reads the
        object into memory; a backend that can map it (the filesystem) overrides
        this to serve it without a copy. Raises :class:`NotFoundError`.
        """
        return contextlib.nullcontext(memoryview(self.read(key)))

    def read_into(
        self,
        key: str,
        out: memoryview,
        on_block: Callable[[memoryview], object] | None = None,
        block: int = 1 << 20,
    ) -> int:
        """Read the object into ``out`` when it has exactly ``len(out)`` bytes; return the
        number of bytes it has (anything else: nothing is read, the caller says why).

        ``on_block`` sees each filled block of ``out`` in order, while it is still in the
        CPU cache (a hash). The default copies from :meth:`read_view`; the filesystem reads
        straight into ``out`` (no mapping: a mapping per object serializes the page faults
        of concurrent readers). Raises :class:`NotFoundError`.
        """
        with self.read_view(key) as view:
            if len(view) != len(out):
                return len(view)
            for start in range(0, len(out), block):
                piece = out[start : start + block]
                piece[:] = view[start : start + block]
                if on_block is not None:
                    on_block(piece)
            return len(view)

    @abc.abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A streaming, seekable reader over the object; raises :class:`NotFoundError`."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime; raises :class:`NotFoundError`."""

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except NotFoundError:
            return False
        return True

    @abc.abstractmethod
    def list(self, prefix: str = "", *, delimiter: str | None = None) -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, in key order, paginated lazily.

        With ``delimiter="/"`` only the next path level is returned; "directories"
        come back as ``ObjectInfo(key="a/b/", size=0)``. In-flight (uncommitted)
        writes never appear.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete every key in ``keys`` (missing ones are not an error); returns how many
        keys were asked to be deleted.

        Order is not kept: a caller whose deletes must be ordered (a checkpoint's
        ``COMMIT`` before the rest of its folder) calls this once per stage. The default
        deletes one key at a time; S3 sends ``DeleteObjects`` (up to 1000 keys a request).
        When some key cannot be deleted, the others are still tried and then a
        :class:`StorageError` names the ones that failed.
        """
        n = 0
        failed: builtins.list[tuple[str, StorageError]] = []
        for key in keys:
            try:
                self.delete(key)
            except NotFoundError:
                pass
            except StorageError as e:
                failed.append((key, e))
            n += 1
        if failed:
            raise delete_failures(failed, n)
        return n

    def delete_prefix(self, prefix: str) -> int:
        """Delete everything under ``prefix``; returns how many objects were deleted."""
        n = 0
        for info in list(self.list(prefix)):
            self.delete(info.key)
            n += 1
        return n

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections/threads."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- for backends ---------------------------------------------------------------
    def _record_write(self, key: str, seconds: float, nbytes: int) -> None:
        """Backends call this after each completed write/commit."""
        self.last_write_latency_s = seconds
        self.last_write_bytes = nbytes
        hook = self.on_write_latency
        if hook is not None:
            try:
                hook(seconds)
            except Exception:
                log.warning("on_write_latency hook failed", exc_info=True)
