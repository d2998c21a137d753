"""TrainJobs through the operator's behaviours and handlers (issue #15): injection and its
restart-attempt gate, the label-trainjob webhook, each JobSet restart attempt planned once
(crash loop, budget, GaveUp + suspend), JobSet giving up (a new TrainJob ``J-r1``), and the
PyTorchJob paths untouched beside them."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from typing import Any

import kopf
import pytest

from ckpt_agent.format.termination import CheckpointReport, encode_report
from ckpt_operator.adapters.kube import NotFoundError
from ckpt_operator.app.handlers import (
    MEMO_KEY,
    make_runtime,
    on_jobset_event,
    on_label_trainjob,
    on_mutate_pod,
    on_trainjob_event,
    on_trainjob_pod_event,
    on_validate_job,
)
from ckpt_operator.behaviours.admission import (
    inject_pod,
    report_unprotected,
    trainjob_label_targets,
)
from ckpt_operator.behaviours.agentcheck import check_agents
from ckpt_operator.behaviours.attempts import (
    PROBE_INTERVAL_S,
    RECHECK_S,
    attempt_due,
    observe_trainjob,
    recover_trainjob,
)
from ckpt_operator.behaviours.deps import list_all_jobs
from ckpt_operator.kinds.trainjob import TRAINJOB, has_inject_patch
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import format_time, parse_time
from tests.ckpt_operator.behaviours.test_writer_fenced import HOLDER
from tests.ckpt_operator.conftest import FAILED_AT

Fixture = Callable[[str], dict[str, Any]]
NS = "ml-team"
RUN = "llm-ft-9d8c7b6a"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def trainjob(world: Any) -> dict[str, Any]:
    return world.api.trainjobs[(NS, "llm-ft")]


def ann(world: Any, name: str = "llm-ft") -> dict[str, str]:
    return dict(world.api.trainjobs[(NS, name)]["metadata"]["annotations"])


def status(world: Any) -> dict[str, str]:
    return json.loads(ann(world)[c.ANN_STATUS])


def checkpoints(world: Any, rec: Any) -> None:
    now = world.clock.now
    world.source.runs[RUN] = [
        rec("full", 1000, created_at=now - 900, manifest_hash="h1000"),
        rec("pulse", 1100, created_at=now - 600, manifest_hash="h1100", prev_hash="h1000"),
        rec("pulse", 1200, created_at=now - 300, manifest_hash="h1200", prev_hash="h1100"),
    ]


def jobset(world: Any, fixture: Fixture, restarts: int) -> None:
    js = fixture("jobset_restarting.json")
    js["status"]["restarts"] = restarts
    world.deps.jobsets.upsert(js)


def attempt_pod(fixture: Fixture, attempt: int, name: str = "") -> dict[str, Any]:
    pod = fixture("trainjob_pod.json")
    pod["metadata"]["labels"][c.LABEL_JOBSET_RESTART_ATTEMPT] = str(attempt)
    if name:
        pod["metadata"]["name"] = name
        pod["metadata"]["uid"] = f"uid-{name}"
    return pod


def recording_memo(world: Any) -> tuple[kopf.Memo, list[tuple[str, str]]]:
    """The handlers' memo, its TrainJob recovery scheduler recording what it is asked to
    schedule instead of running it."""
    runtime = make_runtime(world.deps)
    scheduled: list[tuple[str, str]] = []
    runtime.trainjob_recovery.schedule = lambda ns, name: scheduled.append((ns, name)) or True  # type: ignore[method-assign]
    return kopf.Memo({MEMO_KEY: runtime}), scheduled


def env_of(ops: list[Any]) -> dict[str, str]:
    for op in ops:
        if op["path"].endswith("/env") or op["path"].endswith("/env/-"):
            values = op["value"] if isinstance(op["value"], list) else [op["value"]]
            return {e["name"]: e.get("value", "") for e in values}
    raise AssertionError(f"no env op in {ops}")


# --------------------------------------------------------------------------- injection


def test_a_trainjob_pod_gets_the_agent(world: Any, fixture: Fixture) -> None:
    world.api.add_job(fixture("trainjob_running.json"))
    out = run(inject_pod(world.deps, fixture("trainjob_pod.json"), NS))
    assert out.result == "injected"
    text = json.dumps(out.ops)
    assert "/spec/containers/0/" in text  # the "node" container (policy: "pytorch")
    env = {e["name"]: e.get("value") for op in out.ops for e in _envs(op)}
    assert env["CKPT_RUN_ID"] == RUN and env["CKPT_JOB_NAME"] == "llm-ft"
    assert env["CKPT_JOB_UID"] == "9d8c7b6a-1f2e-4d3c-8b7a-6f5e4d3c2b1a"
    assert "CKPT_RESUME_FROM" not in env
    (event,) = world.events.events
    assert event.reason == "Injected" and f"run {RUN}" in event.message
    assert event.obj == "TrainJob/ml-team/llm-ft"
    assert world.api.called("get_job") == ["llm-ft"]  # not cached: one read


def _envs(op: dict[str, Any]) -> list[dict[str, Any]]:
    value = op.get("value")
    if isinstance(value, dict) and "env" in value:
        return list(value["env"])
    if op["path"].endswith("/env") and isinstance(value, list):
        return list(value)
    if op["path"].endswith("/env/-") and isinstance(value, dict):
        return [value]
    return []


def test_a_pod_of_an_unplanned_restart_attempt_is_deferred(world: Any, fixture: Fixture) -> None:
    world.api.add_job(fixture("trainjob_running.json"))
    out = run(inject_pod(world.deps, attempt_pod(fixture, 1), NS))
    assert out.result == "deferred" and "restart attempt 1" in out.refusal
    assert out.ops == [] and world.events.events == []
    # planned: admitted, resuming where the operator decided
    world.api.trainjobs[(NS, "llm-ft")]["metadata"]["annotations"].update(
        {c.ANN_RESTART_ATTEMPT: "1", c.ANN_RESUME_FROM: "pulse_step_000000001200"}
    )
    out = run(inject_pod(world.deps, attempt_pod(fixture, 1), NS))
    assert out.result == "injected"
    env = {e["name"]: e.get("value") for op in out.ops for e in _envs(op)}
    assert env["CKPT_RESUME_FROM"] == "pulse_step_000000001200"


def test_the_pod_webhook_refuses_a_deferred_pod(world: Any, fixture: Fixture) -> None:
    world.api.add_job(fixture("trainjob_running.json"))
    memo = kopf.Memo({MEMO_KEY: make_runtime(world.deps)})
    patch, warnings = kopf.Patch(), []
    with pytest.raises(kopf.AdmissionError) as err:
        run(on_mutate_pod(body=attempt_pod(fixture, 2), patch=patch, memo=memo, warnings=warnings))
    assert err.value.code == 503 and "not planned yet" in str(err.value)
    assert world.counter("ckpt_operator_injections_total", result="deferred") == 1
    run(on_mutate_pod(body=attempt_pod(fixture, 0), patch=patch, memo=memo, warnings=warnings))
    assert patch.fns  # attempt 0 is injected


def test_an_unprotected_trainjob_pod_is_reported(world: Any, fixture: Fixture) -> None:
    world.deps.trainjobs.upsert(fixture("trainjob_running.json"))
    pod = fixture("trainjob_pod.json")
    pod["metadata"].update(name="llm-ft-node-0-0-x", uid="u1")
    assert run(report_unprotected(world.deps, pod)) is True
    pod_event, job_event = world.events.events
    assert "opted-in TrainJob" in pod_event.message and "Job controller" in pod_event.message
    assert job_event.obj == "TrainJob/ml-team/llm-ft"


# --------------------------------------------------------------------------- label-trainjob


def test_label_targets_come_from_the_runtime(world: Any, fixture: Fixture) -> None:
    world.api.add_custom(
        c.CLUSTER_TRAINING_RUNTIME_PLURAL, fixture("clustertrainingruntime_torch.json")
    )
    tj = fixture("trainjob_running.json")
    assert run(trainjob_label_targets(world.deps, tj)) == []  # labelled already
    del tj["spec"]["runtimePatches"]
    assert run(trainjob_label_targets(world.deps, tj)) == ["node"]
    tj["spec"]["runtimeRef"]["name"] = "missing"
    assert run(trainjob_label_targets(world.deps, tj)) == []
    tj["spec"]["runtimeRef"] = {"name": "ns-runtime", "kind": "TrainingRuntime"}
    ns_runtime = fixture("clustertrainingruntime_torch.json")
    ns_runtime["metadata"].update(name="ns-runtime", namespace=NS)
    world.api.add_custom(c.TRAINING_RUNTIME_PLURAL, ns_runtime)
    assert run(trainjob_label_targets(world.deps, tj)) == ["node"]
    tj["spec"]["runtimeRef"] = {}
    assert run(trainjob_label_targets(world.deps, tj)) == []
    del tj["metadata"]["annotations"][c.ANN_POLICY]
    assert run(trainjob_label_targets(world.deps, tj)) == []


def test_the_label_trainjob_handler_patches_the_body(world: Any, fixture: Fixture) -> None:
    world.api.add_custom(
        c.CLUSTER_TRAINING_RUNTIME_PLURAL, fixture("clustertrainingruntime_torch.json")
    )
    memo = kopf.Memo({MEMO_KEY: make_runtime(world.deps)})
    tj = fixture("trainjob_running.json")
    del tj["spec"]["runtimePatches"]
    patch = kopf.Patch()
    run(on_label_trainjob(body=tj, patch=patch, memo=memo))
    (fn,) = patch.fns
    body = copy.deepcopy(tj)
    fn(body)
    assert has_inject_patch(body)
    with pytest.raises(kopf.AdmissionError, match="invalid TrainJob"):
        bad = copy.deepcopy(tj)
        bad["metadata"]["annotations"][c.ANN_RESUME_STEP] = "-1"
        on_validate_job(body=bad)


# --------------------------------------------------------------------------- restart attempts


def test_a_jobset_restart_attempt_is_planned_once(world: Any, fixture: Fixture, rec: Any) -> None:
    checkpoints(world, rec)
    tj = world.api.add_job(fixture("trainjob_running.json"))
    world.deps.trainjobs.upsert(tj)
    assert attempt_due(world.deps, tj) is None  # no JobSet seen
    jobset(world, fixture, 1)
    assert attempt_due(world.deps, tj) == 1
    assert run(observe_trainjob(world.deps, tj)) is True
    tj = trainjob(world)
    assert run(recover_trainjob(world.deps, tj)) == RECHECK_S  # then one more look
    a = ann(world)
    assert a[c.ANN_RESTART_ATTEMPT] == "1" and a[c.ANN_RESTART_COUNT] == "1"
    assert a[c.ANN_RESUME_FROM] == "pulse_step_000000001200" and a[c.ANN_RESUME_STEP] == "1200"
    assert a[c.ANN_ATTEMPT_STARTED_AT] == format_time(world.clock.now, precise=True)
    assert status(world)["state"] == "Watching" and status(world)["reason"] == "RestartAttempt"
    assert world.events.reasons()[-2:] == ["LadderStep", "Restarted"]
    assert "JobSet restart attempt 1 resumes from step 1200" in world.events.events[-1].message
    assert world.counter("ckpt_operator_restarts_total", action="resume") == 1
    assert world.api.called("create_job") == []  # JobSet made the pods: no new job
    # exactly once: the cache holds the patched TrainJob, a second pass does nothing
    writes = len(world.api.called("patch_job_annotations"))
    assert attempt_due(world.deps, world.deps.trainjobs.get(NS, "llm-ft")) is None
    assert run(recover_trainjob(world.deps, trainjob(world))) is None
    assert len(world.api.called("patch_job_annotations")) == writes
    # ... and the webhook now admits the attempt's pods with the resume point
    out = run(inject_pod(world.deps, attempt_pod(fixture, 1), NS))
    assert out.result == "injected"


def test_a_crash_loop_across_attempts_poisons_and_the_budget_gives_up(
    world: Any, fixture: Fixture, rec: Any
) -> None:
    checkpoints(world, rec)
    tj = world.api.add_job(fixture("trainjob_running.json"))
    world.deps.trainjobs.upsert(tj)
    for attempt in (1, 2, 3):
        jobset(world, fixture, attempt)
        assert run(recover_trainjob(world.deps, trainjob(world))) == RECHECK_S
        world.clock.now += 60  # each attempt dies at once, writing nothing
    a = ann(world)
    assert a[c.ANN_POISONED] == "pulse_step_000000001200,pulse_step_000000001100"
    assert a[c.ANN_RESUME_FROM] == "full_step_000000001000" and a[c.ANN_RESTART_COUNT] == "3"
    assert world.events.reasons().count("CrashLoop") == 2
    assert world.counter("ckpt_operator_poisoned_checkpoints_total") == 2
    # attempt 4 is past recovery.maxRestarts (3): GaveUp, and the TrainJob is suspended
    jobset(world, fixture, 4)
    assert run(recover_trainjob(world.deps, trainjob(world))) == RECHECK_S
    assert status(world)["state"] == "GaveUp" and status(world)["reason"] == "MaxRestartsExceeded"
    assert world.events.reasons()[-1] == "GaveUp"
    assert trainjob(world)["spec"]["suspend"] is True
    # its pods stay refused, and nothing more is planned
    refused = run(inject_pod(world.deps, attempt_pod(fixture, 4), NS))
    assert refused.result == "deferred" and "gave up" in refused.refusal
    assert attempt_due(world.deps, trainjob(world)) == 4
    assert run(recover_trainjob(world.deps, trainjob(world))) is None
    assert world.events.reasons().count("GaveUp") == 1


def test_an_attempt_after_a_fenced_pod_gives_up_and_suspends(
    world: Any, fixture: Fixture, rec: Any
) -> None:
    """A pod of the last attempt stopped fenced (a newer writer holds the run): no resume
    point for the next attempt, whose new pods would claim the run back from that writer;
    WriterFenced on the pod and the TrainJob, GaveUp, the TrainJob suspended."""
    checkpoints(world, rec)
    tj = world.api.add_job(fixture("trainjob_running.json"))
    world.deps.trainjobs.upsert(tj)
    old = attempt_pod(fixture, 0, "llm-ft-node-0-0-a")
    report = encode_report(CheckpointReport("llm-ft-run", (), 1.0, HOLDER)).decode()
    old["status"] = {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "node", "state": {"terminated": {"exitCode": 1, "message": report}}}
        ],
    }
    world.api.add_pod(old)
    jobset(world, fixture, 1)
    assert run(recover_trainjob(world.deps, trainjob(world))) == RECHECK_S
    assert (status(world)["state"], status(world)["reason"]) == ("GaveUp", "WriterFenced")
    assert "mnist-ddp-r1-worker-0" in status(world)["message"]  # the holder's pod
    assert c.ANN_RESUME_FROM not in ann(world)
    assert trainjob(world)["spec"]["suspend"] is True
    fenced = [e for e in world.events.events if e.reason == "WriterFenced"]
    assert sorted(e.obj.split("/")[0] for e in fenced) == ["Pod", "TrainJob"]


def test_an_attempt_waits_for_the_previous_pods_to_finish_terminating(
    world: Any, fixture: Fixture, rec: Any
) -> None:
    checkpoints(world, rec)
    tj = world.api.add_job(fixture("trainjob_running.json"))
    world.deps.trainjobs.upsert(tj)
    old = attempt_pod(fixture, 0, "llm-ft-node-0-0-a")
    old["metadata"]["deletionTimestamp"] = format_time(world.clock.now + 20)
    old["status"] = {"phase": "Running"}
    world.api.add_pod(old)
    world.api.add_pod(attempt_pod(fixture, 1, "llm-ft-node-0-0-b"))  # the new one: ignored
    jobset(world, fixture, 1)
    assert run(recover_trainjob(world.deps, trainjob(world))) == pytest.approx(1.0)
    assert status(world)["reason"] == "PodsTerminating"
    assert c.ANN_RESTART_ATTEMPT not in ann(world)
    del world.api.pods[(NS, "llm-ft-node-0-0-a")]
    assert run(recover_trainjob(world.deps, trainjob(world))) == RECHECK_S
    assert ann(world)[c.ANN_RESTART_ATTEMPT] == "1"


def test_without_auto_resume_in_the_policy_the_attempt_just_passes(
    world: Any, fixture: Fixture
) -> None:
    policy = world.api.policies[(NS, "llm-finetune")]
    policy["spec"]["recovery"]["autoResume"] = False
    tj = world.api.add_job(fixture("trainjob_running.json"))
    world.deps.trainjobs.upsert(tj)
    jobset(world, fixture, 1)
    assert run(recover_trainjob(world.deps, trainjob(world))) == RECHECK_S
    assert ann(world)[c.ANN_RESTART_ATTEMPT] == "1"
    assert "suspend" not in trainjob(world)["spec"] or trainjob(world)["spec"]["suspend"] is False
    assert "GaveUp" not in world.events.reasons()


def test_jobset_giving_up_restarts_the_trainjob(world: Any, fixture: Fixture, rec: Any) -> None:
    world.clock.now = FAILED_AT + 3600
    checkpoints(world, rec)
    tj = fixture("trainjob_failed.json")
    # attempt 2 resumed from 1200 a minute ago, then JobSet gave up: a crash loop
    tj["metadata"]["annotations"].update(
        {
            c.ANN_RESTART_ATTEMPT: "2",
            c.ANN_ATTEMPT_STARTED_AT: format_time(FAILED_AT - 60, precise=True),
            c.ANN_RESTART_COUNT: "2",
            c.ANN_RESUME_FROM: "pulse_step_000000001200",
            c.ANN_RESUME_STEP: "1200",
        }
    )
    world.source.runs[RUN] = [
        rec("full", 1000, created_at=FAILED_AT - 900, manifest_hash="h1000"),
        rec("pulse", 1200, created_at=FAILED_AT - 300, manifest_hash="h1200", prev_hash="h1000"),
    ]
    world.api.add_job(tj)
    assert run(observe_trainjob(world.deps, tj)) is True
    assert run(recover_trainjob(world.deps, trainjob(world))) is None
    assert world.api.called("create_job") == ["llm-ft-r3"]
    child = world.api.trainjobs[(NS, "llm-ft-r3")]
    assert child["kind"] == "TrainJob" and has_inject_patch(child)
    cann = child["metadata"]["annotations"]
    assert cann[c.ANN_RESUME_FROM] == "full_step_000000001000"
    assert cann[c.ANN_POISONED] == "pulse_step_000000001200"
    assert cann[c.ANN_RESTART_COUNT] == "3" and cann[c.ANN_RUN_ID] == RUN
    assert c.ANN_RESTART_ATTEMPT not in cann and c.ANN_ATTEMPT_STARTED_AT not in cann
    assert "status" not in child
    assert status(world)["state"] == "Restarted"
    assert "CrashLoop" in world.events.reasons()


def test_handlers_route_trainjobs_and_jobsets(world: Any, fixture: Fixture, rec: Any) -> None:
    checkpoints(world, rec)
    memo, scheduled = recording_memo(world)
    tj = world.api.add_job(fixture("trainjob_running.json"))
    run(on_trainjob_event(type="ADDED", body=tj, memo=memo))
    assert world.deps.trainjobs.get(NS, "llm-ft") is not None and scheduled == []
    js = fixture("jobset_restarting.json")
    run(on_jobset_event(type="MODIFIED", body=js, memo=memo))
    assert scheduled == [(NS, "llm-ft")]
    other = fixture("jobset_restarting.json")
    other["metadata"]["ownerReferences"] = []
    other["metadata"]["name"] = "plain-jobset"
    run(on_jobset_event(type="ADDED", body=other, memo=memo))
    assert world.deps.jobsets.get(NS, "plain-jobset") is None and len(scheduled) == 1
    run(on_jobset_event(type="DELETED", body=js, memo=memo))
    assert world.deps.jobsets.get(NS, "llm-ft") is None
    pod = attempt_pod(fixture, 0, "llm-ft-node-0-0-a")
    run(on_trainjob_pod_event(type="ADDED", body=pod, memo=memo))
    assert len(world.deps.trainjob_pods.of_job(NS, "llm-ft")) == 1
    run(on_trainjob_pod_event(type="DELETED", body=pod, memo=memo))
    assert world.deps.trainjob_pods.of_job(NS, "llm-ft") == []
    run(on_trainjob_event(type="DELETED", body=tj, memo=memo))
    assert world.deps.trainjobs.get(NS, "llm-ft") is None


def test_jobs_of_every_kind_are_listed(world: Any, fixture: Fixture) -> None:
    world.api.add_job(fixture("pytorchjob_running.json"))
    world.api.add_job(fixture("trainjob_running.json"))
    names = [j["metadata"]["name"] for j in run(list_all_jobs(world.deps, NS))]
    assert names == ["mnist-ddp", "llm-ft"]

    async def no_crd(namespace: str, **kw: Any) -> list[Any]:
        if kw.get("kind") is TRAINJOB:
            raise NotFoundError(404, "the server could not find the requested resource")
        return [fixture("pytorchjob_running.json")]

    world.api.list_jobs = no_crd
    names = [j["metadata"]["name"] for j in run(list_all_jobs(world.deps, NS))]
    assert names == ["mnist-ddp"]  # no Trainer installed: PyTorchJobs only


def test_a_silent_trainjob_pod_is_flagged_on_its_trainjob(world: Any, fixture: Fixture) -> None:
    world.api.add_job(fixture("trainjob_running.json"))
    pod = attempt_pod(fixture, 0, "llm-ft-node-0-0-a")
    pod["metadata"]["annotations"].update({c.ANN_POLICY: "llm-finetune", c.ANN_RUN_ID: RUN})
    pod["metadata"]["labels"][c.LABEL_INJECTED] = "true"
    pod["status"] = {"phase": "Running", "startTime": "2024-05-02T10:00:00Z"}
    world.api.add_pod(pod)
    world.clock.now = (parse_time("2024-05-02T10:00:00Z") or 0.0) + 600
    assert run(check_agents(world.deps, fixture("checkpointpolicy.json"))) == ["llm-ft-node-0-0-a"]
    (event,) = [e for e in world.events.events if e.reason == "AgentMissing"]
    assert event.obj == "TrainJob/ml-team/llm-ft"
    assert ann(world)[c.ANN_AGENT_MISSING] == "llm-ft-node-0-0-a"


def test_a_trainjob_admitted_without_the_runtime_patch_is_reported_once(
    world: Any, fixture: Fixture
) -> None:
    tj = fixture("trainjob_running.json")
    del tj["spec"]["runtimePatches"]
    world.api.add_job(tj)
    assert run(observe_trainjob(world.deps, tj)) is False
    (event,) = world.events.events
    assert event.reason == "NotInjected" and "WITHOUT the checkpoint agent" in event.message
    assert status(world)["state"] == "Watching"
    assert run(observe_trainjob(world.deps, trainjob(world))) is False  # next event: quiet
    assert world.events.reasons() == ["NotInjected"]
    # a labelled one is never reported
    world.api.add_job(fixture("trainjob_running.json"))
    world.events.events.clear()
    run(observe_trainjob(world.deps, fixture("trainjob_running.json")))
    assert world.events.events == []


def test_a_failed_pod_makes_the_operator_read_the_jobset(
    world: Any, fixture: Fixture, rec: Any
) -> None:
    """The JobSet watch may be silent (kopf serves a resource only once it discovered its
    CRD): a failed pod of the planned attempt makes the TrainJob's task read the JobSet."""
    checkpoints(world, rec)
    memo, scheduled = recording_memo(world)
    tj = world.api.add_job(fixture("trainjob_running.json"))
    world.deps.trainjobs.upsert(tj)
    js = fixture("jobset_restarting.json")
    js["status"]["restarts"] = 0
    world.api.add_custom(c.JOBSET_PLURAL, js)
    pod = attempt_pod(fixture, 0, "llm-ft-node-0-0-a")
    pod["status"] = {"phase": "Running"}
    run(on_trainjob_pod_event(type="MODIFIED", body=pod, memo=memo))
    assert scheduled == []  # running: nothing expected
    assert run(recover_trainjob(world.deps, trainjob(world))) is None
    killed = format_time(world.clock.now - 2)
    pod["status"] = {
        "phase": "Failed",
        "containerStatuses": [{"name": "node", "state": {"terminated": {"finishedAt": killed}}}],
    }
    run(on_trainjob_pod_event(type="MODIFIED", body=pod, memo=memo))
    assert scheduled == [(NS, "llm-ft")]
    # JobSet has not restarted yet: look again shortly
    assert run(recover_trainjob(world.deps, trainjob(world))) == PROBE_INTERVAL_S
    assert world.api.called("get_custom") == [(c.JOBSET_PLURAL, "llm-ft")]
    js["status"]["restarts"] = 1
    world.api.add_custom(c.JOBSET_PLURAL, js)
    js_newer = world.api.custom[(c.JOBSET_PLURAL, NS, "llm-ft")]
    js_newer["metadata"]["resourceVersion"] = "184301"
    assert run(recover_trainjob(world.deps, trainjob(world))) == RECHECK_S
    assert ann(world)[c.ANN_RESTART_ATTEMPT] == "1"
    assert ann(world)[c.ANN_RESUME_FROM] == "pulse_step_000000001200"
    # the failed pod is of attempt 0 now: nothing more expected
    assert run(recover_trainjob(world.deps, trainjob(world))) is None
    # a restart that never comes: the probing ends RESTART_PROBE_S after the failure
    world.deps.jobsets.remove(NS, "llm-ft")
    tj2 = trainjob(world)
    pod1 = attempt_pod(fixture, 1, "llm-ft-node-0-0-b")
    pod1["status"] = pod["status"]
    world.deps.trainjob_pods.upsert(pod1)
    assert run(recover_trainjob(world.deps, tj2)) == PROBE_INTERVAL_S
    world.clock.now += 200
    assert run(recover_trainjob(world.deps, tj2)) is None


def test_a_refused_pod_makes_its_attempt_due_without_the_jobset_watch(
    world: Any, fixture: Fixture, rec: Any
) -> None:
    """The JobSet watch silent and no failed pod seen (the restart came from a deletion, or
    the pod events were missed): the first pod of the attempt the webhook refuses carries
    the attempt JobSet is at, so the TrainJob's task plans it at once and the Job
    controller's retry of the pod is admitted."""
    checkpoints(world, rec)
    memo, scheduled = recording_memo(world)
    tj = world.api.add_job(fixture("trainjob_running.json"))
    world.deps.trainjobs.upsert(tj)
    assert attempt_due(world.deps, tj) is None  # no JobSet seen, no pod refused
    patch: kopf.Patch = kopf.Patch()
    with pytest.raises(kopf.AdmissionError):
        run(on_mutate_pod(body=attempt_pod(fixture, 1), patch=patch, memo=memo, warnings=[]))
    assert scheduled == [(NS, "llm-ft")]
    assert attempt_due(world.deps, trainjob(world)) == 1
    assert run(recover_trainjob(world.deps, trainjob(world))) == RECHECK_S
    assert ann(world)[c.ANN_RESTART_ATTEMPT] == "1"
    assert world.api.called("get_custom") == []  # planned from the pod's label alone
    out = run(inject_pod(world.deps, attempt_pod(fixture, 1), NS))
    assert out.result == "injected"
    assert attempt_due(world.deps, trainjob(world)) is None
    # the TrainJob deleted: what its pods said goes with it
    run(on_trainjob_event(type="DELETED", body=trainjob(world), memo=memo))
    assert len(world.deps.attempts_seen) == 0
