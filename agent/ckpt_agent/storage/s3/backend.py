"""The S3 backend: :class:`S3Storage` (requests with the retry policy, reads, listing, deletes).

See :mod:`ckpt_agent.storage.s3` for the behaviour; streaming writes and
resumable reads are in :mod:`ckpt_agent.storage.s3.transfer`.
"""

from __future__ import annotations

import collections
import heapq
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar
from urllib.parse import urlsplit

import boto3
from botocore.config import Config

from ckpt_agent.storage.base import (
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
from ckpt_agent.storage.options import S3_MIN_PART_SIZE, StorageOptions
from ckpt_agent.storage.s3.failures import HINTS, backoff_s, classify_error, with_code
from ckpt_agent.storage.s3.transfer import S3Reader, S3Writer

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

__all__ = ["S3Storage"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        self._client: S3Client = client if client is not None else _make_client(opts)
        self._endpoint = self._client.meta.endpoint_url
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._bucket_checked = False
        #: Requests sent per operation name (attempts, retries included).
        self.calls: collections.Counter[str] = collections.Counter()
        #: Attempts that failed with a retryable error and were retried.
        self.retries = 0

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
        where = f" at {self._endpoint}" if self.options.endpoint_url else ""
        return f"S3Storage({self.url!r}{where})"

    @property
    def client(self) -> S3Client:
        """The underlying boto3 client (for tools and tests)."""
        return self._client

    # -- helpers -----------------------------------------------------------------------
    def _full(self, key: str) -> str:
        return self._root_prefix + validate_key(key)

    def _where(self, key: str | None) -> str:
        obj = f"s3://{self.bucket}/{self._root_prefix}{key or ''}"
        return f"{obj} at {self._endpoint}" if self.options.endpoint_url else obj

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.options.max_concurrency, thread_name_prefix="ckpt-s3"
                )
            return self._pool

    def _sse_args(self) -> dict[str, str]:
        o = self.options
        if o.sse == "none":
            return {}
        args: dict[str, str] = {"ServerSideEncryption": o.sse}
        if o.sse == "aws:kms" and o.kms_key_id:
            args["SSEKMSKeyId"] = o.kms_key_id
        return args

    def classify(self, e: BaseException, op: str, key: str | None = None) -> StorageError | None:
        """Map a boto3/botocore/network exception to the storage taxonomy (None: a bug)."""
        return classify_error(e, f"S3 {op} {self._where(key)}")

    def _backoff(self, attempt: int) -> float:
        return backoff_s(attempt, self.options.backoff_base_s, self.options.backoff_max_s)

    def _call(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run one request with the retry policy; raise a :class:`StorageError`."""
        attempt = 0
        while True:
            attempt += 1
            with self._lock:
                self.calls[op] += 1
            try:
                return fn()
            except Exception as e:
                err = self.classify(e, op, key)
                if err is None:
                    raise
                if isinstance(err, RetryableStorageError):
                    if attempt < self.options.max_attempts:
                        delay = self._backoff(attempt)
                        with self._lock:
                            self.retries += 1
                        log.warning(
                            "%s (attempt %d/%d); retrying in %.2fs",
                            err,
                            attempt,
                            self.options.max_attempts,
                            delay,
                        )
                        time.sleep(delay)
                        continue
                    err = with_code(
                        RetryableStorageError(f"{err}; gave up after {attempt} attempt(s)"),
                        err.code,
                    )
                raise err from e

    def _check_bucket(self) -> None:
        """After an ambiguous 404/403 on HEAD: is the bucket itself there and reachable?"""
        if self._bucket_checked:
            return
        try:
            self._call("HeadBucket", None, lambda: self._client.head_bucket(Bucket=self.bucket))
        except NotFoundError:
            raise with_code(
                PermanentStorageError(
                    f"S3 HeadBucket {self._where(None)}: NoSuchBucket. {HINTS['NoSuchBucket']}"
                ),
                "NoSuchBucket",
            ) from None
        except PermanentStorageError:
            # HEAD responses carry no error code: ask a call that does (ListObjectsV2).
            self._call(
                "ListObjectsV2",
                None,
                lambda: self._client.list_objects_v2(
                    Bucket=self.bucket, Prefix=self._root_prefix, MaxKeys=1
                ),
            )
            raise
        self._bucket_checked = True

    # -- Storage API ----------------------------------------------------------------
    def check(self) -> None:
        """Fail fast with a :class:`PermanentStorageError` if the bucket is unusable."""
        self._bucket_checked = False
        self._check_bucket()

    def open_write(self, key: str) -> ObjectWriter:
        return S3Writer(self, key)

    def _put(self, key: str, data: bytes | bytearray) -> None:
        full = self._full(key)
        sse = self._sse_args()
        body = bytes(data)
        self._call(
            "PutObject",
            key,
            lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=body, **sse),  # type: ignore[arg-type]
        )

    def commit(self, key: str, data: bytes) -> None:
        t0 = time.perf_counter()
        self._put(key, data)
        self._record_write(key, time.perf_counter() - t0, len(data))

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        if start < 0 or (length is not None and length < 0):
            raise ValueError("start and length must be >= 0")
        full = self._full(key)
        if length == 0:
            self.stat(key)
            return b""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            kwargs["Range"] = f"bytes={start}-{end}"

        def get() -> bytes:
            resp = self._client.get_object(**kwargs)
            with resp["Body"] as body:
                if length is None:
                    return body.read()
                # Never trust the server to honour Range: read at most one byte past it.
                data: bytes = body.read(length + 1)
            if len(data) <= length:
                return data
            if start:  # a whole object where a part of it was asked: the bytes are wrong
                raise PermanentStorageError(
                    f"S3 GetObject {self._where(key)}: the endpoint ignored the Range header "
                    "(sent more than was asked): use an S3-compatible endpoint that honours it"
                )
            return data[:length]

        try:
            return self._call("GetObject", key, get)
        except PermanentStorageError as e:
            if e.code == "InvalidRange":  # start at/after the end
                return b""
            raise

    def open_read(self, key: str) -> BinaryIO:
        info = self._head(key)
        raw = S3Reader(self, key, info.size, info.etag)
        return io.BufferedReader(raw, buffer_size=1024 * 1024)

    def _head(self, key: str) -> _Head:
        full = self._full(key)
        try:
            resp = self._call(
                "HeadObject", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full)
            )
        except (NotFoundError, PermanentStorageError):
            self._check_bucket()  # turns a missing bucket / bad credentials into a clear error
            raise
        return _Head(
            key, int(resp["ContentLength"]), resp["LastModified"].timestamp(), resp.get("ETag")
        )

    def stat(self, key: str) -> ObjectInfo:
        h = self._head(key)
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
        while True:
            resp = self._call(
                "ListObjectsV2", prefix, lambda: self._client.list_objects_v2(**kwargs)
            )
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
        full = self._full(key)
        self._call(
            "DeleteObject", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full)
        )

    def delete_prefix(self, prefix: str) -> int:
        """Batch delete (DeleteObjects, 1000 keys a request)."""
        n = 0
        batch: list[str] = []

        def flush() -> None:
            nonlocal n
            objs: Any = [{"Key": self._root_prefix + k} for k in batch]
            resp = self._call(
                "DeleteObjects",
                prefix,
                lambda: self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": objs, "Quiet": True}
                ),
            )
            errors = resp.get("Errors", [])
            if errors:
                first = errors[0]
                raise PermanentStorageError(
                    f"S3 DeleteObjects {self._where(prefix)}: {len(errors)} key(s) not deleted, "
                    f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )
            n += len(batch)
            batch.clear()

        for info in list(self.list(prefix)):
            batch.append(info.key)
            if len(batch) == 1000:
                flush()
        if batch:
            flush()
        return n

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()


class _Head:
    __slots__ = ("etag", "key", "mtime", "size")

    def __init__(self, key: str, size: int, mtime: float, etag: str | None) -> None:
        self.key, self.size, self.mtime, self.etag = key, size, mtime, etag


def _make_client(opts: StorageOptions) -> S3Client:
    session = boto3.session.Session(
        aws_access_key_id=opts.access_key_id,
        aws_secret_access_key=opts.secret_access_key,
        aws_session_token=opts.session_token,
        region_name=opts.region,
        profile_name=opts.profile,
    )
    config = Config(
        signature_version="s3v4",
        connect_timeout=opts.connect_timeout_s,
        read_timeout=opts.read_timeout_s,
        retries={"total_max_attempts": 1, "mode": "standard"},  # we retry ourselves
        max_pool_connections=max(10, 2 * opts.max_concurrency + 2),
        s3={"addressing_style": "path" if opts.use_path_style else "auto"},
        request_checksum_calculation=opts.checksums,
        response_checksum_validation=opts.checksums,
        tcp_keepalive=True,
    )
    return session.client("s3", endpoint_url=opts.endpoint_url, config=config)
