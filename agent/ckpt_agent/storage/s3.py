"""S3 and S3-compatible (MinIO, Ceph RGW) backend, through boto3.

URL: ``s3://bucket/prefix``; key ``a/b`` is the object ``prefix/a/b``.

* Writes stream: :meth:`S3Storage.open_write` buffers one part; an object no
  larger than ``part_size_bytes`` goes up in one PUT, a larger one as a
  multipart upload whose parts are uploaded by a thread pool, at most
  ``max_concurrency`` parts in flight per writer (so a writer holds at most
  ``(max_concurrency + 1) * part_size_bytes``). Any failure aborts the multipart
  upload: S3 never shows a partial object.
* ``commit`` is one PUT (atomic on S3): the manifest written last.
* Every request is retried only for retryable failures (timeouts, connection
  errors, 5xx, throttling such as ``SlowDown``), ``max_attempts`` times in all
  with exponential backoff and jitter. botocore's own retries are turned off
  so the budget is exact. Permanent failures (403, ``NoSuchBucket``, invalid
  keys, bad region) fail at once with a message that says what to fix.
* Listing is paginated ListObjectsV2 with ``Prefix`` (and ``Delimiter``), never a
  bucket scan. Reads are ranged GETs; :meth:`S3Storage.open_read` resumes an
  interrupted download at the current offset (``If-Match`` the first ETag, so
  a replaced object is detected, not spliced).
* Server-side encryption: ``sse="AES256"`` (SSE-S3) or ``"aws:kms"`` with an
  optional ``kms_key_id`` (SSE-KMS), applied to every PUT and multipart upload.
"""

from __future__ import annotations

import collections
import heapq
import io
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar
from urllib.parse import urlsplit

try:
    import boto3
    import botocore.exceptions as bexc
    from botocore.config import Config
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "s3:// storage needs boto3: `pip install boto3` (a base dependency of "
        "ckpt-operator; a minimal image may have left it out)"
    ) from _e
import urllib3.exceptions

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
from ckpt_agent.storage.options import S3_MAX_PARTS, S3_MIN_PART_SIZE, StorageOptions

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

__all__ = ["S3Storage"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Error codes worth retrying (besides any 5xx, 408 and 429).
_RETRYABLE_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "SlowDownWrite",
        "SlowDownRead",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "OperationAborted",
        "XMinioServerNotInitialized",
        "XMinioReadQuorum",
        "XMinioWriteQuorum",
    }
)

_CRED_HINT = (
    "Check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or "
    "CKPT_S3_ACCESS_KEY_ID/CKPT_S3_SECRET_ACCESS_KEY from the Secret the operator mounts), "
    "AWS_PROFILE, or the pod's IAM role."
)
_HINTS: dict[str, str] = {
    "AccessDenied": (
        "The credentials are valid but not allowed to do this: grant s3:GetObject, "
        "s3:PutObject, s3:DeleteObject, s3:ListBucket and s3:AbortMultipartUpload on the "
        "bucket and prefix (plus kms:GenerateDataKey and kms:Decrypt on the key with "
        "SSE-KMS). " + _CRED_HINT
    ),
    "InvalidAccessKeyId": "The access key id is unknown to this endpoint. " + _CRED_HINT,
    "SignatureDoesNotMatch": (
        "The secret access key does not match the access key id (or a proxy rewrote the "
        "request). " + _CRED_HINT
    ),
    "ExpiredToken": "The session token has expired: refresh the credentials. " + _CRED_HINT,
    "InvalidToken": "The session token is invalid. " + _CRED_HINT,
    "NoSuchBucket": (
        "The bucket does not exist at this endpoint: create it, or fix the bucket name "
        "in the storage URL (s3://BUCKET/prefix) or CKPT_S3_ENDPOINT_URL."
    ),
    "InvalidBucketName": "The bucket name is not valid: fix the storage URL.",
    "AuthorizationHeaderMalformed": (
        "The request was signed for the wrong region: set CKPT_S3_REGION (or AWS_REGION) "
        "to the bucket's region."
    ),
    "PermanentRedirect": (
        "The bucket lives in another region or must be addressed differently: set "
        "CKPT_S3_REGION to its region (or CKPT_S3_ENDPOINT_URL)."
    ),
    "KeyTooLongError": "The object key is longer than 1024 bytes: use a shorter prefix.",
    "InvalidArgument": "The server rejected an argument (SSE settings? part size?).",
    "EntityTooSmall": "A multipart part was below the server's minimum: raise part_size_bytes.",
    "NotImplemented": (
        "The server does not implement this (SSE without a configured KMS? an S3 feature "
        "missing on this S3-compatible server?)."
    ),
    "KMS.NotFoundException": "The KMS key was not found: fix CKPT_S3_KMS_KEY_ID.",
    "KMS.DisabledException": "The KMS key is disabled: enable it or use another key.",
    "KMSNotConfigured": "The server has no KMS configured: configure one or set CKPT_S3_SSE=none.",
    "RequestTimeTooSkewed": "This machine's clock is off by more than 15 minutes: sync it (NTP).",
}

_STREAM_ERRORS: tuple[type[BaseException], ...] = (
    bexc.ConnectionError,  # EndpointConnectionError, ConnectTimeout, ReadTimeout, ...
    bexc.HTTPClientError,
    bexc.IncompleteReadError,
    bexc.ResponseStreamingError,
    urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError while reading a body
    ConnectionError,  # builtin: reset, refused, aborted
    TimeoutError,
)

_CHECKSUM_FIELDS = (
    "ChecksumCRC32",
    "ChecksumCRC32C",
    "ChecksumCRC64NVME",
    "ChecksumSHA1",
    "ChecksumSHA256",
)


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
        where = f"S3 {op} {self._where(key)}"
        if isinstance(e, StorageError):
            return e
        if isinstance(e, bexc.ClientError):
            err: dict[str, Any] = dict(e.response.get("Error", {}))
            code = str(err.get("Code", ""))
            msg = str(err.get("Message", "")).strip()
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in ("NoSuchKey", "404", "NotFound"):
                return NotFoundError(f"{where}: no such object")
            if code in _RETRYABLE_CODES or status >= 500 or status in (408, 429):
                return RetryableStorageError(f"{where}: {code or status} {msg} (HTTP {status})")
            if code == "403" or (status == 403 and code not in _HINTS):
                code = "AccessDenied"
            hint = _HINTS.get(code, "")
            detail = f"{code}: {msg}" if msg else code or f"HTTP {status}"
            return PermanentStorageError(f"{where}: {detail}. {hint}".rstrip(". ") + ".")
        if isinstance(e, bexc.NoCredentialsError | bexc.PartialCredentialsError):
            return PermanentStorageError(f"{where}: no usable credentials found. {_CRED_HINT}")
        if isinstance(e, bexc.ParamValidationError):
            return PermanentStorageError(f"{where}: invalid request: {e}")
        if isinstance(e, _STREAM_ERRORS):
            return RetryableStorageError(f"{where}: {type(e).__name__}: {e}")
        if isinstance(e, bexc.BotoCoreError):
            return PermanentStorageError(f"{where}: {type(e).__name__}: {e}")
        return None

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with "equal jitter": half fixed, half random."""
        cap = min(self.options.backoff_max_s, self.options.backoff_base_s * 2 ** (attempt - 1))
        return float(cap / 2 + random.uniform(0, cap / 2))

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
                    err = RetryableStorageError(f"{err}; gave up after {attempt} attempt(s)")
                raise err from e

    def _check_bucket(self) -> None:
        """After an ambiguous 404/403 on HEAD: is the bucket itself there and reachable?"""
        if self._bucket_checked:
            return
        try:
            self._call("HeadBucket", None, lambda: self._client.head_bucket(Bucket=self.bucket))
        except NotFoundError:
            raise PermanentStorageError(
                f"S3 HeadBucket {self._where(None)}: NoSuchBucket. {_HINTS['NoSuchBucket']}"
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
        return _S3Writer(self, key)

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
                return body.read()

        try:
            return self._call("GetObject", key, get)
        except PermanentStorageError as e:
            if "InvalidRange" in str(e):  # start at/after the end
                return b""
            raise

    def open_read(self, key: str) -> BinaryIO:
        info = self._head(key)
        raw = _S3Reader(self, key, info.size, info.etag)
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


class _S3Writer(ObjectWriter):
    """One PUT for small objects; a bounded, parallel multipart upload for large ones."""

    def __init__(self, storage: S3Storage, key: str) -> None:
        super().__init__(storage, key)
        self._s3 = storage
        self._full = storage._full(key)
        self._part_size = storage.options.part_size_bytes
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._next_part = 1
        self._parts: dict[int, CompletedPartTypeDef] = {}
        self._futures: list[Future[None]] = []
        self._slots = threading.BoundedSemaphore(storage.options.max_concurrency)
        self._failure: BaseException | None = None
        self._flock = threading.Lock()

    def _raise_failure(self) -> None:
        with self._flock:
            failure = self._failure
        if failure is not None:
            raise failure

    def _write(self, data: memoryview) -> None:
        self._raise_failure()
        while data:
            take = data[: self._part_size - len(self._buf)]
            self._buf += take
            data = data[len(take) :]
            if len(self._buf) >= self._part_size:
                part = bytes(self._buf)  # the one copy; the buffer is reused
                self._buf.clear()
                self._ship(part)

    def _start_multipart(self) -> str:
        s3 = self._s3
        extra: dict[str, Any] = dict(s3._sse_args())
        if s3.options.checksums == "when_supported":
            extra["ChecksumAlgorithm"] = "CRC32"
        resp = s3._call(
            "CreateMultipartUpload",
            self.key,
            lambda: s3._client.create_multipart_upload(Bucket=s3.bucket, Key=self._full, **extra),
        )
        return resp["UploadId"]

    def _ship(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._start_multipart()
        if self._next_part > S3_MAX_PARTS:
            raise PermanentStorageError(
                f"S3 {self._s3._where(self.key)}: more than {S3_MAX_PARTS} parts; raise "
                "part_size_bytes (CKPT_S3_PART_SIZE) for objects this large"
            )
        # Back-pressure: at most max_concurrency parts in flight (bounded memory).
        while not self._slots.acquire(timeout=0.2):
            self._raise_failure()
        try:
            self._raise_failure()
            number = self._next_part
            self._next_part += 1
            fut = self._s3._executor().submit(self._upload_part, self._upload_id, number, part)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        self._futures.append(fut)

    def _upload_part(self, upload_id: str, number: int, body: bytes) -> None:
        s3 = self._s3
        try:
            resp = s3._call(
                "UploadPart",
                self.key,
                lambda: s3._client.upload_part(
                    Bucket=s3.bucket,
                    Key=self._full,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body,
                ),
            )
            done: dict[str, Any] = {"PartNumber": number, "ETag": resp["ETag"]}
            for name in _CHECKSUM_FIELDS:
                if resp.get(name):
                    done[name] = resp[name]  # type: ignore[literal-required]
            with self._flock:
                self._parts[number] = done  # type: ignore[assignment]
        except BaseException as e:
            with self._flock:
                if self._failure is None:
                    self._failure = e
            raise

    def _publish(self) -> None:
        s3 = self._s3
        self._raise_failure()
        if self._upload_id is None:
            s3._put(self.key, self._buf)
            self._buf = bytearray()
            return
        if self._buf:
            part = bytes(self._buf)
            self._buf = bytearray()
            self._ship(part)
        wait_futures(self._futures)
        self._raise_failure()
        if len(self._parts) != self._next_part - 1:  # a cancelled part: storage closed?
            raise RetryableStorageError(
                f"S3 {s3._where(self.key)}: {self._next_part - 1 - len(self._parts)} part(s) "
                "were cancelled before upload (was the storage closed during the write?)"
            )
        parts = [self._parts[n] for n in sorted(self._parts)]
        upload_id = self._upload_id
        try:
            s3._call(
                "CompleteMultipartUpload",
                self.key,
                lambda: s3._client.complete_multipart_upload(
                    Bucket=s3.bucket,
                    Key=self._full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
        except PermanentStorageError as e:
            # A retried Complete whose first attempt succeeded answers NoSuchUpload.
            if "NoSuchUpload" not in str(e) or not self._completed_already(len(parts)):
                raise
        self._upload_id = None  # nothing left to abort

    def _completed_already(self, nparts: int) -> bool:
        try:
            head = self._s3._head(self.key)
        except StorageError:
            return False
        return bool(head.etag and head.etag.strip('"').endswith(f"-{nparts}"))

    def _discard(self) -> None:
        self._buf = bytearray()
        for f in self._futures:
            f.cancel()
        wait_futures(self._futures)
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is None:
            return
        s3 = self._s3
        try:
            s3._call(
                "AbortMultipartUpload",
                self.key,
                lambda: s3._client.abort_multipart_upload(
                    Bucket=s3.bucket, Key=self._full, UploadId=upload_id
                ),
            )
        except NotFoundError:
            pass
        except StorageError as e:
            log.warning(
                "could not abort multipart upload %s of %s (%s); its parts stay until a "
                "lifecycle rule AbortIncompleteMultipartUpload removes them",
                upload_id,
                s3._where(self.key),
                e,
            )


class _S3Reader(io.RawIOBase):
    """Seekable ranged-GET reader that resumes after a dropped connection."""

    def __init__(self, storage: S3Storage, key: str, size: int, etag: str | None) -> None:
        super().__init__()
        self._s3 = storage
        self._key = key
        self._full = storage._full(key)
        self._size = size
        self._etag = etag
        self._pos = 0
        self._body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        pos = base + offset
        if pos < 0:
            raise ValueError("negative seek position")
        if pos != self._pos:
            self._drop_body()
            self._pos = pos
        return pos

    def _drop_body(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            try:
                body.close()
            except Exception:
                pass

    def _open_body(self) -> Any:
        s3 = self._s3
        kwargs: dict[str, Any] = {
            "Bucket": s3.bucket,
            "Key": self._full,
            "Range": f"bytes={self._pos}-",
        }
        if self._etag:
            kwargs["IfMatch"] = self._etag
        try:
            return s3._call("GetObject", self._key, lambda: s3._client.get_object(**kwargs))["Body"]
        except PermanentStorageError as e:
            if "PreconditionFailed" in str(e):
                raise RetryableStorageError(
                    f"{s3._where(self._key)} was replaced while being read; read it again"
                ) from e
            raise

    def readinto(self, buffer: Any) -> int:
        if self.closed:
            raise ValueError("read from a closed reader")
        want = len(buffer)
        if want == 0 or self._pos >= self._size:
            return 0
        attempts = self._s3.options.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                if self._body is None:
                    self._body = self._open_body()
                data = self._body.read(min(want, self._size - self._pos))
                if not data:
                    raise bexc.IncompleteReadError(
                        actual_bytes=self._pos, expected_bytes=self._size
                    )
                n = len(data)
                buffer[:n] = data
                self._pos += n
                return n
            except Exception as e:
                self._drop_body()
                if isinstance(e, StorageError):
                    raise  # already classified (and retried) by _call
                err = self._s3.classify(e, "GetObject", self._key)
                if err is None:
                    raise
                if not isinstance(err, RetryableStorageError):
                    raise err from e
                if attempt == attempts:
                    raise RetryableStorageError(
                        f"{err}; gave up resuming at offset {self._pos} after {attempt} attempt(s)"
                    ) from e
                with self._s3._lock:
                    self._s3.retries += 1
                time.sleep(self._s3._backoff(attempt))
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._drop_body()
        super().close()
