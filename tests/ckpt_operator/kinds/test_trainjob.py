"""TrainJob (Kubeflow Trainer v2 on JobSet): the kind adapter, the registry and the pure
planning of JobSet restart attempts (issue #15).

Fixtures are shaped as Trainer v2.3 / JobSet v0.12 make them: the JobSet named after the
TrainJob with a controller owner reference to it, pods labelled by JobSet
(``jobset-name``, ``restart-attempt``), the torch ``ClusterTrainingRuntime`` of Trainer's
manifests.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from ckpt_agent.policy import RecoverySpec
from ckpt_agent.records import CheckpointRecord
from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.kinds.registry import KINDS, kind_of, owner_of
from ckpt_operator.kinds.trainjob import (
    RESTART_PROBE_S,
    TRAINJOB,
    add_inject_patch,
    has_inject_patch,
    jobset_restarts,
    jobset_trainjob,
    planned_attempt,
    pod_attempt,
    pod_ended_at,
    restart_expected_until,
    runtime_ref,
    trainer_replicated_jobs,
)
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import format_time, job_facts, parse_time
from ckpt_operator.planners.attempt_plan import (
    AttemptPlan,
    attempt_annotations,
    attempt_refusal,
    attempt_view,
    plan_attempt,
    planning_view,
    precheck_attempt,
)
from ckpt_operator.planners.restart import GiveUp, PlanRequest, RestartDecision, Skip
from tests.ckpt_operator.conftest import load

Fixture = Callable[[str], dict[str, Any]]
RUN = "llm-ft-9d8c7b6a"
CREATED = parse_time("2024-05-02T08:14:03Z") or 0.0
NOW = CREATED + 7200


def with_annotations(obj: dict[str, Any], **ann: str) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"].setdefault("annotations", {}).update(
        {f"{c.PREFIX}/{k.replace('_', '-')}": v for k, v in ann.items()}
    )
    return out


def pod_of_attempt(attempt: object, *, label: bool = True) -> dict[str, Any]:
    pod = load("trainjob_pod.json")
    meta = pod["metadata"]
    if label:
        meta["labels"][c.LABEL_JOBSET_RESTART_ATTEMPT] = str(attempt)
    else:
        del meta["labels"][c.LABEL_JOBSET_RESTART_ATTEMPT]
    meta["annotations"][c.LABEL_JOBSET_RESTART_ATTEMPT] = str(attempt)
    return pod


def never(_: str) -> bool:
    raise AssertionError("verify must not be called")


# --------------------------------------------------------------------------- kind registry


def test_kind_of_tells_the_kinds_apart(fixture: Fixture) -> None:
    assert kind_of(fixture("pytorchjob_running.json")) is PYTORCHJOB
    assert kind_of(fixture("trainjob_running.json")) is TRAINJOB
    assert kind_of({}) is PYTORCHJOB  # a body without kind: the historical default
    other = {"apiVersion": "example.com/v1", "kind": "TrainJob"}  # same kind, other group
    assert kind_of(other) is PYTORCHJOB
    assert {k.plural for k in KINDS} == {"pytorchjobs", "trainjobs"}
    assert TRAINJOB.api_version == "trainer.kubeflow.org/v1alpha1"
    assert PYTORCHJOB.api_version == "kubeflow.org/v1"


def test_owner_of_a_pod(fixture: Fixture) -> None:
    pytorch_pod = fixture("admission_review_pod.json")["request"]["object"]
    assert owner_of(pytorch_pod) == (PYTORCHJOB, "mnist-ddp")
    assert owner_of(fixture("trainjob_pod.json")) == (TRAINJOB, "llm-ft")
    assert owner_of({"metadata": {"labels": {"app": "web"}}}) is None
    assert owner_of({}) is None
    assert TRAINJOB.job_name_of_pod({"metadata": {"labels": {c.LABEL_JOBSET_NAME: ""}}}) is None


def test_trainjob_templates_are_labelled_through_the_runtime_patch(fixture: Fixture) -> None:
    tj = fixture("trainjob_running.json")
    assert TRAINJOB.unlabelled(tj) == []
    del tj["spec"]["runtimePatches"]
    assert TRAINJOB.unlabelled(tj) == ["spec.runtimePatches"]
    # nothing a watcher can patch (the runtime's Job names are needed), nothing to copy
    assert TRAINJOB.label_patch(tj) is None
    assert TRAINJOB.label_in_place(tj) is False
    assert TRAINJOB.default_container == "node" and PYTORCHJOB.default_container is None


def test_a_trainjob_that_completed_has_succeeded(fixture: Fixture) -> None:
    tj = fixture("trainjob_running.json")
    tj["status"]["conditions"] = [
        {"type": "Complete", "status": "True", "lastTransitionTime": "2024-05-02T12:00:00Z"}
    ]
    facts = job_facts(tj)
    assert facts.succeeded and not facts.failed and not facts.needs_recovery
    failed = job_facts(fixture("trainjob_failed.json"))
    assert failed.failed and failed.needs_recovery and failed.run_id == RUN
    assert failed.failed_at == parse_time("2024-05-02T11:02:17Z")


# --------------------------------------------------------------------------- runtimes


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ({"name": "torch-distributed"}, ("ClusterTrainingRuntime", "torch-distributed")),
        (
            {"name": "mine", "kind": "TrainingRuntime", "apiGroup": "trainer.kubeflow.org"},
            ("TrainingRuntime", "mine"),
        ),
        ({"name": "x", "apiGroup": "example.com"}, None),
        ({"name": "x", "kind": "Other"}, None),
        ({"name": ""}, None),
        ({}, None),
        ("torch", None),
    ],
)
def test_runtime_ref(ref: Any, expected: tuple[str, str] | None) -> None:
    assert runtime_ref({"spec": {"runtimeRef": ref}}) == expected


def _rjob(name: str, ancestor: str | None, containers: list[str]) -> dict[str, Any]:
    meta = {"labels": {c.LABEL_TRAINER_ANCESTOR: ancestor}} if ancestor else {}
    pod = {"spec": {"containers": [{"name": n} for n in containers]}}
    return {"name": name, "template": {"metadata": meta, "spec": {"template": pod}}}


def _runtime(*rjobs: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"template": {"spec": {"replicatedJobs": list(rjobs)}}}}


def test_trainer_replicated_jobs(fixture: Fixture) -> None:
    assert trainer_replicated_jobs(fixture("clustertrainingruntime_torch.json")) == ["node"]
    with_initializers = _runtime(
        _rjob("dataset-initializer", "dataset-initializer", ["dataset-initializer"]),
        _rjob("model-initializer", "model-initializer", ["model-initializer"]),
        _rjob("node", "trainer", ["node"]),
    )
    assert trainer_replicated_jobs(with_initializers) == ["node"]
    # an unlabelled runtime: the Jobs with a node container, else every Job
    assert trainer_replicated_jobs(
        _runtime(_rjob("a", None, ["x"]), _rjob("b", None, ["node"]))
    ) == ["b"]
    assert trainer_replicated_jobs(_runtime(_rjob("a", None, ["x"]), _rjob("b", None, []))) == [
        "a",
        "b",
    ]
    # labelled, but no trainer step: never the initializers
    assert trainer_replicated_jobs(_runtime(_rjob("init", "model-initializer", ["node"]))) == []
    assert trainer_replicated_jobs({}) == []
    assert trainer_replicated_jobs(_runtime({"template": {}})) == []  # nameless: skipped


def test_inject_patch_is_added_once_beside_the_users(fixture: Fixture) -> None:
    tj = fixture("trainjob_running.json")
    assert has_inject_patch(tj)
    assert add_inject_patch(tj, ["node"]) is False
    user = {"manager": "kueue.x-k8s.io/manager", "trainingRuntimeSpec": {}}
    tj["spec"]["runtimePatches"] = [user]
    assert not has_inject_patch(tj)
    assert add_inject_patch(tj, []) is False  # nothing to label
    assert add_inject_patch(tj, ["node", "launcher"]) is True
    first, ours = tj["spec"]["runtimePatches"]
    assert first == user and ours["manager"] == c.RUNTIME_PATCH_MANAGER
    rjobs = ours["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert [r["name"] for r in rjobs] == ["node", "launcher"]
    labels = rjobs[0]["template"]["spec"]["template"]["metadata"]["labels"]
    assert labels == {c.LABEL_INJECT: "true"}
    assert add_inject_patch(tj, ["node"]) is False
    bare: dict[str, Any] = {}
    assert add_inject_patch(bare, ["node"]) and has_inject_patch(bare)
    assert not has_inject_patch({"spec": {"runtimePatches": "garbage"}})


# --------------------------------------------------------------------------- attempts: reading


@pytest.mark.parametrize(
    ("value", "label", "expected"),
    [("0", True, 0), ("3", True, 3), ("4", False, 4), ("x", True, 0), ("-2", True, 0)],
)
def test_pod_attempt(value: str, label: bool, expected: int) -> None:
    assert pod_attempt(pod_of_attempt(value, label=label)) == expected
    assert pod_attempt({}) == 0


def test_planned_attempt_and_jobset_restarts(fixture: Fixture) -> None:
    assert planned_attempt({}) == 0
    assert planned_attempt({c.ANN_RESTART_ATTEMPT: "2"}) == 2
    assert planned_attempt({c.ANN_RESTART_ATTEMPT: "bad"}) == 0
    jobset = fixture("jobset_restarting.json")
    assert jobset_restarts(jobset) == 1
    assert jobset_restarts({}) == 0
    assert jobset_trainjob(jobset) == "llm-ft"
    ref = jobset["metadata"]["ownerReferences"][0]
    ref["controller"] = False
    assert jobset_trainjob(jobset) is None  # only the controlling owner
    ref.update(controller=True, kind="PyTorchJob")
    assert jobset_trainjob(jobset) is None
    assert jobset_trainjob({"metadata": {}}) is None


# --------------------------------------------------------------------------- attempts: the gate


def test_attempt_gate(fixture: Fixture) -> None:
    tj = fixture("trainjob_running.json")
    facts = job_facts(tj)
    assert attempt_refusal(facts, pod_of_attempt(0)) is None
    refusal = attempt_refusal(facts, pod_of_attempt(1))
    assert refusal is not None and "restart attempt 1" in refusal and "not planned" in refusal
    planned = job_facts(with_annotations(tj, restart_attempt="1"))
    assert attempt_refusal(planned, pod_of_attempt(1)) is None
    assert attempt_refusal(planned, pod_of_attempt(2)) is not None
    manual = copy.deepcopy(tj)
    del manual["metadata"]["annotations"][c.ANN_AUTO_RESUME]
    assert attempt_refusal(job_facts(manual), pod_of_attempt(5)) is None  # JobSet alone
    gave_up = with_annotations(
        tj, status=json.dumps({"state": "GaveUp", "reason": "MaxRestartsExceeded"})
    )
    refusal = attempt_refusal(job_facts(gave_up), pod_of_attempt(1))
    assert refusal is not None and "gave up" in refusal and "MaxRestartsExceeded" in refusal


# --------------------------------------------------------------------------- attempts: views


def test_planning_view(fixture: Fixture) -> None:
    pytorchjob = fixture("pytorchjob_failed.json")
    assert planning_view(pytorchjob) is pytorchjob
    tj = fixture("trainjob_failed.json")
    assert planning_view(tj) is tj  # no attempt planned: as it is
    no_start = with_annotations(tj, restart_attempt="2")
    assert planning_view(no_start) is no_start  # no start recorded: as it is
    started = format_time(NOW - 60, precise=True)
    attempted = with_annotations(tj, restart_attempt="2", attempt_started_at=started)
    view = planning_view(attempted)
    assert view["metadata"]["creationTimestamp"] == started
    assert job_facts(view).created_at == pytest.approx(NOW - 60)
    assert attempted["metadata"]["creationTimestamp"] == "2024-05-02T08:14:03Z"  # untouched
    unparsable = with_annotations(tj, restart_attempt="2", attempt_started_at="soon")
    assert planning_view(unparsable) is unparsable


def test_attempt_view_is_a_fresh_failure(fixture: Fixture) -> None:
    tj = with_annotations(
        fixture("trainjob_running.json"),
        status=json.dumps({"state": "Watching"}),
        restarted_as="x",
        restart_decision="{}",
    )
    view = attempt_view(tj, NOW)
    facts = job_facts(view)
    assert facts.failed and facts.failed_at == pytest.approx(NOW)
    assert facts.status is None and facts.restarted_as is None and not facts.handled
    assert job_facts(tj).status is not None  # the TrainJob itself is untouched


# --------------------------------------------------------------------------- attempts: planning

SPEC = RecoverySpec(max_restarts=3, backoff_seconds=10, max_backoff_seconds=600)


@pytest.fixture
def records(rec: Any) -> list[CheckpointRecord]:
    return [
        rec("full", 1000, created_at=NOW - 900, manifest_hash="h1000"),
        rec("pulse", 1100, created_at=NOW - 600, manifest_hash="h1100", prev_hash="h1000"),
        rec("pulse", 1200, created_at=NOW - 300, manifest_hash="h1200", prev_hash="h1100"),
    ]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"restart_attempt": "1"}, "planned already"),
        ({"restart_attempt": "4"}, "planned already"),
        ({"status": json.dumps({"state": "GaveUp", "reason": "LadderExhausted"})}, "handled"),
    ],
)
def test_precheck_skips(fixture: Fixture, change: dict[str, str], expected: str) -> None:
    tj = with_annotations(fixture("trainjob_running.json"), **change)
    outcome = precheck_attempt(tj, 1, SPEC, NOW)
    assert isinstance(outcome, Skip) and expected in outcome.reason


def test_precheck_other_outcomes(fixture: Fixture) -> None:
    tj = fixture("trainjob_running.json")
    assert precheck_attempt(tj, 1, SPEC, NOW) is None  # no backoff: JobSet restarts at once
    finished = precheck_attempt(fixture("trainjob_failed.json"), 1, SPEC, NOW)
    assert isinstance(finished, Skip) and "finished" in finished.reason
    deleting = copy.deepcopy(tj)
    deleting["metadata"]["deletionTimestamp"] = "2024-05-02T10:00:00Z"
    assert isinstance(precheck_attempt(deleting, 1, SPEC, NOW), Skip)
    spent = precheck_attempt(with_annotations(tj, restart_count="3"), 4, SPEC, NOW)
    assert isinstance(spent, GiveUp) and spent.reason == "MaxRestartsExceeded"
    off = precheck_attempt(tj, 1, SPEC.model_copy(update={"auto_resume": False}), NOW)
    assert isinstance(off, GiveUp) and off.reason == "AutoResumeDisabled"
    not_in = copy.deepcopy(tj)
    del not_in["metadata"]["annotations"][c.ANN_POLICY]
    assert isinstance(precheck_attempt(not_in, 1, SPEC, NOW), Skip)


def test_first_attempt_resumes_from_the_newest_checkpoint(
    fixture: Fixture, records: list[CheckpointRecord]
) -> None:
    verified: list[str] = []

    def verify(cid: str) -> bool:
        verified.append(cid)
        return True

    tj = fixture("trainjob_running.json")
    plan = plan_attempt(tj, 1, PlanRequest(SPEC, records, NOW, verify, mtbf_prior_s=3600.0))
    assert isinstance(plan, AttemptPlan) and plan.attempt == 1
    d = plan.decision
    assert (d.resume_from, d.resume_step, d.restart_count, d.action) == (
        "pulse_step_000000001200",
        1200,
        1,
        "resume",
    )
    assert verified == ["pulse_step_000000001200"] and plan.crash_loop is None
    assert plan.annotations == {
        c.ANN_RUN_ID: RUN,
        c.ANN_RESTART_ATTEMPT: "1",
        c.ANN_ATTEMPT_STARTED_AT: format_time(NOW, precise=True),
        c.ANN_RESTART_COUNT: "1",
        c.ANN_RESUME_FROM: "pulse_step_000000001200",
        c.ANN_RESUME_STEP: "1200",
        c.ANN_RESUME_WEIGHTS: None,
        c.ANN_RESUME_PIN: None,
        c.ANN_POISONED: None,
        c.ANN_RUN_STARTED_AT: f"{CREATED:.0f}",
        c.ANN_MTBF_SECONDS: f"{d.mtbf_seconds:.6g}",
    }
    assert d.mtbf_seconds is not None and d.mtbf_seconds < 7200


def test_an_attempt_without_checkpoints_starts_fresh(fixture: Fixture) -> None:
    plan = plan_attempt(fixture("trainjob_running.json"), 1, PlanRequest(SPEC, [], NOW, never))
    assert isinstance(plan, AttemptPlan)
    assert plan.decision.action == "fresh" and plan.annotations[c.ANN_RESUME_FROM] is None
    assert plan.annotations[c.ANN_MTBF_SECONDS] is None  # no prior given


def _after_attempt(fixture: Fixture, started: float, resume: str = "1200") -> dict[str, Any]:
    return with_annotations(
        fixture("trainjob_running.json"),
        restart_attempt="1",
        attempt_started_at=format_time(started, precise=True),
        restart_count="1",
        resume_from=f"pulse_step_00000000{resume}",
        resume_step=resume,
        run_started_at=f"{CREATED:.0f}",
    )


def test_an_attempt_that_never_advanced_poisons_its_checkpoint(
    fixture: Fixture, records: list[CheckpointRecord]
) -> None:
    # attempt 1 resumed from 1200 (planned 100 s ago) and wrote nothing past it
    tj = _after_attempt(fixture, NOW - 100)
    plan = plan_attempt(tj, 2, PlanRequest(SPEC, records, NOW, lambda _: True))
    assert isinstance(plan, AttemptPlan)
    assert plan.crash_loop == "pulse_step_000000001200"
    assert plan.decision.resume_from == "pulse_step_000000001100"
    assert plan.annotations[c.ANN_POISONED] == "pulse_step_000000001200"
    assert plan.annotations[c.ANN_RESTART_COUNT] == "2"
    assert plan.annotations[c.ANN_RESTART_ATTEMPT] == "2"
    assert plan.annotations[c.ANN_RUN_STARTED_AT] == f"{CREATED:.0f}"  # carried
    assert plan.skipped.get("pulse_step_000000001200", "").startswith("poisoned")


def test_an_attempt_that_advanced_is_no_crash_loop(
    fixture: Fixture, records: list[CheckpointRecord], rec: Any
) -> None:
    tj = _after_attempt(fixture, NOW - 250)  # attempt 1 resumed from 1200 and went on
    progressed = [*records, rec("pulse", 1300, created_at=NOW - 30, manifest_hash="h1300")]
    plan = plan_attempt(tj, 2, PlanRequest(SPEC, progressed, NOW, lambda _: True))
    assert isinstance(plan, AttemptPlan) and plan.crash_loop is None
    assert plan.decision.resume_from == "pulse_step_000000001300"
    # a heartbeat past the resume step counts as progress too
    heartbeat = plan_attempt(
        _after_attempt(fixture, NOW - 100),
        2,
        PlanRequest(SPEC, records, NOW, lambda _: True, [(1210, NOW - 5)]),
    )
    assert isinstance(heartbeat, AttemptPlan) and heartbeat.crash_loop is None
    # ... but not one from before the attempt started (the previous attempt's)
    stale = plan_attempt(
        _after_attempt(fixture, NOW - 100),
        2,
        PlanRequest(SPEC, records, NOW, lambda _: True, [(1210, NOW - 200)]),
    )
    assert isinstance(stale, AttemptPlan) and stale.crash_loop == "pulse_step_000000001200"


def test_poisoned_checkpoints_accumulate_across_attempts(
    fixture: Fixture, records: list[CheckpointRecord]
) -> None:
    tj = with_annotations(
        _after_attempt(fixture, NOW - 100, "1100"), poisoned="pulse_step_000000001200"
    )
    tj["metadata"]["annotations"][c.ANN_RESTART_COUNT] = "2"
    plan = plan_attempt(tj, 3, PlanRequest(SPEC, records, NOW, lambda _: True))
    assert isinstance(plan, AttemptPlan)
    assert plan.annotations[c.ANN_POISONED] == "pulse_step_000000001200,pulse_step_000000001100"
    assert plan.decision.resume_from == "full_step_000000001000"
    assert plan.annotations[c.ANN_RESTART_COUNT] == "3"


def test_attempt_give_ups(fixture: Fixture, records: list[CheckpointRecord]) -> None:
    gone = plan_attempt(_after_attempt(fixture, NOW - 100), 2, PlanRequest(SPEC, [], NOW, never))
    assert isinstance(gone, GiveUp) and gone.reason == "CheckpointsGone"
    exhausted = plan_attempt(
        fixture("trainjob_running.json"), 1, PlanRequest(SPEC, records, NOW, lambda _: False)
    )
    assert isinstance(exhausted, GiveUp) and exhausted.reason == "LadderExhausted"
    spent = plan_attempt(
        with_annotations(fixture("trainjob_running.json"), restart_count="3"),
        4,
        PlanRequest(SPEC, records, NOW, never),
    )
    assert isinstance(spent, GiveUp) and spent.reason == "MaxRestartsExceeded"
    assert isinstance(
        plan_attempt(fixture("trainjob_failed.json"), 1, PlanRequest(SPEC, records, NOW, never)),
        Skip,
    )


def test_attempt_annotations_of_a_heartbeat_rebuild(fixture: Fixture) -> None:
    decision = RestartDecision(
        name="ignored",
        restart_count=2,
        resume_from="heartbeat_step_000000001250",
        resume_step=1250,
        action="rebuild_from_heartbeat",
        poisoned=("a", "b"),
        weights_from="pulse_step_000000001200",
    )
    ann = attempt_annotations(fixture("trainjob_running.json"), 2, decision, NOW)
    assert ann[c.ANN_RESUME_WEIGHTS] == "pulse_step_000000001200"
    assert ann[c.ANN_POISONED] == "a,b" and ann[c.ANN_MTBF_SECONDS] is None
    assert ann[c.ANN_RESUME_STEP] == "1250"


# --------------------------------------------------------------------------- attempts: probing


def _ended(
    phase: str, *, deleting: str | None = None, finished: tuple[str, ...] = ()
) -> dict[str, Any]:
    pod = pod_of_attempt(0)
    pod["metadata"]["creationTimestamp"] = "2024-05-02T10:00:00Z"
    if deleting:
        pod["metadata"]["deletionTimestamp"] = deleting
    pod["status"] = {
        "phase": phase,
        "containerStatuses": [
            {"name": "node", "state": {"terminated": {"finishedAt": f}}} for f in finished
        ],
    }
    return pod


def test_pod_ended_at() -> None:
    t = parse_time
    assert pod_ended_at(_ended("Running")) is None
    assert pod_ended_at(_ended("Succeeded")) is None
    assert pod_ended_at(_ended("Running", deleting="2024-05-02T10:05:00Z")) == t(
        "2024-05-02T10:05:00Z"
    )
    failed = _ended("Failed", finished=("2024-05-02T10:03:00Z", "2024-05-02T10:04:00Z"))
    assert pod_ended_at(failed) == t("2024-05-02T10:04:00Z")
    both = _ended("Failed", deleting="2024-05-02T10:06:00Z", finished=("2024-05-02T10:04:00Z",))
    assert pod_ended_at(both) == t("2024-05-02T10:06:00Z")
    assert pod_ended_at(_ended("Failed")) == t("2024-05-02T10:00:00Z")  # no statuses yet


def test_restart_expected_until() -> None:
    t0 = parse_time("2024-05-02T10:04:00Z") or 0.0
    failed = _ended("Failed", finished=("2024-05-02T10:04:00Z",))
    running = _ended("Running")
    assert restart_expected_until([running], 0) is None
    assert restart_expected_until([running, failed], 0) == t0 + RESTART_PROBE_S
    assert restart_expected_until([failed], 1) is None  # an older attempt's pod
    later = _ended("Running", deleting="2024-05-02T10:05:00Z")
    assert restart_expected_until([failed, later], 0) == t0 + 60 + RESTART_PROBE_S
    assert restart_expected_until([], 0) is None
