"""Kubernetes Events for every decision, behind a tiny interface.

Handlers call :meth:`EventSink.emit` with the object the Event is about (a
PyTorchJob, a policy, a pod). In the operator, :class:`KopfEvents` posts
through kopf's event queue (and logs the same line, structured); tests use
:class:`RecordedEvents`.

kopf's queue is only reachable from inside its watch-event handlers (it lives in
context variables set per object worker). Admission webhook requests and the
operator's own background loops (retention) run outside them, so there
:class:`KopfEvents` posts the Event itself through ``post`` (the API client), off
the event loop.

Every Event's reason and message, and the log line that mirrors it, go through the one
sanitizer (:func:`ckpt_agent.text.clean`) here, whatever the caller passed: a message
quotes stored strings (run ids, ``OWNER.json`` namespaces, reasons, storage errors), and
``kubectl describe`` shows it to a person. One bounded line (:data:`EVENT_LIMIT`
characters), control and bidi characters spelled out (``\\x1b``, ``\\u202e``).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

from ckpt_agent.text import EVENT_LIMIT, clean
from ckpt_operator.model.bodies import meta_of

__all__ = [
    "EventSink",
    "EventType",
    "KopfEvents",
    "RecordedEvent",
    "RecordedEvents",
    "build_event",
    "event_text",
]

EventType = Literal["Normal", "Warning"]

log = logging.getLogger("ckpt_operator.adapters.events")


class EventSink(Protocol):
    def emit(self, obj: Mapping[str, Any], type_: EventType, reason: str, message: str) -> None: ...


#: Longest Event reason (the API's are CamelCase words; ours are short).
REASON_LIMIT = 128


def _ref(obj: Mapping[str, Any]) -> str:
    meta = meta_of(obj)
    return clean(f"{obj.get('kind', '?')}/{(meta.namespace or '')}/{(meta.name or '')}")


def event_text(reason: str, message: str) -> tuple[str, str]:
    """An Event's ``(reason, message)`` as they may be shown: through :func:`clean`, one
    bounded line each (every sink calls this; so may a caller that logs them itself)."""
    return clean(reason, REASON_LIMIT), clean(message, EVENT_LIMIT)


def build_event(
    obj: Mapping[str, Any],
    type_: EventType,
    reason: str,
    message: str,
    *,
    component: str = "ckpt-operator",
    now: _dt.datetime | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about ``obj`` (in its namespace; ``default`` for cluster objects);
    reason and message cleaned (:func:`event_text`)."""
    reason, message = event_text(reason, message)
    meta = meta_of(obj)
    namespace = str(meta.namespace or "default")
    stamp = (now or _dt.datetime.now(_dt.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    ref = {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "name": meta.name,
        "namespace": meta.namespace,
        "uid": meta.uid,
    }
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.name}.", "namespace": namespace},
        "involvedObject": {k: v for k, v in ref.items() if v},
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class KopfEvents:
    """Posts Events through kopf (non-blocking, batched by kopf's poster).

    ``post`` (a blocking ``Event body -> None``) is used where kopf's queue is not
    available (see the module docstring); without it such Events are only logged.
    """

    def __init__(self, post: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._post = post

    def _post_safely(self, body: dict[str, Any]) -> None:
        assert self._post is not None
        try:
            self._post(body)
        except Exception as e:  # an Event is never worth failing a decision for
            log.warning(
                "could not post Event %s: %s", clean(body.get("reason"), REASON_LIMIT), clean(e)
            )

    def emit(self, obj: Mapping[str, Any], type_: EventType, reason: str, message: str) -> None:
        import kopf

        reason, message = event_text(reason, message)
        log.log(
            logging.WARNING if type_ == "Warning" else logging.INFO,
            "%s %s: %s",
            reason,
            _ref(obj),
            message,
            extra={"event_reason": reason, "event_type": type_, "object": _ref(obj)},
        )
        meta = meta_of(obj)
        if not meta.name or not meta.uid:
            return  # not persisted yet (a pod under admission): the log line is all we can do
        # Cleaned and bounded above (kopf would cut a long message itself, mid-escape).
        try:
            kopf.event(
                kopf.Body(cast(kopf.RawBody, dict(obj))),
                type=type_,
                reason=reason,
                message=message,
            )
            return
        except LookupError:  # outside kopf's watch-event handlers (webhooks, our loops)
            if self._post is None:
                return
        body = build_event(obj, type_, reason, message)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._post_safely(body)
            return
        loop.run_in_executor(None, self._post_safely, body)  # never block the event loop


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
        reason, message = event_text(reason, message)  # as the cluster would see them
        self.events.append(RecordedEvent(_ref(obj), type_, reason, message))

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]
