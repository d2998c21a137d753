"""What a failed S3 request means: retryable or permanent, and what to fix.

Maps boto3/botocore/network exceptions to the storage error taxonomy
(:mod:`ckpt_agent.storage.base`) with a hint per error code, keeps S3's error
code on the error (:attr:`StorageError.code <ckpt_agent.errors.StorageError.code>`,
what the backend decides on), and computes the retry backoff. No I/O here.
"""

from __future__ import annotations

import random
from typing import Any, TypeVar

import botocore.exceptions as bexc
import urllib3.exceptions

from ckpt_agent.errors import (
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    StorageError,
)

__all__ = ["CRED_HINT", "HINTS", "STREAM_ERRORS", "backoff_s", "classify_error", "with_code"]

_E = TypeVar("_E", bound=StorageError)

#: Error codes worth retrying (besides any 5xx, 408 and 429).
RETRYABLE_CODES = frozenset(
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
        "ConditionalRequestConflict",  # 409: a concurrent conditional write; AWS says retry
        "XMinioServerNotInitialized",
        "XMinioReadQuorum",
        "XMinioWriteQuorum",
    }
)

CRED_HINT = (
    "Check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or "
    "CKPT_S3_ACCESS_KEY_ID/CKPT_S3_SECRET_ACCESS_KEY from the Secret the operator mounts), "
    "AWS_PROFILE, or the pod's IAM role."
)
HINTS: dict[str, str] = {
    "AccessDenied": (
        "The credentials are valid but not allowed to do this: grant s3:GetObject, "
        "s3:PutObject, s3:DeleteObject, s3:ListBucket and s3:AbortMultipartUpload on the "
        "bucket and prefix (plus kms:GenerateDataKey and kms:Decrypt on the key with "
        "SSE-KMS). " + CRED_HINT
    ),
    "InvalidAccessKeyId": "The access key id is unknown to this endpoint. " + CRED_HINT,
    "SignatureDoesNotMatch": (
        "The secret access key does not match the access key id (or a proxy rewrote the "
        "request). " + CRED_HINT
    ),
    "ExpiredToken": "The session token has expired: refresh the credentials. " + CRED_HINT,
    "InvalidToken": "The session token is invalid. " + CRED_HINT,
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

STREAM_ERRORS: tuple[type[BaseException], ...] = (
    bexc.ConnectionError,  # EndpointConnectionError, ConnectTimeout, ReadTimeout, ...
    bexc.HTTPClientError,
    bexc.IncompleteReadError,
    bexc.ResponseStreamingError,
    urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError while reading a body
    ConnectionError,  # builtin: reset, refused, aborted
    TimeoutError,
)


def with_code(err: _E, code: str | None) -> _E:
    """``err`` with :attr:`~ckpt_agent.errors.StorageError.code` set (an empty code: None)."""
    err.code = code or None
    return err


def classify_error(e: BaseException, where: str) -> StorageError | None:
    """Map a boto3/botocore/network exception to the storage taxonomy (None: a bug).

    ``where`` starts the message (``S3 PutObject s3://bucket/key``).
    """
    if isinstance(e, StorageError):
        return e
    if isinstance(e, bexc.ClientError):
        err: dict[str, Any] = dict(e.response.get("Error", {}))
        code = str(err.get("Code", ""))
        msg = str(err.get("Message", "")).strip()
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("NoSuchKey", "404", "NotFound"):
            return with_code(NotFoundError(f"{where}: no such object"), code)
        if code in RETRYABLE_CODES or status >= 500 or status in (408, 429):
            return with_code(
                RetryableStorageError(f"{where}: {code or status} {msg} (HTTP {status})"), code
            )
        if code == "403" or (status == 403 and code not in HINTS):
            code = "AccessDenied"
        hint = HINTS.get(code, "")
        detail = f"{code}: {msg}" if msg else code or f"HTTP {status}"
        return with_code(
            PermanentStorageError(f"{where}: {detail}. {hint}".rstrip(". ") + "."), code
        )
    if isinstance(e, bexc.NoCredentialsError | bexc.PartialCredentialsError):
        return PermanentStorageError(f"{where}: no usable credentials found. {CRED_HINT}")
    if isinstance(e, bexc.ParamValidationError):
        return PermanentStorageError(f"{where}: invalid request: {e}")
    if isinstance(e, STREAM_ERRORS):
        return RetryableStorageError(f"{where}: {type(e).__name__}: {e}")
    if isinstance(e, bexc.BotoCoreError):
        return PermanentStorageError(f"{where}: {type(e).__name__}: {e}")
    return None


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential backoff with "equal jitter": half fixed, half random."""
    cap = min(max_s, base_s * 2 ** (attempt - 1))
    return float(cap / 2 + random.uniform(0, cap / 2))
