"""Moving object bytes to and from S3: the multipart writer and the resuming reader.

:class:`S3Writer` sends one PUT for small objects and a bounded, parallel
multipart upload for large ones (aborted on any failure); :class:`S3Reader`
is a seekable ranged-GET reader that resumes after a dropped connection and
detects a replaced object (``If-Match``). Requests go through a
:class:`~ckpt_agent.storage.s3.client.BucketClient` and its retry policy
(public members only).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import botocore.exceptions as bexc

from ckpt_agent.errors import (
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageError,
)
from ckpt_agent.storage.base import ObjectWriter, Storage
from ckpt_agent.storage.options import S3_MAX_PARTS
from ckpt_agent.storage.s3.client import BucketClient
from ckpt_agent.text import clean

if TYPE_CHECKING:
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

__all__ = ["S3Reader", "S3Writer"]

log = logging.getLogger(__name__)

#: Checksums a part upload may answer with; CompleteMultipartUpload wants them back.
CHECKSUM_FIELDS = (
    "ChecksumCRC32",
    "ChecksumCRC32C",
    "ChecksumCRC64NVME",
    "ChecksumSHA1",
    "ChecksumSHA256",
)


class S3Writer(ObjectWriter):
    """One PUT for small objects; a bounded, parallel multipart upload for large ones."""

    def __init__(self, storage: Storage, client: BucketClient, key: str) -> None:
        super().__init__(storage, key)
        self._s3 = client
        self._full = client.full(key)
        self._part_size = client.options.part_size_bytes
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._next_part = 1
        self._parts: dict[int, CompletedPartTypeDef] = {}
        self._futures: list[Future[None]] = []
        self._slots = threading.BoundedSemaphore(client.options.max_concurrency)
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
        extra: dict[str, Any] = dict(s3.sse_args())
        if s3.options.checksums == "when_supported":
            extra["ChecksumAlgorithm"] = "CRC32"
        resp = s3.call(
            "CreateMultipartUpload",
            self.key,
            lambda: s3.boto.create_multipart_upload(Bucket=s3.bucket, Key=self._full, **extra),
        )
        return resp["UploadId"]

    def _ship(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._start_multipart()
        if self._next_part > S3_MAX_PARTS:
            raise PermanentStorageError(
                f"S3 {self._s3.where(self.key)}: more than {S3_MAX_PARTS} parts; raise "
                "part_size_bytes (CKPT_S3_PART_SIZE) for objects this large"
            )
        # Back-pressure: at most max_concurrency parts in flight (bounded memory).
        while not self._slots.acquire(timeout=0.2):
            self._raise_failure()
        try:
            self._raise_failure()
            number = self._next_part
            self._next_part += 1
            fut = self._s3.executor().submit(self._upload_part, self._upload_id, number, part)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        self._futures.append(fut)

    def _upload_part(self, upload_id: str, number: int, body: bytes) -> None:
        s3 = self._s3
        try:
            resp = s3.call(
                "UploadPart",
                self.key,
                lambda: s3.boto.upload_part(
                    Bucket=s3.bucket,
                    Key=self._full,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body,
                ),
            )
            done: dict[str, Any] = {"PartNumber": number, "ETag": resp["ETag"]}
            for name in CHECKSUM_FIELDS:
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
            s3.put(self.key, self._buf)
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
                f"S3 {s3.where(self.key)}: {self._next_part - 1 - len(self._parts)} part(s) "
                "were cancelled before upload (was the storage closed during the write?)"
            )
        parts = [self._parts[n] for n in sorted(self._parts)]
        upload_id = self._upload_id
        try:
            s3.call(
                "CompleteMultipartUpload",
                self.key,
                lambda: s3.boto.complete_multipart_upload(
                    Bucket=s3.bucket,
                    Key=self._full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
        except PermanentStorageError as e:
            # A retried Complete whose first attempt succeeded answers NoSuchUpload.
            if e.code != "NoSuchUpload" or not self._completed_already(len(parts)):
                raise
        self._upload_id = None  # nothing left to abort

    def _completed_already(self, nparts: int) -> bool:
        try:
            head = self._s3.head(self.key)
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
            s3.call(
                "AbortMultipartUpload",
                self.key,
                lambda: s3.boto.abort_multipart_upload(
                    Bucket=s3.bucket, Key=self._full, UploadId=upload_id
                ),
            )
        except NotFoundError:
            pass
        except StorageError as e:
            log.warning(
                "could not abort multipart upload %s of %s (%s); its parts stay until a "
                "lifecycle rule AbortIncompleteMultipartUpload removes them",
                clean(upload_id),
                clean(s3.where(self.key)),
                clean(e),
            )


class S3Reader(io.RawIOBase):
    """Seekable ranged-GET reader that resumes after a dropped connection."""

    def __init__(self, client: BucketClient, key: str, size: int, etag: str | None) -> None:
        super().__init__()
        self._s3 = client
        self._key = key
        self._full = client.full(key)
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
            return s3.call("GetObject", self._key, lambda: s3.boto.get_object(**kwargs))["Body"]
        except PermanentStorageError as e:
            if e.code == "PreconditionFailed":
                raise RetryableStorageError(
                    f"{s3.where(self._key)} was replaced while being read; read it again"
                ) from e
            raise

    def readinto(self, buffer: Any) -> int:
        if self.closed:
            raise ValueError("read from a closed reader")
        want = len(buffer)
        if want == 0 or self._pos >= self._size:
            return 0
        attempt = 0
        while True:
            attempt += 1
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
                    raise  # already classified (and retried) by BucketClient.call
                err = self._s3.classify(e, "GetObject", self._key)
                if err is None:
                    raise
                if not isinstance(err, RetryableStorageError):
                    raise err from e
                delay = self._s3.retry_delay(attempt)
                if delay is None:
                    raise RetryableStorageError(
                        f"{err}; gave up resuming at offset {self._pos} after {attempt} attempt(s)"
                    ) from e
                time.sleep(delay)

    def close(self) -> None:
        self._drop_body()
        super().close()
