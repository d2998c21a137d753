"""CheckpointPolicy validation with field-level messages (pure).

The CRD schema and its CEL rules reject most mistakes at the API server;
the validating webhook runs the same pydantic model as the agent and the
operator, so anything the schema cannot express (and any drift between the
two) is still rejected, naming the field: ``spec.tiers.pulse.minInterval:
Input should be greater than or equal to 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from ckpt_agent.policy import CheckpointPolicySpec

__all__ = ["field_errors", "parse_policy_spec"]


def _path(loc: tuple[int | str, ...], root: str) -> str:
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}"
    return out


def field_errors(error: ValidationError, root: str = "spec") -> list[str]:
    """``"<field path>: <message>"`` for each pydantic error (camelCase paths, as on the wire)."""
    out: list[str] = []
    for err in error.errors(include_url=False):
        msg = str(err.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ")
        loc = tuple(p for p in err.get("loc", ()) if not (isinstance(p, str) and "[" in p))
        out.append(f"{_path(loc, root)}: {msg}")
    return out


def parse_policy_spec(
    spec: Mapping[str, Any] | None,
) -> tuple[CheckpointPolicySpec | None, list[str]]:
    """Validate a wire-format spec; returns (model, []) or (None, field errors)."""
    try:
        return CheckpointPolicySpec.model_validate(dict(spec or {})), []
    except ValidationError as e:
        return None, field_errors(e)
