"""API requests per restart (issue #19: at most 8, Events included), counted on the fake API
through the watch handlers, as the operator runs them."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf

from ckpt_operator.app.handlers import (
    MEMO_KEY,
    Runtime,
    make_runtime,
    on_job_event,
    on_policy_event,
)
from ckpt_operator.behaviours.deps import patch_job_annotations
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import JobStatusAnnotation
from tests.ckpt_operator.planners.test_reports import message, reported
from tests.ckpt_operator.planners.test_reports import pod as report_pod

#: The requests one restart may cost (the issue's budget).
BUDGET = 8


async def _settle(runtime: Runtime) -> None:
    """Until the recovery scheduler has nothing left to do."""
    for _ in range(500):
        await asyncio.sleep(0.01)  # storage calls run on executor threads
        if not runtime.recovery.active:
            return
    raise AssertionError(f"recoveries still running: {sorted(runtime.recovery.active)}")


def _failed_job_with_reports(world: Any, fixture: Any, rec: Any) -> dict[str, Any]:
    world.source.runs["mnist-ddp-5f0c6a7e"] = [rec("pulse", 1200, created_at=1.0)]
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    job["metadata"]["resourceVersion"] = "100"
    world.api.jobs[("ml-team", "mnist-ddp")]["metadata"]["resourceVersion"] = "100"
    pod = report_pod(fixture, "mnist-ddp-worker-0", "mnist-ddp", message(reported(rec)))
    world.deps.pods.upsert({**pod, "status": {**pod["status"], "phase": "Failed"}})
    return copy.deepcopy(job)


async def _fail_through_the_watch(world: Any, job: dict[str, Any]) -> tuple[Runtime, kopf.Memo]:
    """The policy's and the failed job's watch events, as kopf delivers them; settled."""
    runtime = make_runtime(world.deps)
    memo = kopf.Memo({MEMO_KEY: runtime})
    policy = world.api.policies[("ml-team", "llm-finetune")]
    await on_policy_event(type=None, body=kopf.Body(policy), memo=memo)
    await on_job_event(type="MODIFIED", body=kopf.Body(job), memo=memo)
    await _settle(runtime)
    return runtime, memo


def test_a_restart_costs_three_job_requests_and_no_read(world: Any, fixture: Any, rec: Any) -> None:
    """The failure's watch event carries the job: no GET; the pods come from the index;
    intent PATCH (with the reports), create, outcome PATCH; three Events (failed, the
    accepted rung, restarted)."""
    job = _failed_job_with_reports(world, fixture, rec)

    async def main() -> None:
        runtime, _ = await _fail_through_the_watch(world, job)
        await runtime.recovery.stop()

    asyncio.run(main())
    assert [name for name, _ in world.api.calls] == [
        "patch_job_annotations",
        "create_job",
        "patch_job_annotations",
    ]
    assert world.events.reasons() == ["JobFailed", "LadderStep", "Restarted"]
    # + the Injected Event of the restart's pod, at admission
    assert len(world.api.calls) + len(world.events.events) + 1 <= BUDGET


def test_late_watch_events_of_a_finished_restart_cost_no_request(
    world: Any, fixture: Any, rec: Any
) -> None:
    """The watch delivers the intent write's version (Restarting, not yet handled) after the
    restart is done: the job cache holds the operator's own newer write, so nothing is read,
    written or posted again."""
    job = _failed_job_with_reports(world, fixture, rec)

    async def main() -> None:
        runtime, memo = await _fail_through_the_watch(world, job)
        intent = copy.deepcopy(job)
        intent["metadata"]["resourceVersion"] = "101"
        intent["metadata"]["annotations"].update(
            {
                c.ANN_STATUS: JobStatusAnnotation(
                    "Restarting",
                    "RestartPlanned",
                    "restarting as mnist-ddp-r1",
                    "2024-05-02T11:02:30Z",
                ).to_json(),
                c.ANN_RESTARTED_AS: "mnist-ddp-r1",
            }
        )
        before = (len(world.api.calls), len(world.events.events))
        await on_job_event(type="MODIFIED", body=kopf.Body(intent), memo=memo)
        await _settle(runtime)
        assert (len(world.api.calls), len(world.events.events)) == before
        await runtime.recovery.stop()

    asyncio.run(main())
    assert world.api.called("create_job") == ["mnist-ddp-r1"]


def test_a_job_missing_from_the_cache_is_read_once(world: Any, fixture: Any) -> None:
    """The scheduler's read falls back to one GET when the watch has not delivered the job."""
    world.api.add_job(fixture("pytorchjob_running.json"))

    async def main() -> None:
        runtime = make_runtime(world.deps)
        runtime.recovery.schedule("ml-team", "mnist-ddp")
        await _settle(runtime)
        await runtime.recovery.stop()

    asyncio.run(main())
    assert world.api.called("get_job") == ["mnist-ddp"]


def test_a_patch_answer_updates_only_jobs_the_cache_holds(world: Any, fixture: Any) -> None:
    """The operator's own write refreshes a cached job; a job the watch already reported
    deleted (or never delivered) is not put back (memory follows the live jobs)."""
    job = world.api.add_job(fixture("pytorchjob_running.json"))
    asyncio.run(patch_job_annotations(world.deps, "ml-team", "mnist-ddp", {"a": "1"}))
    assert len(world.deps.jobs) == 0
    world.deps.jobs.upsert(job)
    asyncio.run(patch_job_annotations(world.deps, "ml-team", "mnist-ddp", {"a": "2"}))
    cached = world.deps.jobs.get("ml-team", "mnist-ddp")
    assert cached is not None and cached["metadata"]["annotations"]["a"] == "2"
