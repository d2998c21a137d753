"""The operator's behaviour against a fake API server and a fake storage (no cluster)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ckpt_agent.records import CheckpointStatus
from ckpt_operator.adapters.kube import ApiError
from ckpt_operator.behaviours.admission import inject_pod, validate_policy
from ckpt_operator.behaviours.disruption import signal_node, signal_pod
from ckpt_operator.behaviours.policies import reconcile_policy
from ckpt_operator.behaviours.recovery import observe_job, recover_job
from ckpt_operator.behaviours.retention import reconcile_retention
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import format_time, job_facts, parse_time
from ckpt_operator.model.jsonpatch import apply_patch

FAILED_AT = parse_time("2024-05-02T11:02:17Z") or 0.0
RUN = "mnist-ddp-5f0c6a7e"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def checkpoints(world: Any, rec: Any) -> None:
    world.source.runs[RUN] = [
        rec("full", 1000, created_at=FAILED_AT - 900, manifest_hash="h1000"),
        rec("pulse", 1100, created_at=FAILED_AT - 600, manifest_hash="h1100", prev_hash="h1000"),
        rec("pulse", 1200, created_at=FAILED_AT - 300, manifest_hash="h1200", prev_hash="h1100"),
    ]


def annotations(world: Any, name: str) -> dict[str, str]:
    return dict(world.api.jobs[("ml-team", name)]["metadata"]["annotations"])


def status_of(world: Any, name: str) -> dict[str, str]:
    return json.loads(annotations(world, name)[c.ANN_STATUS])


# --------------------------------------------------------------------------- injection


def test_webhook_injects_an_opted_in_jobs_pod(world: Any, fixture: Any) -> None:
    world.api.add_job(fixture("pytorchjob_running.json"))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    out = run(inject_pod(world.deps, pod, "ml-team"))
    assert out.result == "injected" and out.warnings == []
    env = {
        e["name"]: e.get("value") for e in apply_patch(pod, out.ops)["spec"]["containers"][0]["env"]
    }
    assert env["CKPT_RUN_ID"] == RUN
    assert world.events.reasons() == ["Injected"]
    assert "mnist-ddp-worker-0" in world.events.events[0].message
    assert world.counter("ckpt_operator_injections_total", result="injected") == 1


def test_webhook_reports_a_missing_policy_and_changes_nothing(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    job["metadata"]["annotations"][c.ANN_POLICY] = "does-not-exist"
    world.api.add_job(job)
    pod = fixture("admission_review_pod.json")["request"]["object"]
    out = run(inject_pod(world.deps, pod, "ml-team"))
    assert out.ops == [] and out.result == "skipped"
    assert "'does-not-exist' not found" in out.warnings[0]
    assert world.events.reasons() == ["PolicyNotFound"]
    assert world.events.events[0].type == "Warning"
    # dry-run requests have no side effects
    world.events.events.clear()
    run(inject_pod(world.deps, pod, "ml-team", dryrun=True))
    assert world.events.events == []


def test_webhook_explains_a_pod_it_cannot_handle(world: Any, fixture: Any) -> None:
    world.api.add_job(fixture("pytorchjob_running.json"))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["spec"]["containers"][0]["name"] = "trainer"
    out = run(inject_pod(world.deps, pod, "ml-team"))
    assert out.ops == [] and out.result == "skipped"
    assert world.events.reasons() == ["InjectionSkipped"]
    assert "no container named 'pytorch'" in world.events.events[0].message


def test_webhook_ignores_other_pods(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    del job["metadata"]["annotations"][c.ANN_POLICY]
    world.api.add_job(job)
    pod = fixture("admission_review_pod.json")["request"]["object"]
    assert run(inject_pod(world.deps, pod, "ml-team")).result == "ignored"
    pod["metadata"]["ownerReferences"] = []
    pod["metadata"]["labels"] = {"app": "web"}
    assert run(inject_pod(world.deps, pod, "ml-team")).result == "ignored"
    assert world.events.events == []


def test_webhook_passes_the_resume_point_of_a_restart(world: Any, fixture: Any) -> None:
    world.api.add_job(fixture("pytorchjob_r1_failed.json"))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["metadata"]["ownerReferences"][0]["name"] = "mnist-ddp-r1"
    out = run(inject_pod(world.deps, pod, "ml-team"))
    env = {
        e["name"]: e.get("value") for e in apply_patch(pod, out.ops)["spec"]["containers"][0]["env"]
    }
    assert env["CKPT_RESUME_FROM"] == "pulse_step_000000001200"


def test_validation_messages(fixture: Any) -> None:
    assert validate_policy(fixture("checkpointpolicy.json")["spec"]) == []
    spec = fixture("admission_review_policy.json")["request"]["object"]["spec"]
    errors = validate_policy(spec)
    assert "spec.tiers: tiers.pulse.minInterval must be <= pulse.maxInterval" in errors
    assert any(e.startswith("spec.retention:") for e in errors)


# --------------------------------------------------------------------------- policies / jobs


def test_policy_reconcile_publishes_config_and_wakes_waiting_jobs(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    job["metadata"]["annotations"][c.ANN_STATUS] = json.dumps({"state": "PolicyMissing"})
    world.api.add_job(job)
    status = run(reconcile_policy(world.deps, fixture("checkpointpolicy.json")))
    assert status["observedGeneration"] == 1
    assert (
        status["conditions"][0]["type"] == "Ready" and status["conditions"][0]["status"] == "True"
    )
    cm = world.api.config_maps[("ml-team", "ckpt-llm-finetune")]
    assert json.loads(cm["data"]["config.json"])["storageUrl"] == "s3://ml-checkpoints/team-a"
    assert status_of(world, "mnist-ddp")["state"] == "Watching"
    assert world.events.reasons() == ["PolicyFound"]


def test_policy_ready_is_written_without_erasing_the_retention_condition(
    world: Any, fixture: Any
) -> None:
    stale = fixture("checkpointpolicy.json")  # the handler's body: no status yet
    stale.pop("status", None)
    stored = world.api.policies[("ml-team", "llm-finetune")]
    stored["status"] = {"conditions": [{"type": "Reconciled", "status": "True"}], "jobs": 2}
    run(reconcile_policy(world.deps, stale))
    conditions = {cond["type"]: cond["status"] for cond in stored["status"]["conditions"]}
    # StorageAccess: the recorded policy's MinIO endpoint is not in tenancy.allowedS3Endpoints
    assert conditions == {"Reconciled": "True", "Ready": "True", "StorageAccess": "False"}
    assert stored["status"]["jobs"] == 2 and stored["status"]["observedGeneration"] == 1


def test_invalid_policy_is_not_ready(world: Any, fixture: Any) -> None:
    policy = fixture("admission_review_policy.json")["request"]["object"]
    status = run(reconcile_policy(world.deps, policy))
    ready = status["conditions"][0]
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "spec.tiers" in ready["message"]
    assert world.api.config_maps == {}


def test_observe_records_run_id_and_watching(world: Any, fixture: Any) -> None:
    world.api.add_job(fixture("pytorchjob_running.json"))
    assert run(observe_job(world.deps, fixture("pytorchjob_running.json"))) is False
    ann = annotations(world, "mnist-ddp")
    assert ann[c.ANN_RUN_ID] == RUN
    assert json.loads(ann[c.ANN_STATUS])["state"] == "Watching"


def test_observe_reports_a_missing_policy_once(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    job["metadata"]["annotations"][c.ANN_POLICY] = "nope"
    world.api.add_job(job)
    run(observe_job(world.deps, job))
    assert world.events.reasons() == ["PolicyNotFound"]
    assert status_of(world, "mnist-ddp")["state"] == "PolicyMissing"
    updated = world.api.jobs[("ml-team", "mnist-ddp")]
    run(observe_job(world.deps, updated))  # the next watch event
    assert world.events.reasons() == ["PolicyNotFound"]


def test_observe_flags_failed_jobs_for_recovery(world: Any, fixture: Any) -> None:
    world.api.add_job(fixture("pytorchjob_failed.json"))
    assert run(observe_job(world.deps, fixture("pytorchjob_failed.json"))) is True
    assert run(observe_job(world.deps, fixture("pytorchjob_succeeded.json"))) is False


# --------------------------------------------------------------------------- recovery


def test_failed_job_is_restarted_from_its_newest_checkpoint(
    world: Any, fixture: Any, rec: Any
) -> None:
    checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    assert run(recover_job(world.deps, job)) is None
    assert world.api.called("create_job") == ["mnist-ddp-r1"]
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]
    assert child["metadata"]["annotations"][c.ANN_RESUME_FROM] == "pulse_step_000000001200"
    ann = annotations(world, "mnist-ddp")
    assert ann[c.ANN_RESTARTED_AS] == "mnist-ddp-r1"
    assert json.loads(ann[c.ANN_RESTART_DECISION])["resumeFrom"] == "pulse_step_000000001200"
    assert status_of(world, "mnist-ddp")["state"] == "Restarted"
    assert world.events.reasons() == ["JobFailed", "LadderStep", "Restarted"]
    assert "1 Worker replica(s) failed" in world.events.events[0].message
    assert "from step 1200" in world.events.events[-1].message
    assert (
        world.counter("ckpt_operator_recoveries_total", result="success", reason="Restarted") == 1
    )
    assert world.counter("ckpt_operator_restarts_total", action="resume") == 1
    assert world.counter("ckpt_operator_failure_to_restart_seconds_count") == 1
    assert world.counter("ckpt_operator_failure_to_restart_seconds_sum") == pytest.approx(3600)
    # intent was written before the create
    names = [n for n, _ in world.api.calls if n in ("patch_job_annotations", "create_job")]
    assert names == ["patch_job_annotations", "create_job", "patch_job_annotations"]
    # a second pass (next event, operator restart) does nothing
    assert run(recover_job(world.deps, world.api.jobs[("ml-team", "mnist-ddp")])) is None
    assert world.api.called("create_job") == ["mnist-ddp-r1"]


def test_backoff_is_reported_once_and_waited(world: Any, fixture: Any, rec: Any) -> None:
    checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.clock.now = FAILED_AT + 4
    assert run(recover_job(world.deps, job)) == pytest.approx(6.0)
    assert status_of(world, "mnist-ddp")["state"] == "BackingOff"
    job = world.api.jobs[("ml-team", "mnist-ddp")]
    world.clock.now = FAILED_AT + 5
    assert run(recover_job(world.deps, job)) == pytest.approx(5.0)
    assert world.events.reasons() == ["JobFailed", "BackingOff"]
    assert world.api.called("create_job") == []
    world.clock.now = FAILED_AT + 11
    assert run(recover_job(world.deps, job)) is None
    assert world.api.called("create_job") == ["mnist-ddp-r1"]


def _terminating_pod(fixture: Any, deletion_at: float) -> dict[str, Any]:
    pod: dict[str, Any] = fixture("pod_terminating.json")
    pod["metadata"]["deletionTimestamp"] = format_time(deletion_at)
    return pod


def test_restart_waits_for_pods_still_terminating(world: Any, fixture: Any, rec: Any) -> None:
    """Found on the real control plane (drain): the training-operator counts a pod being
    deleted as failed and marks the job Failed while the pod is still in its grace period,
    writing its SIGTERM checkpoint. The restart waits for that pod (bounded)."""
    checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.api.add_pod(_terminating_pod(fixture, world.clock.now + 20))
    assert run(recover_job(world.deps, job)) == pytest.approx(1.0)
    assert world.api.called("create_job") == []
    status = status_of(world, "mnist-ddp")
    assert (status["state"], status["reason"]) == ("BackingOff", "PodsTerminating")
    assert world.events.reasons() == ["JobFailed", "BackingOff"]
    assert "mnist-ddp-worker-0" in world.events.events[-1].message
    assert "emergency checkpoint" in world.events.events[-1].message
    # looking again while it still terminates: no new Event
    job = world.api.jobs[("ml-team", "mnist-ddp")]
    assert run(recover_job(world.deps, job)) == pytest.approx(1.0)
    assert world.events.reasons() == ["JobFailed", "BackingOff"]
    # its exit is reported: the restart goes ahead
    world.api.pods[("ml-team", "mnist-ddp-worker-0")]["status"]["phase"] = "Failed"
    assert run(recover_job(world.deps, job)) is None
    assert world.api.called("create_job") == ["mnist-ddp-r1"]


def test_a_pod_stuck_terminating_does_not_block_the_restart(
    world: Any, fixture: Any, rec: Any
) -> None:
    # e.g. on a node that is gone: past its deletionTimestamp + margin it no longer counts
    checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.api.add_pod(_terminating_pod(fixture, world.clock.now - 20))
    other = _terminating_pod(fixture, world.clock.now + 60)
    other["metadata"]["namespace"] = "someone-else"  # same job name, another namespace
    world.api.add_pod(other)
    assert run(recover_job(world.deps, job)) is None
    assert world.api.called("create_job") == ["mnist-ddp-r1"]


def test_corrupted_newest_checkpoint_is_reported_and_skipped(
    world: Any, fixture: Any, rec: Any
) -> None:
    checkpoints(world, rec)
    world.source.corrupt.add("pulse_step_000000001200")
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    run(recover_job(world.deps, job))
    assert world.events.reasons() == ["JobFailed", "CheckpointRejected", "LadderStep", "Restarted"]
    assert "SHA-256" in world.events.events[1].message
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]
    assert child["metadata"]["annotations"][c.ANN_RESUME_FROM] == "pulse_step_000000001100"


def test_crash_loop_poisons_and_goes_further_back(world: Any, fixture: Any, rec: Any) -> None:
    checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_r1_failed.json"))
    run(recover_job(world.deps, job))
    assert world.events.reasons()[:2] == ["JobFailed", "CrashLoop"]
    child = world.api.jobs[("ml-team", "mnist-ddp-r2")]["metadata"]["annotations"]
    assert child[c.ANN_POISONED] == "pulse_step_000000001200"
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001100"
    assert child[c.ANN_RESTART_COUNT] == "2"
    assert world.counter("ckpt_operator_poisoned_checkpoints_total") == 1
    assert (
        world.counter("ckpt_operator_recoveries_total", result="failure", reason="CrashLoop") == 1
    )


def test_exhausted_ladder_gives_up_with_a_clear_condition(
    world: Any, fixture: Any, rec: Any
) -> None:
    checkpoints(world, rec)
    world.source.corrupt.update(r.id for r in world.source.runs[RUN])
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    run(recover_job(world.deps, job))
    status = status_of(world, "mnist-ddp")
    assert status["state"] == "GaveUp" and status["reason"] == "LadderExhausted"
    assert world.events.reasons()[-1] == "GaveUp"
    assert world.api.called("create_job") == []
    assert (
        world.counter("ckpt_operator_recoveries_total", result="failure", reason="LadderExhausted")
        == 1
    )


def test_max_restarts_gives_up(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_r1_failed.json")
    job["metadata"]["annotations"][c.ANN_RESTART_COUNT] = "3"
    job = world.api.add_job(job)
    run(recover_job(world.deps, job))
    assert status_of(world, "mnist-ddp-r1")["reason"] == "MaxRestartsExceeded"
    assert world.source.listed == []  # decided without touching storage


def test_missing_policy_on_failure_waits_for_it(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_failed.json")
    job["metadata"]["annotations"][c.ANN_POLICY] = "gone"
    job = world.api.add_job(job)
    assert run(recover_job(world.deps, job)) == world.deps.config.recovery.policy_missing_retry_s
    assert status_of(world, "mnist-ddp")["state"] == "PolicyMissing"
    assert world.events.reasons() == ["PolicyNotFound"]


def test_operator_crash_between_intent_and_create_replays_once(
    world: Any, fixture: Any, rec: Any
) -> None:
    checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.api.fail_create = ApiError(0, "connection reset (operator killed)")
    with pytest.raises(ApiError):
        run(recover_job(world.deps, job))
    assert status_of(world, "mnist-ddp")["state"] == "Restarting"
    assert world.events.reasons()[-1] == "RestartFailed"
    # a restarted operator sees the intent and replays it, even though storage changed meanwhile
    world.api.fail_create = None
    world.source.runs[RUN].append(rec("pulse", 1300, created_at=FAILED_AT + 100))
    world.events.events.clear()
    run(recover_job(world.deps, world.api.jobs[("ml-team", "mnist-ddp")]))
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]["metadata"]["annotations"]
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001200"
    assert world.events.reasons() == ["Restarted"]
    assert status_of(world, "mnist-ddp")["state"] == "Restarted"


def test_operator_crash_after_create_is_a_409_and_no_second_job(
    world: Any, fixture: Any, rec: Any
) -> None:
    checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    run(recover_job(world.deps, job))
    # simulate the crash right after the create: the "Restarted" status never got written
    world.api.jobs[("ml-team", "mnist-ddp")]["metadata"]["annotations"][c.ANN_STATUS] = json.dumps(
        {"state": "Restarting"}
    )
    run(recover_job(world.deps, world.api.jobs[("ml-team", "mnist-ddp")]))
    assert world.api.called("create_job") == ["mnist-ddp-r1", "mnist-ddp-r1"]  # second one: 409
    assert sorted(n for _, n in world.api.jobs) == ["mnist-ddp", "mnist-ddp-r1"]
    assert status_of(world, "mnist-ddp")["state"] == "Restarted"


def test_name_taken_by_a_foreign_job_gives_up(world: Any, fixture: Any, rec: Any) -> None:
    checkpoints(world, rec)
    world.api.add_job(
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": "mnist-ddp-r1", "namespace": "ml-team", "annotations": {}},
            "spec": {},
        }
    )
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    run(recover_job(world.deps, job))
    assert status_of(world, "mnist-ddp")["reason"] == "NameTaken"


@pytest.mark.parametrize("name", ["pytorchjob_succeeded.json", "pytorchjob_running.json"])
def test_jobs_that_did_not_fail_are_left_alone(world: Any, fixture: Any, name: str) -> None:
    job = world.api.add_job(fixture(name))
    assert run(recover_job(world.deps, job)) is None
    assert world.api.called("create_job") == [] and world.events.events == []


# --------------------------------------------------------------------------- disruption


def test_pod_disruption_signals_the_agent_once(world: Any, fixture: Any) -> None:
    pod = fixture("pod_disruption_target.json")
    world.api.add_pod(pod)
    assert run(signal_pod(world.deps, pod)) is True
    patched = world.api.pods[("ml-team", "mnist-ddp-worker-0")]
    assert patched["metadata"]["annotations"][c.ANN_SAVE_NOW].startswith("EvictionByEvictionAPI-")
    assert run(signal_pod(world.deps, patched)) is False
    assert (
        world.counter("ckpt_operator_save_now_signals_total", reason="EvictionByEvictionAPI") == 1
    )
    assert run(signal_pod(world.deps, fixture("pod_running_injected.json"))) is False


def test_node_drain_signals_its_injected_pods(world: Any, fixture: Any) -> None:
    world.api.add_pod(fixture("pod_running_injected.json"))
    other = fixture("pod_running_injected.json")
    other["metadata"]["name"] = "elsewhere"
    other["spec"]["nodeName"] = "gpu-node-8"
    world.api.add_pod(other)
    node = fixture("node_cordoned.json")
    assert run(signal_node(world.deps, node)) == 1
    ann = world.api.pods[("ml-team", "mnist-ddp-worker-0")]["metadata"]["annotations"]
    assert ann[c.ANN_SAVE_NOW].startswith("NodeCordoned-")
    assert c.ANN_SAVE_NOW not in world.api.pods[("ml-team", "elsewhere")]["metadata"]["annotations"]
    # node status updates keep coming while it drains: no re-listing, no re-signal
    assert run(signal_node(world.deps, node)) == 0
    assert len(world.api.called("list_pods")) == 1
    assert run(signal_node(world.deps, fixture("node_ready.json"))) == 0


# --------------------------------------------------------------------------- retention


def test_retention_deletes_and_reports_in_the_policy_status(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.api.add_job(fixture("pytorchjob_failed.json"))
    world.api.add_job(fixture("pytorchjob_r1_failed.json"))  # same run: one run, two jobs
    world.source.runs[RUN] = [
        rec("pulse", s, created_at=FAILED_AT - 1000 + s, size=100, score=0.1)
        for s in (100, 200, 300)
    ] + [rec("pulse", 250, status=CheckpointStatus.CORRUPTED, size=50)]
    status = run(reconcile_retention(world.deps, fixture("checkpointpolicy.json")))
    assert sorted(cid for _, cid in world.source.deleted) == [
        "pulse_step_000000000100",
        "pulse_step_000000000200",
        "pulse_step_000000000250",
    ]
    assert world.source.gc_runs == [RUN]
    assert world.source.listed == [(RUN, False)]
    assert status["jobs"] == 2 and status["runs"] == 1
    assert status["checkpoints"] == 1 and status["deletedByRetention"] == 3
    assert status["bytesDeletedByRetention"] == 250
    assert status["lastValid"][RUN]["checkpointId"] == "pulse_step_000000000300"
    reconciled = status["conditions"][-1]
    assert reconciled["type"] == "Reconciled" and reconciled["status"] == "True"
    assert world.api.policies[("ml-team", "llm-finetune")]["status"]["deletedByRetention"] == 3
    assert world.events.reasons() == ["RetentionApplied"]
    assert world.counter("ckpt_operator_retention_deletions_total") == 3
    assert world.counter("ckpt_operator_retention_bytes_deleted_total") == 250 + 4096


def test_retention_storage_errors_are_reported(world: Any, fixture: Any, rec: Any) -> None:
    world.api.add_job(fixture("pytorchjob_failed.json"))
    world.source.runs[RUN] = [
        rec("pulse", s, created_at=FAILED_AT - 1000 + s, size=100) for s in (100, 200)
    ]
    world.source.fail_delete.add("pulse_step_000000000100")
    status = run(reconcile_retention(world.deps, fixture("checkpointpolicy.json")))
    reconciled = status["conditions"][-1]
    assert reconciled["status"] == "False" and "permission denied" in reconciled["message"]
    assert status["expiredCheckpoints"] == 1 and status["deletedByRetention"] == 0
    assert world.events.reasons() == ["RetentionErrors"]


def test_retention_keeps_conditions_written_after_its_body_was_read(
    world: Any, fixture: Any
) -> None:
    """Found on the real control plane: the retention loop's body predated the reconcile
    handler's Ready condition, and its merge patch replaced the conditions list."""
    stale = fixture("checkpointpolicy.json")
    stale.pop("status", None)
    stored = world.api.policies[("ml-team", "llm-finetune")]
    stored["status"] = {"conditions": [{"type": "Ready", "status": "True", "reason": "Validated"}]}
    stored["metadata"]["resourceVersion"] = "41"
    status = run(reconcile_retention(world.deps, stale))
    types = [cond["type"] for cond in status["conditions"]]
    assert types == ["Ready", "Reconciled"]
    assert [cond["type"] for cond in stored["status"]["conditions"]] == types


def test_retention_status_write_retries_on_a_conflict(world: Any, fixture: Any) -> None:
    stored = world.api.policies[("ml-team", "llm-finetune")]
    stored["metadata"]["resourceVersion"] = "7"
    original = world.api.patch_policy_status
    calls = {"n": 0}

    async def racing(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:  # someone else writes first
            stored["metadata"]["resourceVersion"] = "8"
        await original(*args, **kwargs)

    world.api.patch_policy_status = racing
    status = run(reconcile_retention(world.deps, fixture("checkpointpolicy.json")))
    assert calls["n"] == 2 and status["conditions"][-1]["type"] == "Reconciled"
    assert stored["metadata"]["resourceVersion"] == "9"


def test_retention_of_a_policy_without_jobs(world: Any, fixture: Any) -> None:
    status = run(reconcile_retention(world.deps, fixture("checkpointpolicy.json")))
    assert status["jobs"] == 0 and status["checkpoints"] == 0 and world.source.deleted == []


def test_facts_of_the_created_restart_resolve_the_same_run(
    world: Any, fixture: Any, rec: Any
) -> None:
    checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    run(recover_job(world.deps, job))
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]
    assert job_facts(child).run_id == RUN and job_facts(child).restart_count == 1
