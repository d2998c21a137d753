"""Kubernetes Events for every decision, behind a tiny interface.

Handlers call :meth:`EventSink.emit` with the object the Event is about (a
PyTorchJob, a policy, a pod). In the operator, :class:`KopfEvents` posts
through kopf's event queue (and logs the same line, structured); tests use
:class:`RecordedEvents`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

__all__ = ["EventSink", "EventType", "KopfEvents", "RecordedEvent", "RecordedEvents"]

EventType = Literal["Normal", "Warning"]

log = logging.getLogger("ckpt_operator.events")


class EventSink(Protocol):
    def emit(self, obj: Mapping[str, Any], type_: EventType, reason: str, message: str) -> None: ...


def _ref(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind', '?')}/{meta.get('namespace', '')}/{meta.get('name', '')}"


class KopfEvents:
    """Posts Events through kopf (non-blocking, batched by kopf's poster)."""

    def emit(self, obj: Mapping[str, Any], type_: EventType, reason: str, message: str) -> None:
        import kopf

        log.log(
            logging.WARNING if type_ == "Warning" else logging.INFO,
            "%s %s: %s",
            reason,
            _ref(obj),
            message,
            extra={"event_reason": reason, "event_type": type_, "object": _ref(obj)},
        )
        meta = obj.get("metadata") or {}
        if not meta.get("name") or not meta.get("uid"):
            return  # not persisted yet (a pod under admission): the log line is all we can do
        # kopf truncates long messages itself; keep ours readable anyway.
        kopf.event(
            kopf.Body(cast(kopf.RawBody, dict(obj))),
            type=type_,
            reason=reason,
            message=message[:1000],
        )


@dataclass(frozen=True)
class RecordedEvent:
    obj: str
    type: EventType
    reason: str
    message: str


@dataclass
class RecordedEvents:
    """Collects events (tests)."""

    events: list[RecordedEvent] = field(default_factory=list)

    def emit(self, obj: Mapping[str, Any], type_: EventType, reason: str, message: str) -> None:
        self.events.append(RecordedEvent(_ref(obj), type_, reason, message))

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]
