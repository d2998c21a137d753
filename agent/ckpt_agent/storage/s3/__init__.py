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

Modules: :mod:`.backend` (:class:`S3Storage`: the storage API, listing,
deletes), :mod:`.client` (:class:`~.client.BucketClient`: requests and the
retry policy, in one place), :mod:`.transfer` (multipart writer, resuming
ranged reader; through the client's public members) and :mod:`.failures`
(what a failed request means and what to fix).
"""

from __future__ import annotations

try:
    import boto3  # noqa: F401 - checked first, so a missing SDK says what to install
    import botocore  # noqa: F401
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "s3:// storage needs boto3: `pip install boto3` (a base dependency of "
        "ckpt-operator; a minimal image may have left it out)"
    ) from _e

from ckpt_agent.storage.s3.backend import S3Storage

__all__ = ["S3Storage"]
