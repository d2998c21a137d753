"""The on-storage checkpoint format: layout, manifests, listing and hash verification.

Torch-free and numpy-free: the operator imports this module to list and check
checkpoints. The format is specified in ``docs/format.md``; in short::

    <root>/<run-id>/
      blobs/sha256/<aa>/<digest>                content-addressed payloads (digest of the
                                                stored bytes; shared across checkpoints)
      steps/<tier>_step_<000000001200>/
          rank_<00000>.json                     per-rank manifest (JSON, never pickle)
          COMMIT                                global manifest, written last
          VALIDATION.json                       validator's verdict (bound to COMMIT's hash)
      heartbeat/rank_<00000>.json               L0 heartbeat ring per rank
      audit.log                                 manual recoveries (JSON Lines)
      RECOVER.json                              pending manual recovery request

A checkpoint exists for readers only once its ``COMMIT`` is published; the
``COMMIT`` lists every rank manifest with its SHA-256, every rank manifest
lists its blobs with their SHA-256, so one hash (the COMMIT's, the
checkpoint's ``manifest_hash``) pins every byte. Each manifest carries the
hash of the previous weights checkpoint (``prev_hash``): the chain the
recovery ladder walks.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import mmap
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ckpt_agent import __version__
from ckpt_agent.errors import CheckpointFormatError, CheckpointNotFoundError, IntegrityError
from ckpt_agent.format.codec import PY_SHUFFLER, CodecError, CodecSpec, Shuffler, decode
from ckpt_agent.records import (
    RANK_DIGITS,
    STEP_DIGITS,
    CheckpointRecord,
    CheckpointStatus,
    RetentionClass,
    Tier,
    checkpoint_id,
    rank_name,
)
from ckpt_agent.storage.base import NotFoundError, Storage, StorageError, validate_key
from ckpt_agent.storage.fs import LocalStorage

__all__ = [
    "AUDIT_LOG",
    "COMMIT",
    "FORMAT_VERSION",
    "VALIDATION",
    "BlobEntry",
    "CheckpointFormatError",
    "CheckpointMeta",
    "CheckpointNotFoundError",
    "CommitManifest",
    "Heartbeat",
    "IntegrityError",
    "RankManifest",
    "RankRef",
    "TensorEntry",
    "ValidationRecord",
    "VerifyResult",
    "blob_key",
    "checkpoint_prefix",
    "commit_key",
    "list_checkpoints",
    "list_runs",
    "parse_checkpoint_id",
    "rank_manifest_key",
    "read_checkpoint",
    "read_commit",
    "read_heartbeat",
    "read_rank_manifest",
    "read_tensor_bytes",
    "read_validation",
    "sha256_hex",
    "verify_hashes",
]

Json = Any

FORMAT_VERSION: Final = 1
FORMAT_RANK: Final = "ckpt-operator.rank-manifest"
FORMAT_COMMIT: Final = "ckpt-operator.commit"
FORMAT_VALIDATION: Final = "ckpt-operator.validation"
FORMAT_HEARTBEAT: Final = "ckpt-operator.heartbeat"

COMMIT: Final = "COMMIT"
VALIDATION: Final = "VALIDATION.json"
AUDIT_LOG: Final = "audit.log"
RECOVER_REQUEST: Final = "RECOVER.json"
#: Heartbeat objects stay below this size (the L0 contract).
HEARTBEAT_MAX_BYTES: Final = 512 * 1024

#: Element size of every dtype the format knows (names as torch/numpy print them).
DTYPE_ITEMSIZE: Final[Mapping[str, int]] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "uint32": 4,
    "int32": 4,
    "float32": 4,
    "uint64": 8,
    "int64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
#: Dtypes whose bytes the byte shuffle helps (floating point).
FLOAT_DTYPES: Final = frozenset({"float16", "bfloat16", "float32", "float64"})

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CKPT_ID = re.compile(rf"^(heartbeat|pulse|full)_step_(\d{{{STEP_DIGITS}}})$")
_RANK_FILE = re.compile(rf"^rank_(\d{{{RANK_DIGITS}}})\.json$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_READ_CHUNK = 8 * 1024 * 1024


# --------------------------------------------------------------------------- names and keys


def validate_run_id(run_id: str) -> str:
    """A run id is one path segment: letters, digits, ``.``, ``_``, ``-`` (max 253)."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id) or run_id in (".", ".."):
        raise ValueError(
            f"invalid run id {run_id!r}: use letters, digits, '.', '_' and '-' "
            "(starting with a letter or digit, at most 253 characters)"
        )
    return run_id


def parse_checkpoint_id(ckpt_id: str) -> tuple[Tier, int]:
    """``pulse_step_000000000120`` → ``(Tier.PULSE, 120)``; ValueError otherwise."""
    m = _CKPT_ID.match(ckpt_id)
    if not m:
        raise ValueError(
            f"not a checkpoint id: {ckpt_id!r} (expected <tier>_step_<{STEP_DIGITS} digits>)"
        )
    return Tier(m.group(1)), int(m.group(2))


def run_prefix(run_id: str) -> str:
    return f"{validate_run_id(run_id)}/"


def steps_prefix(run_id: str) -> str:
    return f"{validate_run_id(run_id)}/steps/"


def checkpoint_prefix(run_id: str, ckpt_id: str) -> str:
    parse_checkpoint_id(ckpt_id)
    return f"{steps_prefix(run_id)}{ckpt_id}/"


def rank_manifest_key(run_id: str, ckpt_id: str, rank: int) -> str:
    return f"{checkpoint_prefix(run_id, ckpt_id)}{rank_name(rank)}.json"


def commit_key(run_id: str, ckpt_id: str) -> str:
    return checkpoint_prefix(run_id, ckpt_id) + COMMIT


def validation_key(run_id: str, ckpt_id: str) -> str:
    return checkpoint_prefix(run_id, ckpt_id) + VALIDATION


def blobs_prefix(run_id: str) -> str:
    return f"{validate_run_id(run_id)}/blobs/sha256/"


def blob_key(run_id: str, digest: str) -> str:
    if not _HEX64.match(digest):
        raise CheckpointFormatError(f"not a SHA-256 hex digest: {digest!r}")
    return f"{blobs_prefix(run_id)}{digest[:2]}/{digest}"


def heartbeat_key(run_id: str, rank: int) -> str:
    return f"{validate_run_id(run_id)}/heartbeat/{rank_name(rank)}.json"


def audit_key(run_id: str) -> str:
    return run_prefix(run_id) + AUDIT_LOG


def recover_request_key(run_id: str) -> str:
    return run_prefix(run_id) + RECOVER_REQUEST


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def dumps(obj: Json) -> bytes:
    """Canonical JSON bytes (sorted keys, no NaN) for every manifest-like object."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _loads(data: bytes, what: str) -> dict[str, Json]:
    def no_constants(name: str) -> object:
        raise CheckpointFormatError(f"{what}: non-standard JSON constant {name}")

    try:
        obj = json.loads(data, parse_constant=no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{what}: not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointFormatError(f"{what}: nested too deeply") from None
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{what}: expected a JSON object")
    return obj


# --------------------------------------------------------------------------- schema helpers


def _get(d: Mapping[str, Json], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if key not in d:
        raise CheckpointFormatError(f"{what}: missing field {key!r}")
    v = d[key]
    bad_bool = isinstance(v, bool) and kind in (int, float, (int, float))
    if not isinstance(v, kind) or bad_bool:
        raise CheckpointFormatError(f"{what}: field {key!r} has the wrong type")
    return v


def _opt(d: Mapping[str, Json], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if d.get(key) is None:
        return None
    return _get(d, key, kind, what)


def _digest(v: Json, what: str) -> str:
    if not isinstance(v, str) or not _HEX64.match(v):
        raise CheckpointFormatError(f"{what}: not a SHA-256 hex digest: {v!r}")
    return v


def _nonneg(v: Json, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CheckpointFormatError(f"{what}: expected a non-negative integer")
    return v


# --------------------------------------------------------------------------- entries


@dataclass(frozen=True)
class BlobEntry:
    """One stored blob: a chunk of a tensor's raw bytes, encoded by ``codec``."""

    digest: str
    """SHA-256 of the stored bytes (its key in the blob store)."""
    size: int
    """Stored bytes."""
    raw_sha256: str
    """SHA-256 of the decoded (raw) bytes: the identity used for de-duplication."""
    raw_size: int
    """Decoded bytes."""
    codec: CodecSpec
    """How it was encoded."""

    def to_json(self) -> dict[str, Json]:
        return {
            "size": self.size,
            "raw_sha256": self.raw_sha256,
            "raw_size": self.raw_size,
            **self.codec.to_json(),
        }

    @classmethod
    def from_json(cls, digest: str, d: Json, what: str) -> BlobEntry:
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{what}: blob entry is not an object")
        try:
            codec = CodecSpec.from_json(d)
        except CodecError as e:
            raise CheckpointFormatError(f"{what}: {e}") from None
        return cls(
            digest=_digest(digest, what),
            size=_nonneg(d.get("size"), f"{what}.size"),
            raw_sha256=_digest(d.get("raw_sha256"), f"{what}.raw_sha256"),
            raw_size=_nonneg(d.get("raw_size"), f"{what}.raw_size"),
            codec=codec,
        )


@dataclass(frozen=True)
class TensorEntry:
    """A tensor (or file) in a rank manifest: dtype, shape and where its bytes are."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    byte_order: str = "little"
    chunks: tuple[str, ...] = ()
    """Blob digests, in order; their raw bytes concatenate to the tensor's bytes."""
    inline: bytes | None = None
    """Small tensors live in the manifest itself."""
    inline_sha256: str | None = None

    def to_json(self) -> dict[str, Json]:
        out: dict[str, Json] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "byte_order": self.byte_order,
        }
        if self.inline is not None:
            out["inline"] = base64.b64encode(self.inline).decode("ascii")
            out["sha256"] = self.inline_sha256
        else:
            out["chunks"] = list(self.chunks)
        return out

    @classmethod
    def from_json(cls, d: Json, what: str) -> TensorEntry:
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{what}: not an object")
        dtype = _get(d, "dtype", str, what)
        if dtype not in DTYPE_ITEMSIZE:
            raise CheckpointFormatError(f"{what}: unknown dtype {dtype!r}")
        shape_raw = _get(d, "shape", list, what)
        shape = tuple(_nonneg(s, f"{what}.shape") for s in shape_raw)
        nbytes = _nonneg(d.get("nbytes"), f"{what}.nbytes")
        numel = 1
        for s in shape:
            numel *= s
        if numel * DTYPE_ITEMSIZE[dtype] != nbytes:
            raise CheckpointFormatError(
                f"{what}: nbytes {nbytes} does not match shape {list(shape)} of {dtype}"
            )
        order = d.get("byte_order", "little")
        if order not in ("little", "big"):
            raise CheckpointFormatError(f"{what}: byte_order must be little or big")
        if "inline" in d:
            b64 = _get(d, "inline", str, what)
            try:
                data = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise CheckpointFormatError(f"{what}: inline data is not base64") from None
            if len(data) != nbytes:
                raise CheckpointFormatError(
                    f"{what}: inline data has {len(data)} bytes, not {nbytes}"
                )
            return cls(
                dtype=dtype,
                shape=shape,
                nbytes=nbytes,
                byte_order=order,
                inline=data,
                inline_sha256=_digest(d.get("sha256"), f"{what}.sha256"),
            )
        chunks = _get(d, "chunks", list, what)
        return cls(
            dtype=dtype,
            shape=shape,
            nbytes=nbytes,
            byte_order=order,
            chunks=tuple(_digest(c, f"{what}.chunks") for c in chunks),
        )


# --------------------------------------------------------------------------- checkpoint meta


@dataclass(frozen=True)
class CheckpointMeta:
    """What both the rank manifests and the COMMIT say about a checkpoint."""

    run_id: str
    step: int
    tier: Tier
    world_size: int = 1
    created_at: float = 0.0
    score: float = 0.0
    components: Mapping[str, float] = field(default_factory=dict)
    retention_class: RetentionClass | None = None
    reason: str = ""
    anomaly: str | None = None
    lightweight: bool = False
    approximate: bool = False
    emergency: bool = False
    prev_hash: str | None = None
    sections: tuple[str, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict)

    @property
    def checkpoint_id(self) -> str:
        return checkpoint_id(self.tier, self.step)

    def to_json(self) -> dict[str, Json]:
        return {
            "version": FORMAT_VERSION,
            "run_id": self.run_id,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "tier": self.tier.value,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "score": self.score,
            "components": dict(self.components),
            "retention_class": self.retention_class.value if self.retention_class else None,
            "reason": self.reason,
            "anomaly": self.anomaly,
            "lightweight": self.lightweight,
            "approximate": self.approximate,
            "emergency": self.emergency,
            "prev_hash": self.prev_hash,
            "sections": list(self.sections),
            "versions": dict(self.versions),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Json], what: str) -> CheckpointMeta:
        version = _get(d, "version", int, what)
        if version != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{what}: format version {version} is not supported by this version "
                f"(knows {FORMAT_VERSION}); upgrade ckpt-operator"
            )
        tier_raw = _get(d, "tier", str, what)
        try:
            tier = Tier(tier_raw)
        except ValueError:
            raise CheckpointFormatError(f"{what}: unknown tier {tier_raw!r}") from None
        step = _nonneg(d.get("step"), f"{what}.step")
        cid = _get(d, "checkpoint_id", str, what)
        if cid != checkpoint_id(tier, step):
            raise CheckpointFormatError(f"{what}: checkpoint_id {cid!r} disagrees with tier/step")
        rc_raw = _opt(d, "retention_class", str, what)
        try:
            rc = RetentionClass(rc_raw) if rc_raw else None
        except ValueError:
            raise CheckpointFormatError(f"{what}: unknown retention class {rc_raw!r}") from None
        comps = d.get("components") or {}
        if not isinstance(comps, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in comps.values()
        ):
            raise CheckpointFormatError(f"{what}: components must map names to numbers")
        versions = d.get("versions") or {}
        if not isinstance(versions, dict):
            raise CheckpointFormatError(f"{what}: versions must be an object")
        prev = d.get("prev_hash")
        sections = d.get("sections") or []
        if not isinstance(sections, list) or not all(isinstance(s, str) for s in sections):
            raise CheckpointFormatError(f"{what}: sections must be a list of names")
        return cls(
            run_id=_get(d, "run_id", str, what),
            step=step,
            tier=tier,
            world_size=max(1, _nonneg(d.get("world_size", 1), f"{what}.world_size")),
            created_at=float(_get(d, "created_at", (int, float), what)),
            score=float(_get(d, "score", (int, float), what)),
            components={str(k): float(v) for k, v in comps.items()},
            retention_class=rc,
            reason=str(d.get("reason") or ""),
            anomaly=_opt(d, "anomaly", str, what),
            lightweight=bool(d.get("lightweight", False)),
            approximate=bool(d.get("approximate", False)),
            emergency=bool(d.get("emergency", False)),
            prev_hash=None if prev is None else _digest(prev, f"{what}.prev_hash"),
            sections=tuple(sections),
            versions={str(k): str(v) for k, v in versions.items()},
        )


def library_versions(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Versions recorded in every manifest (the torch side adds torch/numpy)."""
    from ckpt_agent.format.codec import zstd_version

    out = {
        "ckpt_agent": __version__,
        "python": ".".join(map(str, sys.version_info[:3])),
        "zstandard": zstd_version(),
        "format": str(FORMAT_VERSION),
    }
    if extra:
        out.update(extra)
    return out


@dataclass(frozen=True)
class RankManifest:
    """One rank's part of a checkpoint."""

    meta: CheckpointMeta
    rank: int
    state: Json
    """The tagged-JSON state tree (:mod:`ckpt_agent.format.jsontree`), tensors by reference."""
    tensors: Mapping[str, TensorEntry]
    blobs: Mapping[str, BlobEntry]
    files: Mapping[str, TensorEntry] = field(default_factory=dict)
    """Extra files (``train_config.json``) stored like uint8 tensors."""
    stats: Mapping[str, int] = field(default_factory=dict)
    """bytes_new, bytes_reused, blobs_new, blobs_reused, raw_bytes."""

    @property
    def checkpoint_id(self) -> str:
        return self.meta.checkpoint_id

    def to_bytes(self) -> bytes:
        doc = self.meta.to_json()
        doc.update(
            {
                "format": FORMAT_RANK,
                "rank": self.rank,
                "byte_order": sys.byteorder,
                "state": self.state,
                "tensors": {k: v.to_json() for k, v in self.tensors.items()},
                "blobs": {k: v.to_json() for k, v in self.blobs.items()},
                "files": {k: v.to_json() for k, v in self.files.items()},
                "stats": dict(self.stats),
            }
        )
        return dumps(doc)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "rank manifest") -> RankManifest:
        d = _loads(data, what)
        if d.get("format") != FORMAT_RANK:
            raise CheckpointFormatError(f"{what}: not a rank manifest (format {d.get('format')!r})")
        meta = CheckpointMeta.from_json(d, what)
        blobs_raw = _get(d, "blobs", dict, what)
        blobs = {
            k: BlobEntry.from_json(k, v, f"{what}: blob {k[:12]}") for k, v in blobs_raw.items()
        }
        tensors: dict[str, TensorEntry] = {}
        files: dict[str, TensorEntry] = {}
        for section, out in (("tensors", tensors), ("files", files)):
            raw = d.get(section) or {}
            if not isinstance(raw, dict):
                raise CheckpointFormatError(f"{what}: {section} must be an object")
            for name, entry in raw.items():
                t = TensorEntry.from_json(entry, f"{what}: {section[:-1]} {name!r}")
                total = 0
                for c in t.chunks:
                    if c not in blobs:
                        raise CheckpointFormatError(
                            f"{what}: {section[:-1]} {name!r} references unknown blob {c[:12]}"
                        )
                    total += blobs[c].raw_size
                if t.inline is None and total != t.nbytes:
                    raise CheckpointFormatError(
                        f"{what}: chunks of {name!r} hold {total} bytes, tensor has {t.nbytes}"
                    )
                out[name] = t
        stats = d.get("stats") or {}
        if not isinstance(stats, dict):
            raise CheckpointFormatError(f"{what}: stats must be an object")
        return cls(
            meta=meta,
            rank=_nonneg(d.get("rank"), f"{what}.rank"),
            state=d.get("state"),
            tensors=tensors,
            blobs=blobs,
            files=files,
            stats={str(k): int(v) for k, v in stats.items() if isinstance(v, int)},
        )

    def referenced_blobs(self) -> set[str]:
        out: set[str] = set()
        for t in (*self.tensors.values(), *self.files.values()):
            out.update(t.chunks)
        return out


@dataclass(frozen=True)
class RankRef:
    """A rank manifest as listed in the COMMIT."""

    rank: int
    key: str
    """Name inside the checkpoint folder (``rank_00000.json``)."""
    sha256: str
    size: int

    def to_json(self) -> dict[str, Json]:
        return {"rank": self.rank, "key": self.key, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class CommitManifest:
    """The global manifest, published last: the checkpoint exists once it does."""

    meta: CheckpointMeta
    ranks: tuple[RankRef, ...]
    size_bytes: int = 0
    """Bytes this checkpoint added to storage (new blobs + manifests)."""
    raw_bytes: int = 0
    """Decoded size of everything it references."""

    @property
    def checkpoint_id(self) -> str:
        return self.meta.checkpoint_id

    def to_bytes(self) -> bytes:
        doc = self.meta.to_json()
        doc.update(
            {
                "format": FORMAT_COMMIT,
                "ranks": [r.to_json() for r in self.ranks],
                "size_bytes": self.size_bytes,
                "raw_bytes": self.raw_bytes,
            }
        )
        return dumps(doc)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "COMMIT") -> CommitManifest:
        d = _loads(data, what)
        if d.get("format") != FORMAT_COMMIT:
            raise CheckpointFormatError(f"{what}: not a COMMIT (format {d.get('format')!r})")
        meta = CheckpointMeta.from_json(d, what)
        ranks_raw = _get(d, "ranks", list, what)
        ranks: list[RankRef] = []
        for r in ranks_raw:
            if not isinstance(r, dict):
                raise CheckpointFormatError(f"{what}: ranks[] entries must be objects")
            key = _get(r, "key", str, what)
            if not _RANK_FILE.match(key):
                raise CheckpointFormatError(f"{what}: bad rank manifest name {key!r}")
            ranks.append(
                RankRef(
                    rank=_nonneg(r.get("rank"), f"{what}.rank"),
                    key=key,
                    sha256=_digest(r.get("sha256"), f"{what}.ranks.sha256"),
                    size=_nonneg(r.get("size"), f"{what}.ranks.size"),
                )
            )
        if sorted(r.rank for r in ranks) != list(range(meta.world_size)):
            raise CheckpointFormatError(
                f"{what}: lists ranks {sorted(r.rank for r in ranks)} "
                f"for world size {meta.world_size}"
            )
        return cls(
            meta=meta,
            ranks=tuple(ranks),
            size_bytes=_nonneg(d.get("size_bytes", 0), f"{what}.size_bytes"),
            raw_bytes=_nonneg(d.get("raw_bytes", 0), f"{what}.raw_bytes"),
        )

    def record(self, manifest_hash: str, status: CheckpointStatus) -> CheckpointRecord:
        m = self.meta
        return CheckpointRecord(
            id=m.checkpoint_id,
            step=m.step,
            tier=m.tier,
            status=status,
            score=m.score,
            retention_class=m.retention_class,
            size_bytes=self.size_bytes,
            created_at=m.created_at,
            manifest_hash=manifest_hash,
            prev_hash=m.prev_hash,
            anomaly=m.anomaly,
            lightweight=m.lightweight,
            approximate=m.approximate,
            emergency=m.emergency,
            world_size=m.world_size,
            reason=m.reason,
        )


@dataclass(frozen=True)
class ValidationRecord:
    """The validator's verdict on one committed checkpoint."""

    checkpoint_id: str
    commit_sha256: str
    """The COMMIT it judged (a rewritten checkpoint is judged anew)."""
    status: CheckpointStatus
    reason: str = ""
    validated_at: float = 0.0
    checks: tuple[str, ...] = ()
    duration_s: float = 0.0

    def to_bytes(self) -> bytes:
        return dumps(
            {
                "format": FORMAT_VALIDATION,
                "version": FORMAT_VERSION,
                "checkpoint_id": self.checkpoint_id,
                "commit_sha256": self.commit_sha256,
                "status": self.status.value,
                "reason": self.reason,
                "validated_at": self.validated_at,
                "checks": list(self.checks),
                "duration_s": self.duration_s,
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, what: str = VALIDATION) -> ValidationRecord:
        d = _loads(data, what)
        if d.get("format") != FORMAT_VALIDATION:
            raise CheckpointFormatError(f"{what}: not a validation record")
        status = CheckpointStatus(_get(d, "status", str, what))
        checks = d.get("checks") or []
        return cls(
            checkpoint_id=_get(d, "checkpoint_id", str, what),
            commit_sha256=_digest(d.get("commit_sha256"), what),
            status=status,
            reason=str(d.get("reason") or ""),
            validated_at=float(d.get("validated_at") or 0.0),
            checks=tuple(str(c) for c in checks) if isinstance(checks, list) else (),
            duration_s=float(d.get("duration_s") or 0.0),
        )


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A COMMIT as read from storage, with its hash."""

    commit: CommitManifest
    manifest_hash: str
    raw: bytes


def read_commit(storage: Storage, run_id: str, ckpt_id: str) -> CommittedCheckpoint:
    """Read and parse a checkpoint's COMMIT.

    Raises :class:`CheckpointNotFoundError` when it is not committed and
    :class:`CheckpointFormatError` when the COMMIT is malformed.
    """
    key = commit_key(run_id, ckpt_id)
    try:
        raw = storage.read(key)
    except NotFoundError:
        raise CheckpointNotFoundError(
            f"checkpoint {ckpt_id} of run {run_id} is not committed (no {key} in {storage.url})"
        ) from None
    commit = CommitManifest.from_bytes(raw, f"{ckpt_id}/COMMIT")
    if commit.meta.run_id != run_id or commit.checkpoint_id != ckpt_id:
        raise CheckpointFormatError(
            f"{ckpt_id}/COMMIT describes {commit.meta.run_id}/{commit.checkpoint_id}: "
            "a file copied from another checkpoint"
        )
    return CommittedCheckpoint(commit=commit, manifest_hash=sha256_hex(raw), raw=raw)


def read_rank_manifest(
    storage: Storage, run_id: str, committed: CommittedCheckpoint, rank: int
) -> RankManifest:
    """Read one rank's manifest and check it against the hash the COMMIT records."""
    commit = committed.commit
    refs = [r for r in commit.ranks if r.rank == rank]
    if not refs:
        raise CheckpointFormatError(
            f"{commit.checkpoint_id}: no manifest for rank {rank} "
            f"(world size {commit.meta.world_size})"
        )
    ref = refs[0]
    key = checkpoint_prefix(run_id, commit.checkpoint_id) + ref.key
    try:
        raw = storage.read(key)
    except NotFoundError:
        raise IntegrityError(
            f"{commit.checkpoint_id}: rank manifest {ref.key} is missing from storage"
        ) from None
    digest = sha256_hex(raw)
    if len(raw) != ref.size or digest != ref.sha256:
        raise IntegrityError(
            f"{commit.checkpoint_id}: rank manifest {ref.key} has {len(raw)} bytes hashing to "
            f"{digest[:16]}…, COMMIT records {ref.size} bytes / {ref.sha256[:16]}… "
            "(modified or truncated)"
        )
    manifest = RankManifest.from_bytes(raw, f"{commit.checkpoint_id}/{ref.key}")
    if manifest.checkpoint_id != commit.checkpoint_id or manifest.rank != rank:
        raise CheckpointFormatError(
            f"{commit.checkpoint_id}/{ref.key}: describes another checkpoint"
        )
    return manifest


def read_checkpoint(
    storage: Storage, run_id: str, ckpt_id: str, rank: int = 0
) -> tuple[CommittedCheckpoint, RankManifest]:
    committed = read_commit(storage, run_id, ckpt_id)
    return committed, read_rank_manifest(storage, run_id, committed, rank)


def read_validation(storage: Storage, run_id: str, ckpt_id: str) -> ValidationRecord | None:
    try:
        raw = storage.read(validation_key(run_id, ckpt_id))
    except NotFoundError:
        return None
    try:
        return ValidationRecord.from_bytes(raw)
    except (CheckpointFormatError, ValueError):
        return None


@contextlib.contextmanager
def blob_bytes(storage: Storage, key: str) -> Iterator[memoryview]:
    """The whole object, memory-mapped when the backend is a local filesystem."""
    if isinstance(storage, LocalStorage):
        path = os.path.join(os.fspath(storage.root), *validate_key(key).split("/"))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError(f"reading {path}: no such object") from None
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    yield memoryview(b"")
                    return
                mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            view = memoryview(mm)
            try:
                yield view
            finally:
                view.release()
                mm.close()
            return
    yield memoryview(storage.read(key))


def read_tensor_bytes(
    storage: Storage,
    run_id: str,
    manifest: RankManifest,
    entry: TensorEntry,
    name: str,
    out: memoryview | None = None,
    shuffler: Shuffler = PY_SHUFFLER,
) -> memoryview:
    """Decode one tensor's raw bytes, checking every hash and size on the way.

    Raises :class:`IntegrityError` (missing/flipped/truncated data) or
    :class:`CheckpointFormatError`; never interprets the bytes.
    """
    what = f"{manifest.checkpoint_id}: {name!r}"
    target = out if out is not None else memoryview(bytearray(entry.nbytes))
    if len(target) != entry.nbytes:
        raise ValueError(f"{what}: output buffer has {len(target)} bytes, tensor {entry.nbytes}")
    if entry.inline is not None:
        if sha256_hex(entry.inline) != entry.inline_sha256:
            raise IntegrityError(f"{what}: inline data does not match its SHA-256")
        target[:] = entry.inline
        return target
    offset = 0
    for digest in entry.chunks:
        blob = manifest.blobs[digest]
        key = blob_key(run_id, digest)
        try:
            with blob_bytes(storage, key) as stored:
                if len(stored) != blob.size:
                    raise IntegrityError(
                        f"{what}: blob {digest[:16]}… has {len(stored)} bytes, manifest says "
                        f"{blob.size} (truncated or overwritten)"
                    )
                got = sha256_hex(stored)
                if got != digest:
                    raise IntegrityError(
                        f"{what}: blob {digest[:16]}… hashes to {got[:16]}… (corrupted bytes)"
                    )
                part = target[offset : offset + blob.raw_size]
                try:
                    decode(stored, blob.codec, blob.raw_size, out=part, shuffler=shuffler)
                except CodecError as e:
                    raise IntegrityError(f"{what}: blob {digest[:16]}…: {e}") from None
        except NotFoundError:
            raise IntegrityError(f"{what}: blob {digest[:16]}… is missing from storage") from None
        same = blob.codec.codec == "none" and blob.raw_sha256 == digest  # already checked
        if not same and sha256_hex(part) != blob.raw_sha256:
            raise IntegrityError(f"{what}: blob {digest[:16]}… decodes to the wrong bytes")
        offset += blob.raw_size
    return target


# --------------------------------------------------------------------------- listing


def list_runs(storage: Storage) -> list[str]:
    """Run ids with at least one object under ``<run>/steps/``."""
    out: list[str] = []
    for info in storage.list("", delimiter="/"):
        if info.is_prefix:
            run = info.key.rstrip("/")
            if _RUN_ID.match(run) and any(True for _ in _take(storage.list(f"{run}/steps/"), 1)):
                out.append(run)
    return out


def _take(it: Iterator[Any], n: int) -> Iterator[Any]:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def list_checkpoints(
    storage: Storage, run_id: str, *, include_broken: bool = True, include_heartbeat: bool = True
) -> list[CheckpointRecord]:
    """Every committed checkpoint of ``run_id``, oldest first (step, then tier).

    One paginated listing of ``<run>/steps/`` plus one read of each COMMIT
    (and VALIDATION.json, when present). Status: ``valid``/``corrupted`` from
    the validator's record for exactly this COMMIT, else ``pending`` (never
    offered for resume before it is verified). A COMMIT that cannot be parsed
    is reported as ``corrupted`` (``extra["error"]``) unless
    ``include_broken=False``. Folders without a COMMIT do not exist. With
    ``include_heartbeat`` the newest L0 heartbeat of rank 0 is listed too
    (:func:`newest_heartbeat_record`), for the ladder's heartbeat rung.
    """
    prefix = steps_prefix(run_id)
    folders: dict[str, set[str]] = {}
    for info in storage.list(prefix):
        rest = info.key[len(prefix) :]
        folder, _, name = rest.partition("/")
        if name and "/" not in name:
            folders.setdefault(folder, set()).add(name)
    out: list[CheckpointRecord] = []
    for folder, names in folders.items():
        if COMMIT not in names:
            continue
        try:
            tier, step = parse_checkpoint_id(folder)
        except ValueError:
            continue
        try:
            committed = read_commit(storage, run_id, folder)
        except CheckpointNotFoundError:
            continue  # deleted between listing and reading
        except (CheckpointFormatError, StorageError) as e:
            if include_broken:
                out.append(
                    CheckpointRecord(
                        id=folder,
                        step=step,
                        tier=tier,
                        status=CheckpointStatus.CORRUPTED,
                        extra={"error": str(e)},
                    )
                )
            continue
        status = CheckpointStatus.PENDING
        reason = ""
        if VALIDATION in names:
            v = read_validation(storage, run_id, folder)
            if v is not None and v.commit_sha256 == committed.manifest_hash:
                status = v.status
                reason = v.reason
        rec = committed.commit.record(committed.manifest_hash, status)
        if reason:
            rec.extra["status_reason"] = reason
        out.append(rec)
    if include_heartbeat:
        hb = newest_heartbeat_record(storage, run_id)
        if hb is not None:
            out.append(hb)
    out.sort(key=lambda r: (r.step, list(Tier).index(r.tier)))
    return out


def newest_heartbeat_record(
    storage: Storage, run_id: str, rank: int = 0
) -> CheckpointRecord | None:
    """The newest L0 heartbeat of ``rank`` as a record (``heartbeat_step_<n>``), if any.

    Heartbeats live in a ring object, not in ``steps/``; a readable ring is
    ``valid`` (its JSON is its integrity check). Retention never deletes it.
    """
    try:
        entries = read_heartbeat(storage, run_id, rank)
    except (CheckpointFormatError, StorageError):
        return None
    if not entries:
        return None
    hb = entries[-1]
    return CheckpointRecord(
        id=checkpoint_id(Tier.HEARTBEAT, hb.step),
        step=hb.step,
        tier=Tier.HEARTBEAT,
        status=CheckpointStatus.VALID,
        created_at=hb.time,
        manifest_hash=sha256_hex(dumps(hb.to_json())),
        reason="L0 heartbeat",
        extra={"ring": heartbeat_key(run_id, rank)},
    )


# --------------------------------------------------------------------------- verification


@dataclass
class VerifyResult:
    """Hash-level verification of one checkpoint (:func:`verify_hashes`)."""

    checkpoint_id: str
    manifest_hash: str = ""
    ok: bool = True
    errors: list[str] = field(default_factory=list)
    blobs_checked: int = 0
    bytes_checked: int = 0
    missing: list[str] = field(default_factory=list)
    """Digests of blobs that are gone."""
    mismatched: list[str] = field(default_factory=list)
    """Digests of blobs whose bytes do not hash to their name (or have the wrong size)."""

    def fail(self, message: str) -> None:
        self.ok = False
        self.errors.append(message)

    @property
    def reason(self) -> str:
        if self.ok:
            return ""
        more = f" (+{len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        return self.errors[0] + more


#: ``progress(bytes_done, bytes_total)``
Progress = Callable[[int, int], None]


def verify_hashes(
    storage: Storage,
    run_id: str,
    ckpt_id: str,
    *,
    progress: Progress | None = None,
    ranks: Sequence[int] | None = None,
) -> VerifyResult:
    """Re-read every byte of a checkpoint and compare SHA-256s (streaming, torch-free).

    Checks the COMMIT parses, each rank manifest matches the hash the COMMIT
    records, and every referenced blob exists, has its recorded size and
    hashes to its name. Never raises for bad data: the result says what is
    wrong. Decoding (codec, raw hashes, shapes) is the loader's job
    (:mod:`ckpt_agent.persist.validate`).
    """
    result = VerifyResult(checkpoint_id=ckpt_id)
    try:
        committed = read_commit(storage, run_id, ckpt_id)
    except (CheckpointNotFoundError, CheckpointFormatError, StorageError) as e:
        result.fail(str(e))
        return result
    result.manifest_hash = committed.manifest_hash
    wanted: dict[str, BlobEntry] = {}
    for ref in committed.commit.ranks:
        if ranks is not None and ref.rank not in ranks:
            continue
        try:
            m = read_rank_manifest(storage, run_id, committed, ref.rank)
        except (CheckpointFormatError, IntegrityError, StorageError) as e:
            result.fail(str(e))
            continue
        for name, t in (*m.tensors.items(), *m.files.items()):
            if t.inline is not None and sha256_hex(t.inline) != t.inline_sha256:
                result.fail(f"{ckpt_id}: inline data of {name!r} does not match its SHA-256")
        for digest in m.referenced_blobs():
            wanted[digest] = m.blobs[digest]
    total = sum(b.size for b in wanted.values())
    done = 0
    for digest in sorted(wanted):
        blob = wanted[digest]
        key = blob_key(run_id, digest)
        h = hashlib.sha256()
        n = 0
        try:
            with storage.open_read(key) as f:
                while True:
                    chunk = f.read(_READ_CHUNK)
                    if not chunk:
                        break
                    h.update(chunk)
                    n += len(chunk)
                    if progress is not None:
                        progress(done + n, total)
        except NotFoundError:
            result.missing.append(digest)
            result.fail(f"{ckpt_id}: blob {digest[:16]}… is missing from storage")
            continue
        except StorageError as e:
            result.fail(f"{ckpt_id}: blob {digest[:16]}…: {e}")
            continue
        result.blobs_checked += 1
        result.bytes_checked += n
        done += blob.size
        if n != blob.size:
            result.mismatched.append(digest)
            result.fail(
                f"{ckpt_id}: blob {digest[:16]}… has {n} bytes, manifest says {blob.size} "
                "(truncated?)"
            )
        elif h.hexdigest() != digest:
            result.mismatched.append(digest)
            result.fail(f"{ckpt_id}: blob {digest[:16]}… does not match its SHA-256 (corrupted)")
        if progress is not None:
            progress(done, total)
    return result


# --------------------------------------------------------------------------- heartbeat


@dataclass(frozen=True)
class Heartbeat:
    """One L0 heartbeat: where the run was (step, epoch, data position, RNG)."""

    step: int
    time: float
    epoch: int | None = None
    data: Json = None
    """Tagged-JSON data position (:mod:`ckpt_agent.format.jsontree`)."""
    rng: Json = None
    """Tagged-JSON RNG states."""

    def to_json(self) -> dict[str, Json]:
        return {
            "step": self.step,
            "time": self.time,
            "epoch": self.epoch,
            "data": self.data,
            "rng": self.rng,
        }

    @classmethod
    def from_json(cls, d: Json, what: str) -> Heartbeat:
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{what}: heartbeat entry is not an object")
        epoch = d.get("epoch")
        return cls(
            step=_nonneg(d.get("step"), f"{what}.step"),
            time=float(_get(d, "time", (int, float), what)),
            epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
            data=d.get("data"),
            rng=d.get("rng"),
        )


def encode_heartbeats(run_id: str, rank: int, entries: Sequence[Heartbeat]) -> bytes:
    """The heartbeat object (newest last), dropping the oldest entries to stay < 512 KB."""
    items = list(entries)
    while True:
        data = dumps(
            {
                "format": FORMAT_HEARTBEAT,
                "version": FORMAT_VERSION,
                "run_id": run_id,
                "rank": rank,
                "entries": [e.to_json() for e in items],
            }
        )
        if len(data) < HEARTBEAT_MAX_BYTES or len(items) <= 1:
            if len(data) >= HEARTBEAT_MAX_BYTES:
                raise ValueError(
                    f"one heartbeat is {len(data)} bytes, over the {HEARTBEAT_MAX_BYTES} limit: "
                    "keep the data position small (ids and offsets, not data)"
                )
            return data
        items = items[1:]


def read_heartbeat(storage: Storage, run_id: str, rank: int = 0) -> list[Heartbeat]:
    """The heartbeat ring of one rank, oldest first (empty when there is none)."""
    try:
        raw = storage.read(heartbeat_key(run_id, rank))
    except NotFoundError:
        return []
    d = _loads(raw, "heartbeat")
    if d.get("format") != FORMAT_HEARTBEAT:
        raise CheckpointFormatError("heartbeat: wrong format")
    entries = d.get("entries") or []
    if not isinstance(entries, list):
        raise CheckpointFormatError("heartbeat: entries must be a list")
    return [Heartbeat.from_json(e, "heartbeat") for e in entries]
