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

from ckpt_operator.adapters.events import KopfEvents, build_event

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
