"""Where a checkpoint lives in storage: format constants, names, keys and canonical JSON.

Torch-free and numpy-free: the operator imports it. The format is specified
in ``docs/format.md``; in short::

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

The documents themselves are in :mod:`ckpt_agent.format.manifest` (records)
and :mod:`ckpt_agent.format.heartbeat`; reading them back is
:mod:`ckpt_agent.format.readers`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Final, Protocol, TypeGuard

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import RANK_DIGITS, STEP_DIGITS, Json, rank_name

_blake3: ModuleType | None
try:  # the agent's extra; the operator's image has no need for it
    import blake3 as _blake3
except ImportError:  # pragma: no cover - depends on the install
    _blake3 = None

__all__ = [
    "AUDIT_LOG",
    "AUDIT_TAIL_BYTES",
    "BLAKE3",
    "BLOB_MAX_BYTES",
    "CHUNK_MAX_BYTES",
    "COMMIT",
    "COMMIT_MAX_BYTES",
    "DTYPE_ITEMSIZE",
    "FLOAT_DTYPES",
    "FORMAT_VERSION",
    "HEARTBEAT_MAX_BYTES",
    "JSON_MAX_INT_DIGITS",
    "JSON_MAX_NUMBER_CHARS",
    "MANIFEST_MAX_BYTES",
    "RECOVER_MAX_BYTES",
    "RECOVER_REQUEST",
    "TENSOR_MAX_BYTES",
    "TENSOR_MAX_DIMS",
    "TENSOR_MAX_ELEMENTS",
    "VALIDATION",
    "VALIDATION_MAX_BYTES",
    "Hasher",
    "audit_key",
    "blob_key",
    "blobs_prefix",
    "checkpoint_prefix",
    "commit_key",
    "dumps",
    "heartbeat_key",
    "is_digest",
    "is_rank_file",
    "is_run_id",
    "loads",
    "parse_checkpoint_id",
    "rank_manifest_key",
    "recover_request_key",
    "run_prefix",
    "sha256_hex",
    "steps_prefix",
    "validate_run_id",
    "validation_key",
]

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

# Reader limits (docs/format.md, "Limits"): every reader (trainer, validator, ``ckpt``,
# the operator) refuses a document or blob past them before allocating for it. The
# writer never produces anything larger, so they only stop forged or damaged data.
#: Largest COMMIT (a few hundred bytes per rank).
COMMIT_MAX_BYTES: Final = 4 * 1024 * 1024
#: Largest rank manifest (the state tree, tensor and blob entries, inline tensors).
MANIFEST_MAX_BYTES: Final = 64 * 1024 * 1024
#: Largest VALIDATION.json.
VALIDATION_MAX_BYTES: Final = 1024 * 1024
#: Largest RECOVER.json (``ckpt recover`` writes a few hundred bytes).
RECOVER_MAX_BYTES: Final = 1024 * 1024
#: Readers of ``audit.log`` read only its last this many bytes (older lines are dropped).
AUDIT_TAIL_BYTES: Final = 4 * 1024 * 1024
#: Largest raw (decoded) size of one chunk: the writer cuts tensors at this size.
CHUNK_MAX_BYTES: Final = 16 * 1024 * 1024
#: Largest stored size of one blob (a zstd frame of an incompressible chunk grows a little).
BLOB_MAX_BYTES: Final = CHUNK_MAX_BYTES + CHUNK_MAX_BYTES // 64
#: Largest tensor, in elements and in bytes, and its most dimensions.
TENSOR_MAX_ELEMENTS: Final = 2**36
TENSOR_MAX_BYTES: Final = 2**38
TENSOR_MAX_DIMS: Final = 32
#: Integers in a manifest have at most this many digits (2**128 has 39).
JSON_MAX_INT_DIGITS: Final = 39
#: Number literals in a manifest are at most this long (a float's repr is under 25).
JSON_MAX_NUMBER_CHARS: Final = 64

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

# Matched with ``fullmatch``: ``$`` would also accept a trailing newline.
_HEX64 = re.compile(r"[0-9a-f]{64}")
_CKPT_ID = re.compile(rf"(heartbeat|pulse|full)_step_(\d{{{STEP_DIGITS}}})")
_RANK_FILE = re.compile(rf"rank_(\d{{{RANK_DIGITS}}})\.json")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


# --------------------------------------------------------------------------- names


def is_digest(value: object) -> TypeGuard[str]:
    """A lowercase SHA-256 hex digest (64 characters, nothing else)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def is_rank_file(name: str) -> bool:
    """A rank manifest's name inside a checkpoint folder (``rank_00003.json``)."""
    return _RANK_FILE.fullmatch(name) is not None


def is_run_id(name: str) -> bool:
    """Whether ``name`` is a valid run id (see :func:`validate_run_id`)."""
    return _RUN_ID.fullmatch(name) is not None


def validate_run_id(run_id: str) -> str:
    """A run id is one path segment: letters, digits, ``.``, ``_``, ``-`` (max 253)."""
    if not isinstance(run_id, str) or not is_run_id(run_id) or run_id in (".", ".."):
        raise ValueError(
            f"invalid run id {run_id!r}: use letters, digits, '.', '_' and '-' "
            "(starting with a letter or digit, at most 253 characters)"
        )
    return run_id


def parse_checkpoint_id(ckpt_id: str) -> tuple[Tier, int]:
    """``pulse_step_000000000120`` → ``(Tier.PULSE, 120)``; ValueError otherwise."""
    m = _CKPT_ID.fullmatch(ckpt_id)
    if not m:
        raise ValueError(
            f"not a checkpoint id: {ckpt_id!r} (expected <tier>_step_<{STEP_DIGITS} digits>)"
        )
    return Tier(m.group(1)), int(m.group(2))


# --------------------------------------------------------------------------- keys


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
    if not is_digest(digest):
        raise CheckpointFormatError(f"not a SHA-256 hex digest: {digest!r}")
    return f"{blobs_prefix(run_id)}{digest[:2]}/{digest}"


def heartbeat_key(run_id: str, rank: int) -> str:
    return f"{validate_run_id(run_id)}/heartbeat/{rank_name(rank)}.json"


def audit_key(run_id: str) -> str:
    return run_prefix(run_id) + AUDIT_LOG


def recover_request_key(run_id: str) -> str:
    return run_prefix(run_id) + RECOVER_REQUEST


# --------------------------------------------------------------------------- bytes


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


class Hasher(Protocol):
    """What :mod:`hashlib` and :mod:`blake3` hash objects share."""

    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


#: BLAKE3-256 hashers (one thread each), or None where the ``blake3`` package is not
#: installed (the operator's image: it never restores, SHA-256 verifies there).
BLAKE3: Final[Callable[[], Hasher] | None] = None if _blake3 is None else _blake3.blake3


def dumps(obj: Json) -> bytes:
    """Canonical JSON bytes (sorted keys, no NaN) for every manifest-like object."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def loads(data: bytes, what: str, max_bytes: int = MANIFEST_MAX_BYTES) -> dict[str, Json]:
    """Parse one JSON object; anything else is a CheckpointFormatError.

    Refused before or while parsing, never allocated for: more than ``max_bytes``,
    NaN/Infinity, an integer of more than :data:`JSON_MAX_INT_DIGITS` digits, a
    float that overflows to infinity, nesting past the interpreter's recursion
    limit (about 1000 levels; state trees themselves stop at 64, see
    :mod:`ckpt_agent.format.jsontree`).
    """
    if len(data) > max_bytes:
        raise CheckpointFormatError(
            f"{what}: {len(data)} bytes, over the {max_bytes}-byte limit of the format"
        )

    def no_constants(name: str) -> object:
        raise CheckpointFormatError(f"{what}: non-standard JSON constant {name}")

    try:
        obj = json.loads(
            data,
            parse_constant=no_constants,
            parse_int=functools.partial(_parse_int, what),
            parse_float=functools.partial(_parse_float, what),
        )
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{what}: not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointFormatError(f"{what}: nested too deeply") from None
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{what}: expected a JSON object")
    return obj


def _parse_int(what: str, text: str) -> int:
    if len(text.lstrip("-")) > JSON_MAX_INT_DIGITS:
        raise CheckpointFormatError(
            f"{what}: an integer of {len(text)} digits (at most {JSON_MAX_INT_DIGITS})"
        )
    return int(text)


def _parse_float(what: str, text: str) -> float:
    value = float(text) if len(text) <= JSON_MAX_NUMBER_CHARS else math.inf
    if not math.isfinite(value):
        raise CheckpointFormatError(f"{what}: number {text[:32]!r} is out of range")
    return value
