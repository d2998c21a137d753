"""One bucket and prefix through boto3: every request under the retry policy.

:class:`BucketClient` is what the rest of the S3 backend talks to:
:class:`~ckpt_agent.storage.s3.backend.S3Storage` (the :class:`Storage` API)
and :mod:`~ckpt_agent.storage.s3.transfer` (multipart writer, resuming reader)
use only its public members. The retry policy lives here, in
:meth:`BucketClient.call` and :meth:`BucketClient.retry_delay`:

* a request is retried only when its failure is retryable
  (:func:`~ckpt_agent.storage.s3.failures.classify_error`: timeouts, connection
  errors, 5xx, throttling), ``max_attempts`` attempts in all;
* between attempts it waits :func:`~ckpt_agent.storage.s3.failures.backoff_s`
  (exponential from ``backoff_base_s``, capped at ``backoff_max_s``, jittered);
* a permanent failure, or the last retryable one, is raised at once as a
  :class:`~ckpt_agent.storage.base.StorageError` that says what to fix.

The resuming reader spends the same budget (:meth:`BucketClient.retry_delay`)
on a body that breaks mid-read.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import boto3
from botocore.config import Config

from ckpt_agent.errors import (
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageError,
)
from ckpt_agent.storage.base import validate_key
from ckpt_agent.storage.options import StorageOptions
from ckpt_agent.storage.s3.failures import HINTS, backoff_s, classify_error, with_code
from ckpt_agent.text import clean

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

__all__ = ["BucketClient", "Head", "make_boto_client"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Head:
    """What a HEAD of one object answered."""

    __slots__ = ("etag", "key", "mtime", "size")

    def __init__(self, key: str, size: int, mtime: float, etag: str | None) -> None:
        self.key, self.size, self.mtime, self.etag = key, size, mtime, etag


class BucketClient:
    """Requests to ``s3://bucket/root_prefix``, retried by one policy, counted per operation.

    Thread-safe: the writers' part uploads run on :meth:`executor`'s threads.
    """

    def __init__(self, bucket: str, root: str, options: StorageOptions, boto: S3Client) -> None:
        self.bucket = bucket
        #: ``root/`` (or empty): what every key is prefixed with.
        self.root_prefix = f"{root}/" if root else ""
        self.options = options
        #: The underlying boto3 client.
        self.boto: S3Client = boto
        self.endpoint = boto.meta.endpoint_url
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._bucket_checked = False
        #: Requests sent per operation name (attempts, retries included).
        self.calls: collections.Counter[str] = collections.Counter()
        #: Attempts that failed with a retryable error and were retried.
        self.retries = 0

    # -- naming ------------------------------------------------------------------------
    def full(self, key: str) -> str:
        """The object key of storage key ``key`` (validated)."""
        return self.root_prefix + validate_key(key)

    def where(self, key: str | None) -> str:
        """``s3://bucket/prefix/key`` (and the endpoint, if not AWS), for messages."""
        obj = f"s3://{self.bucket}/{self.root_prefix}{key or ''}"
        return f"{obj} at {self.endpoint}" if self.options.endpoint_url else obj

    def sse_args(self) -> dict[str, str]:
        """The server-side encryption arguments of every PUT and multipart upload."""
        o = self.options
        if o.sse == "none":
            return {}
        args: dict[str, str] = {"ServerSideEncryption": o.sse}
        if o.sse == "aws:kms" and o.kms_key_id:
            args["SSEKMSKeyId"] = o.kms_key_id
        return args

    # -- the retry policy ----------------------------------------------------------------
    def classify(self, e: BaseException, op: str, key: str | None = None) -> StorageError | None:
        """Map a boto3/botocore/network exception to the storage taxonomy (None: a bug)."""
        return classify_error(e, f"S3 {op} {self.where(key)}")

    def backoff_s(self, attempt: int) -> float:
        """The pause after failed attempt ``attempt`` (1-based), before the next one."""
        return backoff_s(attempt, self.options.backoff_base_s, self.options.backoff_max_s)

    def retry_delay(self, attempt: int) -> float | None:
        """After retryable failure number ``attempt``: the pause before trying again.

        None once ``max_attempts`` attempts are spent. A pause returned is
        counted in :attr:`retries`; the caller sleeps it.
        """
        if attempt >= self.options.max_attempts:
            return None
        delay = self.backoff_s(attempt)
        with self._lock:
            self.retries += 1
        return delay

    def call(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run one request ``fn`` with the retry policy; raise a :class:`StorageError`."""
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
                    delay = self.retry_delay(attempt)
                    if delay is not None:
                        log.warning(
                            "%s (attempt %d/%d); retrying in %.2fs",
                            clean(err),
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

    # -- requests more than one caller needs --------------------------------------------
    def check_bucket(self, *, again: bool = False) -> None:
        """Is the bucket there and reachable? Asked once (``again``: ask anew).

        Turns the ambiguous 404/403 of a HEAD into a clear error.
        """
        if again:
            self._bucket_checked = False
        if self._bucket_checked:
            return
        try:
            self.call("HeadBucket", None, lambda: self.boto.head_bucket(Bucket=self.bucket))
        except NotFoundError:
            raise with_code(
                PermanentStorageError(
                    f"S3 HeadBucket {self.where(None)}: NoSuchBucket. {HINTS['NoSuchBucket']}"
                ),
                "NoSuchBucket",
            ) from None
        except PermanentStorageError:
            # HEAD responses carry no error code: ask a call that does (ListObjectsV2).
            self.call(
                "ListObjectsV2",
                None,
                lambda: self.boto.list_objects_v2(
                    Bucket=self.bucket, Prefix=self.root_prefix, MaxKeys=1
                ),
            )
            raise
        self._bucket_checked = True

    def head(self, key: str) -> Head:
        """HEAD one object (a missing bucket or bad credentials: a clear error)."""
        full = self.full(key)
        try:
            resp = self.call(
                "HeadObject", key, lambda: self.boto.head_object(Bucket=self.bucket, Key=full)
            )
        except (NotFoundError, PermanentStorageError):
            self.check_bucket()
            raise
        return Head(
            key, int(resp["ContentLength"]), resp["LastModified"].timestamp(), resp.get("ETag")
        )

    def put(self, key: str, data: bytes | bytearray, *, if_none_match: bool = False) -> None:
        """One PUT of the whole object (atomic on S3); ``if_none_match``: only if the key has
        no object (``If-None-Match: *``; a taken key is a
        :class:`~ckpt_agent.errors.PermanentStorageError` with code ``PreconditionFailed``)."""
        full = self.full(key)
        extra: dict[str, str] = self.sse_args()
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        body = bytes(data)
        self.call(
            "PutObject",
            key,
            lambda: self.boto.put_object(Bucket=self.bucket, Key=full, Body=body, **extra),  # type: ignore[arg-type]
        )

    # -- threads -------------------------------------------------------------------------
    def executor(self) -> ThreadPoolExecutor:
        """The pool part uploads run on (``max_concurrency`` threads, made on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.options.max_concurrency, thread_name_prefix="ckpt-s3"
                )
            return self._pool

    def close(self) -> None:
        """Cancel queued part uploads, wait for running ones, close the boto3 client."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.boto.close()


def make_boto_client(opts: StorageOptions) -> S3Client:
    """A boto3 S3 client for ``opts``; botocore's own retries off (we retry)."""
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
