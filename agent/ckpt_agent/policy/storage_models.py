"""The policy's ``storage`` section: local/PVC paths or S3, credentials, encryption.

Part of the ``CheckpointPolicy`` model (:mod:`ckpt_agent.policy.models` re-exports it).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated
from urllib.parse import quote, unquote

from pydantic import ConfigDict, Field, field_validator, model_validator

from ckpt_agent.policy.schema_base import CamelModel, cel


class SecretKeyRef(CamelModel):
    """A reference to a Kubernetes Secret holding S3 credentials (never inlined)."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    """Secret name in the policy's namespace."""
    access_key_id_key: str = "AWS_ACCESS_KEY_ID"
    """Key of the access key id in the Secret."""
    secret_access_key_key: str = "AWS_SECRET_ACCESS_KEY"
    """Key of the secret access key in the Secret."""


class SSEMode(StrEnum):
    """Server-side encryption mode."""

    NONE = "none"
    AES256 = "AES256"
    KMS = "aws:kms"


class ServerSideEncryptionSpec(CamelModel):
    """S3 server-side encryption."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.mode != 'aws:kms' || has(self.kmsKeyId)",
                    "kmsKeyId is required when mode is aws:kms",
                    ".kmsKeyId",
                )
            ]
        }
    )

    mode: SSEMode = SSEMode.NONE
    """none, AES256 (SSE-S3) or aws:kms (SSE-KMS)."""
    kms_key_id: str | None = None
    """KMS key id (required for aws:kms)."""

    @model_validator(mode="after")
    def _kms_needs_key(self) -> ServerSideEncryptionSpec:
        if self.mode == SSEMode.KMS and not self.kms_key_id:
            raise ValueError("storage.s3.serverSideEncryption.kmsKeyId is required for aws:kms")
        return self


class LocalStorageSpec(CamelModel):
    """A local or shared (NFS) filesystem path, optionally a PVC mounted at that path."""

    path: Annotated[str, Field(min_length=1, pattern=r"^/")] = "/var/lib/ckpt"
    """Absolute path inside the pod where checkpoints are written."""
    pvc_name: str | None = None
    """PersistentVolumeClaim mounted at `path` (none: the path must already exist on the node)."""


class S3StorageSpec(CamelModel):
    """An S3-compatible bucket (AWS S3, MinIO, Ceph RGW)."""

    bucket: Annotated[str, Field(min_length=3, max_length=63)]
    """Bucket name."""
    prefix: str = ""
    """Key prefix inside the bucket; leading/trailing slashes are dropped."""
    endpoint: str | None = None
    """Custom endpoint URL (MinIO/Ceph); empty for AWS."""
    region: str = "us-east-1"
    """Region."""
    path_style: bool = False
    """Path-style addressing (needed by most MinIO/Ceph setups)."""
    credentials_secret: SecretKeyRef | None = None
    """Secret with the credentials; none: the standard AWS chain (IRSA, instance profile)."""
    server_side_encryption: ServerSideEncryptionSpec = Field(
        default_factory=ServerSideEncryptionSpec
    )
    """Server-side encryption."""
    part_size_mb: Annotated[int, Field(ge=5, le=5120)] = 16
    """Multipart part size in MiB."""
    max_concurrency: Annotated[int, Field(ge=1, le=64)] = 4
    """Parallel multipart uploads per blob."""
    max_attempts: Annotated[int, Field(ge=1, le=20)] = 3
    """Attempts for retryable errors (timeouts, 5xx, throttling)."""

    @field_validator("prefix")
    @classmethod
    def _normalize_prefix(cls, v: str) -> str:
        return v.strip("/")


class StorageType(StrEnum):
    LOCAL = "local"
    S3 = "s3"


class StorageSpec(CamelModel):
    """Where checkpoints go."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.type != 's3' || has(self.s3)", "s3 is required when type is s3", ".s3"),
            ]
        }
    )

    type: StorageType = StorageType.LOCAL
    """local (filesystem / PVC) or s3."""
    local: LocalStorageSpec = Field(default_factory=LocalStorageSpec)
    """Filesystem settings (type local)."""
    s3: S3StorageSpec | None = None
    """Bucket settings (type s3)."""

    @model_validator(mode="after")
    def _s3_needs_bucket(self) -> StorageSpec:
        if self.type == StorageType.S3 and self.s3 is None:
            raise ValueError("storage.s3 is required when storage.type is s3")
        return self

    def url(self) -> str:
        """The storage URL the agent opens (``file:///path`` or ``s3://bucket/prefix``)."""
        if self.type == StorageType.S3:
            assert self.s3 is not None
            prefix = self.s3.prefix.strip("/")
            return f"s3://{self.s3.bucket}/{prefix}" if prefix else f"s3://{self.s3.bucket}"
        return file_url(self.local.path)


def file_url(path: str) -> str:
    """The ``file://`` URL of a local ``path``, percent-encoded: every reader unquotes the
    URL's path (:meth:`ckpt_agent.storage.fs.LocalStorage.from_url`), so a folder named
    ``a%20b``, ``x?y`` or ``c#d`` opens as itself and never as ``a b``, a query or a fragment."""
    return "file://" + quote(path, safe="/")


def file_url_path(url: str) -> str:
    """The local path of a ``file://`` URL (the inverse of :func:`file_url`)."""
    return unquote(url.removeprefix("file://"))
