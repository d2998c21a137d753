"""The S3 backend: :class:`S3Storage` (the :class:`Storage` API: reads, listing, deletes).

See :mod:`ckpt_agent.storage.s3` for the behaviour. Requests and their retry
policy are in :mod:`ckpt_agent.storage.s3.client`; streaming writes and
resumable reads in :mod:`ckpt_agent.storage.s3.transfer`.
"""

from __future__ import annotations

import collections
import heapq
import io
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

from botocore.exceptions import ClientError

from ckpt_agent.errors import NotFoundError, PermanentStorageError, StorageError
from ckpt_agent.storage.base import (
    ObjectInfo,
    ObjectWriter,
    Storage,
    delete_failures,
    validate_key,
    validate_prefix,
)
from ckpt_agent.storage.options import S3_MIN_PART_SIZE, StorageOptions
from ckpt_agent.storage.s3.client import BucketClient, make_boto_client
from ckpt_agent.storage.s3.transfer import S3Reader, S3Writer

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

__all__ = ["DELETE_BATCH", "S3Storage"]

log = logging.getLogger(__name__)

#: Keys per ``DeleteObjects`` request (the S3 maximum).
DELETE_BATCH = 1000


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix`` (see the module docstring)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        options: StorageOptions | None = None,
        *,
        client: S3Client | None = None,
    ) -> None:
        if not bucket:
            raise ValueError("S3 storage needs a bucket name")
        opts = options or StorageOptions()
        if opts.part_size_bytes < S3_MIN_PART_SIZE:
            raise ValueError(
                f"part_size_bytes={opts.part_size_bytes} is below the S3 minimum of "
                f"{S3_MIN_PART_SIZE} (5 MiB)"
            )
        self.bucket = bucket
        self.root = prefix.strip("/")
        if self.root:
            validate_key(self.root)
        self._root_prefix = f"{self.root}/" if self.root else ""
        self.url = f"s3://{bucket}/{self.root}" if self.root else f"s3://{bucket}"
        self.options = opts
        #: Whether the server honours ``If-None-Match`` on PUT (None: not yet known).
        self.conditional_put: bool | None = None
        #: Requests to the bucket, under the retry policy (what the transfers use too).
        self.bucket_client = BucketClient(
            bucket, self.root, opts, client if client is not None else make_boto_client(opts)
        )

    @classmethod
    def from_url(cls, url: str, options: StorageOptions | None = None) -> S3Storage:
        parts = urlsplit(url)
        if parts.scheme.lower() != "s3" or not parts.netloc:
            raise ValueError(f"not an S3 URL (s3://bucket/prefix): {url!r}")
        if parts.query or parts.fragment:
            raise ValueError(
                f"S3 URL must not have a query or fragment: {url!r} (use StorageOptions or "
                "CKPT_S3_* variables)"
            )
        return cls(parts.netloc, parts.path, options)

    def __repr__(self) -> str:
        where = f" at {self.bucket_client.endpoint}" if self.options.endpoint_url else ""
        return f"S3Storage({self.url!r}{where})"

    @property
    def client(self) -> S3Client:
        """The underlying boto3 client (for tools and tests)."""
        return self.bucket_client.boto

    @property
    def calls(self) -> collections.Counter[str]:
        """Requests sent per operation name (attempts, retries included)."""
        return self.bucket_client.calls

    @property
    def retries(self) -> int:
        """Attempts that failed with a retryable error and were retried."""
        return self.bucket_client.retries

    def classify(self, e: BaseException, op: str, key: str | None = None) -> StorageError | None:
        """Map a boto3/botocore/network exception to the storage taxonomy (None: a bug)."""
        return self.bucket_client.classify(e, op, key)

    # -- Storage API ----------------------------------------------------------------
    def check(self) -> None:
        """Fail fast with a :class:`PermanentStorageError` if the bucket is unusable."""
        self.bucket_client.check_bucket(again=True)

    def open_write(self, key: str) -> ObjectWriter:
        return S3Writer(self, self.bucket_client, key)

    def commit(self, key: str, data: bytes) -> None:
        t0 = time.perf_counter()
        self.bucket_client.put(key, data)
        self._record_write(key, time.perf_counter() - t0, len(data))

    atomic_create = True

    def create_exclusive(self, key: str, data: bytes) -> bool:
        """A conditional PUT (``If-None-Match: *``): 412 PreconditionFailed means taken.

        A taken key is read back (the same bytes: our own attempt, retried after a lost
        reply). The first call per instance also checks that the server honours the
        header (a second identical conditional PUT must be refused); a server that
        ignores it (an old MinIO, some S3-compatible stores) is logged once and served
        by the fallback: HEAD, PUT, read back (see docs/storage.md: not atomic, a
        window of one round trip).
        """
        if self.conditional_put is False:
            return self._create_fallback(key, data)
        bc = self.bucket_client
        t0 = time.perf_counter()
        try:
            bc.put(key, data, if_none_match=True)
        except PermanentStorageError as e:
            if e.code not in ("PreconditionFailed", "412"):
                raise
            return self._holds(key, data)
        self._record_write(key, time.perf_counter() - t0, len(data))
        if self.conditional_put is None:
            self._probe_conditional_put(key, data)
        return True

    def _probe_conditional_put(self, key: str, data: bytes) -> None:
        try:
            self.bucket_client.put(key, data, if_none_match=True)  # same bytes: harmless
        except PermanentStorageError as e:
            if e.code in ("PreconditionFailed", "412"):
                self.conditional_put = True
                return
            raise
        self.conditional_put = False
        log.warning(
            "%s ignores If-None-Match on PUT: conditional creates fall back to "
            "HEAD + PUT + read-back (not atomic; see docs/storage.md, conditional writes)",
            self.url,
        )

    def _create_fallback(self, key: str, data: bytes) -> bool:
        if self.exists(key):
            return self._holds(key, data)
        self.commit(key, data)
        return self._holds(key, data)

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.read(key, 0, len(data) + 1) == data
        except NotFoundError:  # deleted since: another round decides
            return self.create_exclusive(key, data)

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be >= 0")
        bc = self.bucket_client
        full = bc.full(key)
        if length == 0:
            self.stat(key)
            return b""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            kwargs["Range"] = f"bytes={start}-{end}"

        def get() -> bytes:
            resp = bc.boto.get_object(**kwargs)
            with resp["Body"] as body:
                if length is None:
                    return body.read()
                # Never trust the server to honour Range: read at most one byte past it.
                data: bytes = body.read(length + 1)
            if len(data) <= length:
                return data
            if start:  # a whole object where a part of it was asked: the bytes are wrong
                raise PermanentStorageError(
                    f"S3 GetObject {bc.where(key)}: the endpoint ignored the Range header "
                    "(sent more than was asked): use an S3-compatible endpoint that honours it"
                )
            return data[:length]

        try:
            return bc.call("GetObject", key, get)
        except PermanentStorageError as e:
            if e.code == "InvalidRange":  # start at/after the end
                return b""
            raise

    def open_read(self, key: str) -> BinaryIO:
        info = self.bucket_client.head(key)
        raw = S3Reader(self.bucket_client, key, info.size, info.etag)
        return io.BufferedReader(raw, buffer_size=1024 * 1024)

    def stat(self, key: str) -> ObjectInfo:
        h = self.bucket_client.head(key)
        return ObjectInfo(key=key, size=h.size, mtime=h.mtime)

    def list(self, prefix: str = "", *, delimiter: str | None = None) -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        return self._list(prefix, delimiter)

    def _list(self, prefix: str, delimiter: str | None) -> Iterator[ObjectInfo]:
        strip = len(self._root_prefix)
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": self._root_prefix + prefix,
            "MaxKeys": self.options.list_page_size,
        }
        if delimiter:
            kwargs["Delimiter"] = delimiter
        bc = self.bucket_client
        while True:
            resp = bc.call("ListObjectsV2", prefix, lambda: bc.boto.list_objects_v2(**kwargs))
            objects = [
                ObjectInfo(c["Key"][strip:], int(c["Size"]), c["LastModified"].timestamp())
                for c in resp.get("Contents", [])
                if not c["Key"].endswith("/")  # "directory marker" objects made by some tools
            ]
            prefixes = [ObjectInfo(p["Prefix"][strip:], 0) for p in resp.get("CommonPrefixes", [])]
            yield from heapq.merge(objects, prefixes, key=lambda i: i.key)
            if not resp.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = resp["NextContinuationToken"]

    def delete(self, key: str) -> None:
        bc = self.bucket_client
        full = bc.full(key)
        bc.call("DeleteObject", key, lambda: bc.boto.delete_object(Bucket=self.bucket, Key=full))

    def delete_many(self, keys: Iterable[str]) -> int:
        """``DeleteObjects``, 1000 keys a request; a key the server could not delete is
        reported after every batch was tried (missing keys are deleted as far as S3 goes)."""
        bc = self.bucket_client
        n = 0
        failed: list[tuple[str, StorageError]] = []
        batch: list[str] = []
        strip = len(self._root_prefix)

        def flush() -> None:
            nonlocal n
            objs: Any = [{"Key": bc.full(validate_key(k))} for k in batch]
            first = batch[0]
            resp = bc.call(
                "DeleteObjects",
                first,
                lambda: bc.boto.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": objs, "Quiet": True}
                ),
            )
            for err in resp.get("Errors", []):
                key = str(err.get("Key", ""))[strip:]
                code = str(err.get("Code", ""))
                if code == "NoSuchKey":
                    continue
                where = f"S3 DeleteObjects {bc.where(key)}"
                exc = ClientError(
                    {"Error": {"Code": code, "Message": str(err.get("Message", ""))}},
                    "DeleteObjects",
                )
                failed.append(
                    (
                        key,
                        self.classify(exc, "DeleteObjects", key)
                        or PermanentStorageError(f"{where}: {code}"),
                    )
                )
            n += len(batch)
            batch.clear()

        for key in keys:
            batch.append(key)
            if len(batch) == DELETE_BATCH:
                flush()
        if batch:
            flush()
        if failed:
            raise delete_failures(failed, n)
        return n

    def delete_prefix(self, prefix: str) -> int:
        """Batch delete (DeleteObjects, 1000 keys a request)."""
        return self.delete_many([info.key for info in self.list(prefix)])

    def close(self) -> None:
        self.bucket_client.close()
