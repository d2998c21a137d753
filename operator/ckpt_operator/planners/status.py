"""Kubernetes conditions and the policy's status fields (pure).

Conditions follow the API conventions: one entry per ``type``;
``lastTransitionTime`` changes only when ``status`` changes; ``reason`` is
CamelCase; ``observedGeneration`` says which spec they describe.

A condition's ``reason`` and ``message`` go through the one sanitizer
(:func:`ckpt_agent.text.clean`) in :func:`set_condition`, whatever the caller
passed: ``kubectl describe`` shows them to a person, and a message quotes stored
strings (run ids, ``OWNER.json`` namespaces, storage errors). One bounded line
(:data:`~ckpt_agent.text.STATUS_LIMIT` characters), control and bidi characters
spelled out (``\\x1b``, ``\\u202e``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ckpt_agent.text import STATUS_LIMIT, clean
from ckpt_operator.model.jobs import format_time

__all__ = [
    "REASON_LIMIT",
    "ConditionStatus",
    "condition_differs",
    "get_condition",
    "policy_ready_status",
    "set_condition",
]

ConditionStatus = Literal["True", "False", "Unknown"]

#: Longest condition reason (CamelCase words; ours are short).
REASON_LIMIT = 128


def get_condition(
    conditions: Sequence[Mapping[str, Any]] | None, type_: str
) -> Mapping[str, Any] | None:
    for cond in conditions or ():
        if cond.get("type") == type_:
            return cond
    return None


def condition_differs(
    current: Mapping[str, Any] | None, status: ConditionStatus, reason: str, message: str
) -> bool:
    """Would :func:`set_condition` change ``current`` (the condition as stored)? Compared as
    stored: ``reason`` and ``message`` cleaned and bounded the same way, so a long message or
    one with a character the sanitizer escapes does not look new on every pass."""
    if current is None:
        return True
    return (
        current.get("status") != status
        or current.get("reason") != clean(reason, REASON_LIMIT)
        or current.get("message") != clean(message, STATUS_LIMIT)
    )


def set_condition(
    conditions: Sequence[Mapping[str, Any]] | None,
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    now: float,
    observed_generation: int | None = None,
) -> list[dict[str, Any]]:
    """A new conditions list with ``type_`` set (others kept, order kept, new ones appended);
    ``reason`` and ``message`` cleaned and bounded (:func:`ckpt_agent.text.clean`)."""
    reason, message = clean(reason, REASON_LIMIT), clean(message, STATUS_LIMIT)
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions or ():
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        same = cond.get("status") == status
        new = {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": (
                cond.get("lastTransitionTime") or format_time(now) if same else format_time(now)
            ),
        }
        if observed_generation is not None:
            new["observedGeneration"] = observed_generation
        out.append(new)
    if not found:
        new = {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": format_time(now),
        }
        if observed_generation is not None:
            new["observedGeneration"] = observed_generation
        out.append(new)
    return out


def policy_ready_status(
    previous: Mapping[str, Any] | None,
    *,
    generation: int | None,
    errors: Sequence[str],
    now: float,
) -> dict[str, Any]:
    """The status patch after validating a policy spec: ``Ready`` and ``observedGeneration``."""
    prev_conditions = (previous or {}).get("conditions")
    if errors:
        conditions = set_condition(
            prev_conditions,
            "Ready",
            "False",
            "InvalidSpec",
            "; ".join(errors),
            now=now,
            observed_generation=generation,
        )
    else:
        conditions = set_condition(
            prev_conditions,
            "Ready",
            "True",
            "Validated",
            "policy is valid; its agent config is published",
            now=now,
            observed_generation=generation,
        )
    return {"observedGeneration": generation, "conditions": conditions}
