"""Typed field access for parsing format documents: every bad field is a CheckpointFormatError.

Used by :mod:`ckpt_agent.format.manifest` and :mod:`ckpt_agent.format.heartbeat`
to read parsed JSON (``what`` names the document in the error message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.layout import is_digest
from ckpt_agent.records import Json

__all__ = ["digest_field", "nonneg_field", "optional_field", "required_field"]


def required_field(
    d: Mapping[str, Json], key: str, kind: type | tuple[type, ...], what: str
) -> Any:
    """``d[key]``, which must be present and an instance of ``kind`` (a bool is no number)."""
    if key not in d:
        raise CheckpointFormatError(f"{what}: missing field {key!r}")
    v = d[key]
    bad_bool = isinstance(v, bool) and kind in (int, float, (int, float))
    if not isinstance(v, kind) or bad_bool:
        raise CheckpointFormatError(f"{what}: field {key!r} has the wrong type")
    return v


def optional_field(
    d: Mapping[str, Json], key: str, kind: type | tuple[type, ...], what: str
) -> Any:
    """Like :func:`required_field`, but a missing or ``null`` field is ``None``."""
    if d.get(key) is None:
        return None
    return required_field(d, key, kind, what)


def digest_field(v: Json, what: str) -> str:
    """``v`` if it is a SHA-256 hex digest."""
    if not is_digest(v):
        raise CheckpointFormatError(f"{what}: not a SHA-256 hex digest: {v!r}")
    return v


def nonneg_field(v: Json, what: str) -> int:
    """``v`` if it is a non-negative integer (not a bool)."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CheckpointFormatError(f"{what}: expected a non-negative integer")
    return v
