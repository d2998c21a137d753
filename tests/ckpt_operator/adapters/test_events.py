"""KopfEvents outside kopf's watch handlers (admission webhooks, background loops).

Found on the real control plane (e2e): ``kopf.event`` raises ``LookupError`` there
(its queue lives in per-worker context variables), which made the mutating webhook
fail and admit every pod without the agent. Outside those handlers the Event is
posted directly through the API client instead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from ckpt_agent.text import EVENT_LIMIT
from ckpt_operator.adapters.events import KopfEvents, RecordedEvents, build_event

JOB = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "PyTorchJob",
    "metadata": {"name": "train", "namespace": "ml", "uid": "u-1"},
}


def test_build_event_refers_to_the_object() -> None:
    ev = build_event(JOB, "Normal", "Injected", "pod x: injected")
    assert ev["metadata"] == {"generateName": "train.", "namespace": "ml"}
    assert ev["involvedObject"] == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "name": "train",
        "namespace": "ml",
        "uid": "u-1",
    }
    assert (ev["type"], ev["reason"], ev["message"], ev["count"]) == (
        "Normal",
        "Injected",
        "pod x: injected",
        1,
    )
    assert ev["source"] == {"component": "ckpt-operator"}
    assert ev["firstTimestamp"] == ev["lastTimestamp"]


def test_cluster_scoped_objects_get_events_in_default() -> None:
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "uid": "u"}}
    assert build_event(node, "Normal", "X", "m")["metadata"]["namespace"] == "default"


def test_outside_kopf_the_event_is_posted_directly() -> None:
    posted: list[dict[str, Any]] = []
    KopfEvents(post=posted.append).emit(JOB, "Warning", "GaveUp", "x" * 5000)
    (ev,) = posted
    assert ev["reason"] == "GaveUp" and len(ev["message"]) == 1000


def test_inside_an_event_loop_the_post_runs_off_the_loop() -> None:
    posted: list[str] = []
    done = threading.Event()

    def post(body: dict[str, Any]) -> None:
        posted.append(threading.current_thread().name)
        done.set()

    async def go() -> None:
        KopfEvents(post=post).emit(JOB, "Normal", "Injected", "m")
        await asyncio.get_running_loop().run_in_executor(None, done.wait, 5)

    asyncio.run(go())
    assert posted and posted[0] != threading.main_thread().name


def test_a_failing_post_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def post(body: dict[str, Any]) -> None:
        raise RuntimeError("403 Forbidden")

    KopfEvents(post=post).emit(JOB, "Normal", "Injected", "m")
    assert "could not post Event Injected" in caplog.text


def test_without_a_poster_the_event_is_still_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    KopfEvents().emit(JOB, "Normal", "Injected", "injected the agent")
    assert any(
        r.getMessage().startswith("Injected") and "injected the agent" in r.getMessage()
        for r in caplog.records
    ), caplog.text


def test_objects_without_uid_are_only_logged() -> None:
    posted: list[dict[str, Any]] = []
    pod = {"kind": "Pod", "metadata": {"generateName": "x-", "namespace": "ml"}}
    KopfEvents(post=posted.append).emit(pod, "Normal", "Injected", "m")
    assert posted == []


# ------------------------------------------------------- stored text in Events (issue #28)

#: What an OWNER.json namespace or a planted name may hold: a colour, an OSC title ended by
#: BEL, a newline, a right-to-left override, a line separator; long enough to need a cut.
EVIL = "team-b\x1b[31m\x1b]0;pwned\x07\nforged line\u202eevil\u2028" + "z" * 3000
RAW = ("\x1b", "\x07", "\n", "\u202e", "\u2028")


def _raw(text: str) -> list[str]:
    return [c for c in RAW if c in text]


def test_an_event_built_from_stored_text_is_one_bounded_clean_line() -> None:
    ev = build_event(JOB, "Warning", "RunOwned\x1b[2J", f"run r belongs to namespace {EVIL}")
    assert _raw(ev["message"]) == [] and _raw(ev["reason"]) == []
    assert len(ev["message"]) <= EVENT_LIMIT and ev["message"].endswith("more characters)")
    assert "team-b\\x1b[31m\\x1b]0;pwned\\x07\\nforged line\\u202eevil\\u2028" in ev["message"]
    assert ev["reason"] == "RunOwned\\x1b[2J"


def test_every_sink_and_the_mirrored_log_line_get_clean_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    posted: list[dict[str, Any]] = []
    hostile_job: dict[str, Any] = {
        **JOB,
        "metadata": {"name": "train\x1b[2J", "namespace": "ml", "uid": "u-1"},
    }
    KopfEvents(post=posted.append).emit(hostile_job, "Warning", "GaveUp", EVIL)
    (ev,) = posted
    assert _raw(ev["message"]) == [] and len(ev["message"]) <= EVENT_LIMIT
    (line,) = [r.getMessage() for r in caplog.records if r.name.endswith("events")]
    assert _raw(line) == [] and "\\x1b]0;pwned\\x07" in line and len(line) < 2 * EVENT_LIMIT
    recorded = RecordedEvents()
    recorded.emit(hostile_job, "Warning", "GaveUp", EVIL)
    (rec,) = recorded.events
    assert _raw(rec.message) == [] and _raw(rec.obj) == [] and len(rec.message) <= EVENT_LIMIT
    assert rec.message == ev["message"]


def test_a_failed_post_logs_clean_text(caplog: pytest.LogCaptureFixture) -> None:
    def post(body: dict[str, Any]) -> None:
        raise RuntimeError(f"403 {EVIL}")

    KopfEvents(post=post).emit(JOB, "Warning", "X\u202e", "m")
    (line,) = [r.getMessage() for r in caplog.records if "could not post" in r.getMessage()]
    assert _raw(line) == [] and "X\\u202e" in line and len(line) < 1000
