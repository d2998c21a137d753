"""A training pod that stopped because a newer writer holds its run (#28): a
``WriterFenced`` Event names the holder, and the job is not restarted from it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ckpt_agent.format.termination import (
    CheckpointReport,
    FencedReport,
    encode_report,
)
from ckpt_operator.behaviours.recovery import recover_job, report_fenced_pod
from ckpt_operator.model import constants as c

RUN = "mnist-ddp-5f0c6a7e"
HOLDER = FencedReport(3, 4, "mnist-ddp-r1-worker-0", "gpu-9", 1_714_647_737.0)


def fenced_pod(fixture: Any, fenced: FencedReport | None, state: str = "state") -> dict[str, Any]:
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["metadata"].setdefault("labels", {}).update(
        {c.LABEL_INJECTED: "true", c.LABEL_TO_JOB_NAME: "mnist-ddp"}
    )
    pod["metadata"].update(namespace="ml-team", name="mnist-ddp-worker-0", uid="pod-uid-1")
    message = encode_report(CheckpointReport(RUN, (), 1.0, fenced)).decode()
    pod["status"] = {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "pytorch", state: {"terminated": {"exitCode": 1, "message": message}}}
        ],
    }
    return dict(pod)


def test_a_failed_job_whose_writer_was_fenced_is_not_restarted(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.runs[RUN] = [rec("full", 1000, manifest_hash="h1000")]
    pod = fenced_pod(fixture, HOLDER)
    world.api.add_pod(pod)
    world.deps.pods.upsert(pod)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    assert asyncio.run(recover_job(world.deps, job)) is None
    assert world.api.called("create_job") == []
    assert world.events.reasons() == ["WriterFenced", "WriterFenced"]  # the pod and the job
    assert "gpu-9" in world.events.events[-1].message
    ann = world.api.jobs[("ml-team", "mnist-ddp")]["metadata"]["annotations"]
    status = json.loads(ann[c.ANN_STATUS])
    assert (status["state"], status["reason"]) == ("GaveUp", "WriterFenced")
    assert "mnist-ddp-r1-worker-0" in status["message"]
    # handled: the next event does nothing, and the pod watch does not post it again
    assert asyncio.run(recover_job(world.deps, world.api.jobs[("ml-team", "mnist-ddp")])) is None
    assert not asyncio.run(report_fenced_pod(world.deps, pod))
    assert world.events.reasons() == ["WriterFenced", "WriterFenced"]
    assert world.api.called("create_job") == []


def test_a_crashed_job_is_still_restarted(world: Any, fixture: Any, rec: Any) -> None:
    world.source.runs[RUN] = [rec("full", 1000, manifest_hash="h1000")]
    pod = fenced_pod(fixture, None)
    world.api.add_pod(pod)
    world.deps.pods.upsert(pod)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    asyncio.run(recover_job(world.deps, job))
    assert world.api.called("create_job") == ["mnist-ddp-r1"]
    assert "WriterFenced" not in world.events.reasons()


def test_a_zombie_of_a_restarted_job_is_reported_once_on_it_and_its_job(
    world: Any, fixture: Any
) -> None:
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.deps.jobs.upsert(job)
    pod = fenced_pod(fixture, HOLDER)
    assert asyncio.run(report_fenced_pod(world.deps, pod))
    assert not asyncio.run(report_fenced_pod(world.deps, pod))  # once per pod
    assert world.events.reasons() == ["WriterFenced", "WriterFenced"]
    assert sorted(e.obj.split("/")[0] for e in world.events.events) == ["Pod", "PyTorchJob"]
    assert not asyncio.run(report_fenced_pod(world.deps, fenced_pod(fixture, None)))
