"""CheckpointPolicy validation with field-level messages (pure).

The CRD schema and its CEL rules reject most mistakes at the API server;
the validating webhook runs the same pydantic model as the agent and the
operator, so anything the schema cannot express (and any drift between the
two) is still rejected, naming the field: ``spec.tiers.pulse.minInterval:
Input should be greater than or equal to 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pydantic import ValidationError

from ckpt_agent.format.layout import is_run_id, parse_checkpoint_id
from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_operator.model import constants as c

__all__ = ["CHECKED_ANNOTATIONS", "annotation_errors", "field_errors", "parse_policy_spec"]


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


def _run_id_error(value: str) -> str | None:
    if is_run_id(value):
        return None
    return (
        "must be one path segment of letters, digits, '.', '_' and '-', starting with a "
        "letter or digit (at most 253 characters); remove it to get the job's own run id"
    )


def _checkpoint_id_error(value: str) -> str | None:
    try:
        parse_checkpoint_id(value)
    except ValueError:
        return (
            "must be a checkpoint id such as pulse_step_000000000120 "
            "(<tier>_step_<12 digits>); remove it to resume from the newest valid checkpoint"
        )
    return None


def _count_error(value: str) -> str | None:
    if value.isascii() and value.isdigit() and len(value) <= 18:
        return None
    return "must be a non-negative integer (the operator sets it; remove it)"


def _step_error(value: str) -> str | None:
    if value.isascii() and value.isdigit() and len(value) <= 18:
        return None
    return "must be the training step to resume from (a non-negative integer)"


def _flag_error(value: str) -> str | None:
    if value.strip().lower() in ("true", "false"):
        return None
    return 'must be "true" or "false"'


#: Longest ``recover-by`` / ``recover-reason`` (an annotation, not a document).
_MAX_TEXT = 1024


def _text_error(value: str) -> str | None:
    if value.strip() and len(value) <= _MAX_TEXT and value.isprintable():
        return None
    return f"must be non-empty printable text of at most {_MAX_TEXT} characters"


def _seconds_error(value: str) -> str | None:
    try:
        ok = float(value) > 0 and float(value) != float("inf")
    except ValueError:
        ok = False
    return None if ok else "must be a positive number of seconds (the operator sets it; remove it)"


_CHECKS = {
    c.ANN_RUN_ID: _run_id_error,
    c.ANN_RESUME_FROM: _checkpoint_id_error,
    c.ANN_RESUME_WEIGHTS: _checkpoint_id_error,
    c.ANN_RESUME_STEP: _count_error,
    c.ANN_RESTART_COUNT: _count_error,
    c.ANN_RUN_STARTED_AT: _seconds_error,
    c.ANN_MTBF_SECONDS: _seconds_error,
    c.ANN_RECOVER_STEP: _step_error,
    c.ANN_RECOVER_FORCE: _flag_error,
    c.ANN_RECOVER_DRY_RUN: _flag_error,
    c.ANN_RECOVER_BY: _text_error,
    c.ANN_RECOVER_REASON: _text_error,
}

#: The annotations :func:`annotation_errors` checks: it objects to nothing unless one of
#: them is present and new (absent or different in ``previous``). The chart's job
#: validation webhooks call the operator only then (their ``matchConditions`` list these
#: keys; tests/ckpt_operator/test_chart.py checks they agree).
CHECKED_ANNOTATIONS: Final = tuple(_CHECKS)


def annotation_errors(
    annotations: Mapping[str, Any], previous: Mapping[str, Any] | None = None
) -> list[str]:
    """``"<annotation>=<value>: <what is wrong, what to do>"`` for each bad ``ckpt.dev``
    annotation the operator acts on (empty: all fine).

    With ``previous`` (an update), only annotations whose value changed are checked,
    so a job admitted before the checks existed can still be updated (its status
    written) while the operator gives up on it.
    """
    errors: list[str] = []
    for key, check in _CHECKS.items():
        value = annotations.get(key)
        if value is None or (previous is not None and previous.get(key) == value):
            continue
        problem = check(value) if isinstance(value, str) else "must be a string"
        if problem is not None:
            shown = repr(value)[:80]
            errors.append(f"annotation {key}={shown}: {problem}")
    step = annotations.get(c.ANN_RECOVER_STEP)
    if step is not None and (previous is None or previous.get(c.ANN_RECOVER_STEP) != step):
        missing = [k for k in (c.ANN_RECOVER_BY, c.ANN_RECOVER_REASON) if not annotations.get(k)]
        if missing:
            errors.append(
                f"annotation {c.ANN_RECOVER_STEP} needs {' and '.join(missing)}: say who asks "
                "for the manual recovery and why (ckpt recover --job J --step N --reason ...)"
            )
    return errors
