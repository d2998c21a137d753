"""Tuning and connection options shared by the storage backends.

One frozen dataclass, :class:`StorageOptions`. Every field has a unit in its
name or its comment and an environment variable (``CKPT_S3_*`` /
``CKPT_FS_*``) read by :meth:`StorageOptions.from_env`, so that the operator
can set them through the pod environment and a developer can override one on
the command line. Backends read only the fields that concern them.

Credentials are never required here: by default the S3 backend uses the
standard AWS credential chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, web identity / IRSA, instance
metadata). Explicit keys are for a Kubernetes Secret mounted under other
names (``CKPT_S3_ACCESS_KEY_ID``/``CKPT_S3_SECRET_ACCESS_KEY``), so that the
checkpoint bucket's credentials need not replace the training job's own.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ckpt_agent.policy.agent_config import AgentConfig, S3Options
from ckpt_agent.policy.storage_models import S3StorageSpec

__all__ = [
    "ENV_VARS",
    "MIB",
    "S3_MIN_PART_SIZE",
    "S3Section",
    "SseMode",
    "StorageOptions",
    "s3_env",
]

MIB = 1024 * 1024
#: S3 rejects multipart parts smaller than this (except the last one).
S3_MIN_PART_SIZE = 5 * MIB
#: S3 allows at most this many parts per multipart upload.
S3_MAX_PARTS = 10_000

SseMode = Literal["none", "AES256", "aws:kms"]
_SSE_MODES: tuple[str, ...] = ("none", "AES256", "aws:kms")

#: Environment variable → field name, read by :meth:`StorageOptions.from_env`.
ENV_VARS: dict[str, str] = {
    "CKPT_S3_ENDPOINT_URL": "endpoint_url",
    "CKPT_S3_REGION": "region",
    "CKPT_S3_PATH_STYLE": "path_style",
    "CKPT_S3_SSE": "sse",
    "CKPT_S3_KMS_KEY_ID": "kms_key_id",
    "CKPT_S3_PART_SIZE": "part_size_bytes",
    "CKPT_S3_MAX_CONCURRENCY": "max_concurrency",
    "CKPT_S3_MAX_ATTEMPTS": "max_attempts",
    "CKPT_S3_BACKOFF_BASE_S": "backoff_base_s",
    "CKPT_S3_BACKOFF_MAX_S": "backoff_max_s",
    "CKPT_S3_CONNECT_TIMEOUT_S": "connect_timeout_s",
    "CKPT_S3_READ_TIMEOUT_S": "read_timeout_s",
    "CKPT_S3_LIST_PAGE_SIZE": "list_page_size",
    "CKPT_S3_PROFILE": "profile",
    "CKPT_S3_ACCESS_KEY_ID": "access_key_id",
    "CKPT_S3_SECRET_ACCESS_KEY": "secret_access_key",
    "CKPT_S3_SESSION_TOKEN": "session_token",
    "CKPT_S3_CHECKSUMS": "checksums",
    "CKPT_FS_FSYNC": "fsync",
    "CKPT_FS_DIRECT_IO": "direct_io",
}

#: The policy's S3 section: the CRD's (operator) or the agent config's (pods); same fields.
S3Section = S3Options | S3StorageSpec

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": MIB, "g": 1024 * MIB, "t": 1024 * 1024 * MIB}


def parse_size(text: str) -> int:
    """``"16777216"``, ``"16MiB"``, ``"16m"``, ``"1g"`` → bytes (binary units)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use bytes or a unit such as 16MiB)")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * _SIZE_UNITS[unit]


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


@dataclass(frozen=True)
class StorageOptions:
    """Options for :func:`ckpt_agent.storage.open_storage`.

    Construct directly, from the environment with :meth:`from_env`, or from the
    policy with :meth:`from_spec` / :meth:`for_config` (the one place the policy's
    S3 section becomes options: trainer, sidecar, operator and webhook use it).
    """

    # --- S3 connection -------------------------------------------------------
    #: Custom endpoint (MinIO, Ceph RGW, ...): ``http://minio.storage:9000``. None: AWS
    #: (botocore also honours ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``).
    endpoint_url: str | None = None
    #: Bucket region. None: from the AWS config chain (``AWS_REGION``), else us-east-1.
    region: str | None = None
    #: Path-style addressing (``endpoint/bucket/key``). None: on when ``endpoint_url`` is
    #: set (what MinIO/Ceph on a plain host name need), virtual-host style on AWS.
    path_style: bool | None = None
    #: AWS shared-config profile to use instead of the default chain.
    profile: str | None = None
    #: Explicit credentials (from a mounted Secret). None: the standard AWS chain.
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    #: Seconds to wait for a TCP connection to the endpoint.
    connect_timeout_s: float = 10.0
    #: Seconds without a byte from the server before a request counts as timed out.
    read_timeout_s: float = 60.0

    # --- S3 encryption -------------------------------------------------------
    #: Server-side encryption: "none", "AES256" (SSE-S3) or "aws:kms" (SSE-KMS).
    sse: SseMode = "none"
    #: KMS key id/ARN/alias for ``sse="aws:kms"``. None: the bucket's/account's default key.
    kms_key_id: str | None = None

    # --- S3 transfer ---------------------------------------------------------
    #: Multipart part size in bytes; objects larger than this are uploaded in parts.
    #: S3 requires >= 5 MiB. Memory per open writer is about
    #: ``part_size_bytes * (max_concurrency + 1)``.
    part_size_bytes: int = 16 * MIB
    #: Parts uploaded in parallel per writer (and threads of the backend's pool).
    max_concurrency: int = 4
    #: Keys per ListObjectsV2 page (S3 caps it at 1000).
    list_page_size: int = 1000
    #: "when_supported": botocore adds CRC checksums to uploads (integrity on the wire);
    #: "when_required": only where the API needs one (older S3-compatible servers).
    checksums: Literal["when_supported", "when_required"] = "when_supported"

    # --- retries (S3) ----------------------------------------------------------
    #: Attempts per request, the first included; only retryable errors are retried.
    max_attempts: int = 3
    #: First backoff in seconds; doubles each attempt, with jitter, up to ``backoff_max_s``.
    backoff_base_s: float = 0.5
    backoff_max_s: float = 20.0

    # --- local / shared filesystem ---------------------------------------------
    #: fsync files and directories on publish. Turn off only for throw-away tests.
    fsync: bool = True
    #: With ``fsync``: write the page-aligned part of large, page-aligned buffers (the
    #: agent's host buffers and shared-memory slots) with ``O_DIRECT``, from the buffer
    #: to the disk without a copy into the page cache (that copy costs about as much CPU
    #: as hashing the bytes). Filesystems that refuse ``O_DIRECT`` get buffered writes.
    direct_io: bool = True

    def __post_init__(self) -> None:
        if self.sse not in _SSE_MODES:
            raise ValueError(f"sse must be one of {_SSE_MODES}, got {self.sse!r}")
        if self.kms_key_id and self.sse != "aws:kms":
            raise ValueError("kms_key_id is set but sse is not 'aws:kms'")
        if self.part_size_bytes < 1:
            raise ValueError("part_size_bytes must be positive")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 (1 = no retries)")
        if not 1 <= self.list_page_size <= 1000:
            raise ValueError("list_page_size must be within 1..1000")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff times must be >= 0")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("set both access_key_id and secret_access_key, or neither")
        if self.checksums not in ("when_supported", "when_required"):
            raise ValueError("checksums must be 'when_supported' or 'when_required'")

    @property
    def use_path_style(self) -> bool:
        """Effective addressing style (see :attr:`path_style`)."""
        if self.path_style is not None:
            return self.path_style
        return self.endpoint_url is not None

    def replace(self, **changes: object) -> StorageOptions:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: object
    ) -> StorageOptions:
        """Options from ``CKPT_S3_*``/``CKPT_FS_*`` variables (see :data:`ENV_VARS`).

        Unset or empty variables keep the defaults; ``overrides`` win over both.
        Sizes accept units (``CKPT_S3_PART_SIZE=64MiB``), booleans true/false.
        """
        env = os.environ if environ is None else environ
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, object] = {}
        for var, name in ENV_VARS.items():
            raw = env.get(var, "")
            if not raw.strip():
                continue
            kind = str(types[name])
            try:
                if name == "part_size_bytes":
                    values[name] = parse_size(raw)
                elif kind.startswith("bool"):
                    values[name] = _parse_bool(raw)
                elif kind.startswith("int"):
                    values[name] = int(raw)
                elif kind.startswith("float"):
                    values[name] = float(raw)
                else:
                    values[name] = raw.strip()
            except ValueError as e:
                raise ValueError(f"{var}={raw!r}: {e}") from None
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def to_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with these options as its ``CKPT_S3_*``/``CKPT_FS_*``
        variables: the inverse of :meth:`from_env` (``from_env(o.to_env()) == o``).

        The variables of ``base`` that :data:`ENV_VARS` names are dropped first, so a child
        process started with this environment (the validator's loader) opens its storage
        with exactly these options, the policy's S3 section included.
        """
        env = {k: v for k, v in (os.environ if base is None else base).items() if k not in ENV_VARS}
        for var, name in ENV_VARS.items():
            value = getattr(self, name)
            if value is None:
                continue
            env[var] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return env

    @classmethod
    def from_spec(
        cls,
        s3: S3Section | None,
        *,
        environ: Mapping[str, str] | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
    ) -> StorageOptions:
        """The policy's S3 section over the environment's defaults (:meth:`from_env`).

        ``s3=None`` (local storage): the environment's options unchanged. Explicit
        credentials (a Secret the operator read) win over ``CKPT_S3_*`` ones.
        ``pathStyle: false`` means "the default" (path style with a custom endpoint).
        """
        opts = cls.from_env(environ)
        if s3 is None:
            return opts
        sse = s3.server_side_encryption
        return opts.replace(
            endpoint_url=s3.endpoint or opts.endpoint_url,
            region=s3.region,
            path_style=s3.path_style or None,
            sse=sse.mode.value,
            kms_key_id=sse.kms_key_id,
            part_size_bytes=s3.part_size_mb * MIB,
            max_concurrency=s3.max_concurrency,
            max_attempts=s3.max_attempts,
            access_key_id=access_key_id or opts.access_key_id,
            secret_access_key=secret_access_key or opts.secret_access_key,
        )

    @classmethod
    def for_config(
        cls, config: AgentConfig, environ: Mapping[str, str] | None = None
    ) -> StorageOptions:
        """Options for an agent config (S3 section applied for ``s3://`` URLs only)."""
        s3 = config.s3 if config.storage_url.startswith("s3://") else None
        return cls.from_spec(s3, environ=environ)


_ENV_OF = {name: var for var, name in ENV_VARS.items()}


def s3_env(s3: S3Section) -> list[tuple[str, str]]:
    """``CKPT_S3_*`` variables the webhook injects for the policy's S3 section.

    Connection and encryption only (the transfer settings reach the pod through the
    mounted config, which :meth:`StorageOptions.for_config` reads); credentials are
    Secret references, added by the webhook.
    """
    sse = s3.server_side_encryption
    env: list[tuple[str, str]] = []
    if s3.endpoint:
        env.append((_ENV_OF["endpoint_url"], s3.endpoint))
    env.append((_ENV_OF["region"], s3.region))
    env.append((_ENV_OF["path_style"], "true" if s3.path_style else "false"))
    env.append((_ENV_OF["sse"], sse.mode.value))
    if sse.kms_key_id:
        env.append((_ENV_OF["kms_key_id"], sse.kms_key_id))
    return env
