"""The pure side of checkpoint-aware Kueue preemption (#30): the Workload read, at-risk work
→ boost, when (not) to write, foreign owners, evictions, steps lost, termination grace."""

from __future__ import annotations

from typing import Any

import pytest

from ckpt_agent.policy.models import PreemptionSpec, PriorityBoostSpec
from ckpt_agent.records import CheckpointStatus
from ckpt_operator.model import constants as c
from ckpt_operator.planners.disruption_signals import PREEMPTION, preemption_disruption
from ckpt_operator.planners.preemption import (
    ANN_BOOST,
    ANN_BOOST_WRITTEN,
    ANN_BOOST_WRITTEN_AT,
    ANN_PREEMPTED,
    ANN_SAVE_SECONDS,
    ASSUMED_WRITE_BYTES_PER_S,
    DEFAULT_SAVE_SECONDS,
    GRACE_MARGIN_S,
    HOLD_MARGIN_S,
    MIN_SAVE_SECONDS,
    AtRisk,
    BoostAction,
    Progress,
    at_risk,
    blocking_pods,
    boost_due,
    boost_points,
    desired_boost,
    expected_save_seconds,
    hold_release,
    hysteresis_points,
    lost_steps,
    plan_boost,
    progress_of,
    save_seconds_update,
    saved_seconds,
    termination_grace,
)
from ckpt_operator.planners.workload import (
    JobRef,
    eviction_of,
    workload_view,
)
from tests.ckpt_operator.conftest import record

SPEC = PriorityBoostSpec(enabled=True, max_boost=100, seconds_per_point=30, min_update_seconds=30)
ON = PreemptionSpec(priority_boost=SPEC)
NOW = 1_000_000.0


def workload(
    *,
    conditions: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
    owners: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": "pytorchjob-train-1a2b3",
            "namespace": "ml-team",
            "uid": "wl-uid",
            "resourceVersion": "7",
            "annotations": annotations or {},
            "ownerReferences": owners
            if owners is not None
            else [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": "train",
                    "uid": "job-uid",
                    "controller": True,
                }
            ],
        },
        "status": {"conditions": conditions or []},
    }


ADMITTED = {
    "type": "QuotaReserved",
    "status": "True",
    "reason": "QuotaReserved",
    "lastTransitionTime": "1970-01-12T13:46:40Z",  # NOW
}


def evicted(reason: str = "Preempted", since: str = "1970-01-12T13:50:00Z") -> dict[str, Any]:
    return {
        "type": "Evicted",
        "status": "True",
        "reason": reason,
        "message": "Preempted to accommodate a workload (UID: x) due to prioritization",
        "lastTransitionTime": since,
    }


# --------------------------------------------------------------------------- the Workload


def test_workload_view_reads_owner_admission_and_eviction() -> None:
    view = workload_view(workload(conditions=[ADMITTED]))
    assert view.owner == JobRef("PyTorchJob", "train")
    assert view.admitted and view.admitted_at == NOW
    assert view.eviction is None and not view.finished
    assert (view.namespace, view.name, view.uid) == ("ml-team", "pytorchjob-train-1a2b3", "wl-uid")


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        (
            {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": "tj"},
            JobRef("TrainJob", "tj"),
        ),
        ({"apiVersion": "batch/v1", "kind": "Job", "name": "j"}, None),
        # a PyTorchJob kind of another group is not ours
        ({"apiVersion": "example.com/v1", "kind": "PyTorchJob", "name": "x"}, None),
        ({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": ""}, None),
    ],
)
def test_workload_owner_kinds(ref: dict[str, Any], expected: JobRef | None) -> None:
    assert workload_view(workload(owners=[ref])).owner == expected


def test_the_controller_owner_wins() -> None:
    owners = [
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "other"},
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "name": "train",
            "controller": True,
        },
    ]
    assert workload_view(workload(owners=owners)).owner == JobRef("PyTorchJob", "train")


def test_no_owner_and_odd_entries() -> None:
    assert workload_view(workload(owners=["junk", {}])).owner is None  # type: ignore[list-item]


@pytest.mark.parametrize(
    "reason", ["Preempted", "PodsReadyTimeout", "Deactivated", "ClusterQueueStopped"]
)
def test_eviction_detected_with_its_reason(reason: str) -> None:
    ev = eviction_of(workload(conditions=[ADMITTED, evicted(reason)]))
    assert ev is not None and ev.reason == reason
    assert ev.key == f"workload/wl-uid/Evicted/{reason}/1970-01-12T13:50:00Z"


def test_no_eviction_while_the_condition_is_false_or_absent() -> None:
    assert eviction_of(workload(conditions=[ADMITTED])) is None
    gone = dict(evicted(), status="False")
    assert eviction_of(workload(conditions=[gone])) is None


def test_finished_workload() -> None:
    view = workload_view(workload(conditions=[{"type": "Finished", "status": "True"}]))
    assert view.finished and not view.admitted


def test_preemption_disruption_is_one_request_per_eviction() -> None:
    first = eviction_of(workload(conditions=[evicted()]))
    again = eviction_of(workload(conditions=[evicted()]))
    later = eviction_of(workload(conditions=[evicted(since="1970-01-12T14:00:00Z")]))
    assert first is not None and again is not None and later is not None
    d = preemption_disruption(first)
    assert d.reason == PREEMPTION and not d.warning
    assert "Preempted" in d.message
    assert d.request_id == preemption_disruption(again).request_id
    assert d.request_id != preemption_disruption(later).request_id
    assert d.signal == d.request_id  # a plain save-now, not a node warning


# --------------------------------------------------------------------------- at-risk work


def test_progress_takes_the_newest_valid_weights_checkpoint() -> None:
    records = [
        record("full", 100, created_at=NOW - 900),
        record("pulse", 200, created_at=NOW - 600),
        record("pulse", 300, created_at=NOW - 300, status=CheckpointStatus.PENDING),
        record("pulse", 400, created_at=NOW - 100, status=CheckpointStatus.CORRUPTED),
        record("heartbeat", 450, created_at=NOW - 50),  # no weights
    ]
    p = progress_of(records, [(440, NOW - 60), (460, NOW - 5)])
    assert (p.valid_step, p.valid_at) == (200, NOW - 600)
    assert p.saved_step == 300  # pending counts as saved (where a resume goes once validated)
    assert (p.newest_step, p.newest_at) == (460, NOW - 5)


def test_progress_of_nothing() -> None:
    assert progress_of([], []) == Progress()


def test_expected_save_seconds() -> None:
    assert expected_save_seconds([]) == DEFAULT_SAVE_SECONDS
    assert expected_save_seconds([record("heartbeat", 3, size=10**12)]) == DEFAULT_SAVE_SECONDS
    assert expected_save_seconds([record("full", 1, size=1000)]) == MIN_SAVE_SECONDS
    big = 40 * ASSUMED_WRITE_BYTES_PER_S
    assert expected_save_seconds([record("pulse", 1, size=10), record("full", 2, size=big)]) == 40


def test_at_risk_runs_from_the_checkpoint_to_the_newest_heartbeat() -> None:
    p = Progress(valid_step=200, valid_at=NOW - 600, newest_step=460, newest_at=NOW - 5)
    risk = at_risk(p, now=NOW, running_since=NOW - 5000, save_seconds=60)
    assert risk == AtRisk(seconds=595 + 60, steps=260, save_seconds=60)


def test_at_risk_without_heartbeats_runs_to_now() -> None:
    p = Progress(valid_step=200, valid_at=NOW - 600)
    assert at_risk(p, now=NOW, running_since=None, save_seconds=0).seconds == 600
    assert at_risk(p, now=NOW, running_since=None, save_seconds=0).steps is None


def test_at_risk_without_a_checkpoint_runs_from_the_start() -> None:
    p = Progress(newest_step=50, newest_at=NOW)
    risk = at_risk(p, now=NOW, running_since=NOW - 300, save_seconds=10)
    assert (risk.seconds, risk.steps) == (310, 50)
    # nothing known at all: only the save
    assert at_risk(Progress(), now=NOW, running_since=None, save_seconds=10).seconds == 10


def test_a_stale_heartbeat_older_than_the_checkpoint_puts_nothing_at_risk() -> None:
    p = Progress(valid_step=9, valid_at=NOW - 100, newest_step=9, newest_at=NOW - 400)
    assert at_risk(p, now=NOW, running_since=None, save_seconds=0) == AtRisk(0.0, 0, 0)


def test_a_heartbeat_from_the_future_is_capped_at_now() -> None:
    p = Progress(valid_step=0, valid_at=NOW - 100, newest_step=5, newest_at=NOW + 1000)
    assert at_risk(p, now=NOW, running_since=None, save_seconds=0).seconds == 100


@pytest.mark.parametrize(
    ("seconds", "points"),
    [(0, 0), (29.9, 0), (30, 1), (95, 3), (3000, 100), (10**9, 100)],
)
def test_boost_points_are_clamped(seconds: float, points: int) -> None:
    assert boost_points(AtRisk(seconds, None, 0), SPEC) == points


def test_boost_points_follow_the_policy() -> None:
    spec = PriorityBoostSpec(enabled=True, max_boost=7, seconds_per_point=10)
    assert boost_points(AtRisk(55, None, 0), spec) == 5
    assert boost_points(AtRisk(500, None, 0), spec) == 7


def test_hysteresis_is_five_percent_of_max_at_least_one() -> None:
    assert hysteresis_points(SPEC) == 5
    assert hysteresis_points(PriorityBoostSpec(max_boost=3)) == 1


def test_desired_boost_only_for_running_admitted_workloads() -> None:
    risk = AtRisk(300, 10, 60)
    admitted = workload_view(workload(conditions=[ADMITTED]))
    assert desired_boost(admitted, ON, risk, job_ended=False) == 10
    assert desired_boost(admitted, PreemptionSpec(), risk, job_ended=False) is None  # disabled
    assert desired_boost(admitted, ON, risk, job_ended=True) is None
    assert desired_boost(admitted, ON, None, job_ended=False) is None  # storage unreadable
    pending = workload_view(workload())
    assert desired_boost(pending, ON, risk, job_ended=False) is None
    gone = workload_view(workload(conditions=[ADMITTED, evicted()]))
    assert desired_boost(gone, ON, risk, job_ended=False) is None
    done = workload_view(workload(conditions=[ADMITTED, {"type": "Finished", "status": "True"}]))
    assert desired_boost(done, ON, risk, job_ended=False) is None


# --------------------------------------------------------------------------- writes


def ours(value: int, at: float) -> dict[str, str]:
    return {ANN_BOOST: str(value), ANN_BOOST_WRITTEN: str(value), ANN_BOOST_WRITTEN_AT: f"{at:.0f}"}


def test_first_write_sets_the_boost_and_our_record() -> None:
    plan = plan_boost({}, 12, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.WRITE and (plan.value, plan.previous) == (12, None)
    assert plan.annotations == {
        ANN_BOOST: "12",
        ANN_BOOST_WRITTEN: "12",
        ANN_BOOST_WRITTEN_AT: f"{NOW:.0f}",
    }


def test_zero_is_written_as_zero_never_empty() -> None:
    plan = plan_boost({}, 0, now=NOW, spec=SPEC)
    assert plan.annotations[ANN_BOOST] == "0"


def test_nothing_wanted_nothing_there() -> None:
    assert plan_boost({}, None, now=NOW, spec=SPEC).action is BoostAction.NONE


def test_unchanged_boost_writes_nothing() -> None:
    plan = plan_boost(ours(12, NOW - 1000), 12, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.NONE and plan.annotations == {}


def test_small_changes_are_held_by_hysteresis() -> None:
    plan = plan_boost(ours(12, NOW - 1000), 16, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.HOLD and plan.annotations == {}
    assert plan_boost(ours(12, NOW - 1000), 17, now=NOW, spec=SPEC).action is BoostAction.WRITE
    assert plan_boost(ours(12, NOW - 1000), 7, now=NOW, spec=SPEC).action is BoostAction.WRITE


def test_writes_are_rate_limited_per_workload() -> None:
    plan = plan_boost(ours(12, NOW - 29), 60, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.HOLD and "minUpdateSeconds" in plan.why
    plan = plan_boost(ours(12, NOW - 30), 60, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.WRITE and plan.previous == 12


def test_a_removal_is_not_rate_limited() -> None:
    plan = plan_boost(ours(12, NOW - 1), None, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.REMOVE and plan.previous == 12
    assert plan.annotations == {
        ANN_BOOST: None,
        ANN_BOOST_WRITTEN: None,
        ANN_BOOST_WRITTEN_AT: None,
    }


def test_an_unreadable_write_time_does_not_block_forever() -> None:
    ann = {ANN_BOOST: "12", ANN_BOOST_WRITTEN: "12", ANN_BOOST_WRITTEN_AT: "yesterday"}
    assert plan_boost(ann, 60, now=NOW, spec=SPEC).action is BoostAction.WRITE


def test_writes_over_a_long_run_are_bounded_by_the_rate_limit() -> None:
    """At-risk work growing and dropping at every save: at most one write per
    minUpdateSeconds, however often the operator looks."""
    ann: dict[str, str] = {}
    writes = 0
    for tick in range(3600):  # an hour, looked at every second
        now = NOW + tick
        desired = (tick % 600) // 10  # a save every 10 minutes resets the risk
        plan = plan_boost(ann, desired, now=now, spec=SPEC)
        if plan.action is BoostAction.WRITE:
            writes += 1
            ann = {k: v for k, v in plan.annotations.items() if v is not None}
    assert 0 < writes <= 3600 / SPEC.min_update_seconds
    # hysteresis: one write per 5 points of change (50 s here), not one per look or per point
    assert writes == 6 * (60 // hysteresis_points(SPEC))


def test_a_boost_set_by_someone_else_is_left_alone() -> None:
    plan = plan_boost({ANN_BOOST: "500"}, 12, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.CONFLICT and plan.annotations == {}
    assert "another controller" in plan.why
    # also when we would remove it
    assert plan_boost({ANN_BOOST: "500"}, None, now=NOW, spec=SPEC).action is BoostAction.CONFLICT


def test_a_boost_changed_after_our_write_is_left_alone() -> None:
    ann = ours(12, NOW - 1000) | {ANN_BOOST: "-5"}
    plan = plan_boost(ann, 40, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.CONFLICT and "'12'" in plan.why and "'-5'" in plan.why


def test_a_boost_removed_by_someone_else_while_we_want_one_is_a_conflict() -> None:
    ann = {ANN_BOOST_WRITTEN: "12", ANN_BOOST_WRITTEN_AT: f"{NOW:.0f}"}
    plan = plan_boost(ann, 40, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.CONFLICT and "removed" in plan.why


def test_our_stale_record_is_dropped_when_nothing_is_wanted() -> None:
    ann = {ANN_BOOST_WRITTEN: "12", ANN_BOOST_WRITTEN_AT: f"{NOW:.0f}"}
    plan = plan_boost(ann, None, now=NOW, spec=SPEC)
    assert plan.action is BoostAction.REMOVE
    assert plan.annotations == {ANN_BOOST_WRITTEN: None, ANN_BOOST_WRITTEN_AT: None}


def test_a_garbled_record_is_not_ours() -> None:
    ann = {ANN_BOOST: "x", ANN_BOOST_WRITTEN: "x"}
    assert plan_boost(ann, 3, now=NOW, spec=SPEC).action is BoostAction.CONFLICT


def test_boost_due() -> None:
    assert boost_due({}, now=NOW, spec=SPEC)
    assert not boost_due(ours(12, NOW - 10), now=NOW, spec=SPEC)
    assert boost_due(ours(12, NOW - 30), now=NOW, spec=SPEC)
    assert boost_due({ANN_BOOST: "3"}, now=NOW, spec=SPEC)  # foreign: looked at (and left)


# --------------------------------------------------------------------------- after an eviction


def test_lost_steps_after_readmission() -> None:
    mark = {ANN_PREEMPTED: "Preemption-abc"}
    p = Progress(valid_step=400, saved_step=460, newest_step=461)
    assert lost_steps(mark, p) == 1
    assert lost_steps({}, p) is None  # not evicted
    assert lost_steps(mark, Progress(saved_step=460)) is None  # progress unknown
    assert lost_steps(mark, Progress(newest_step=30)) == 30  # no checkpoint: from step 0
    assert lost_steps(mark, Progress(saved_step=50, newest_step=40)) == 0


# --------------------------------------------------------------------------- grace


def test_saved_seconds_reads_the_job_annotation() -> None:
    assert saved_seconds({ANN_SAVE_SECONDS: "42"}) == 42
    for bad in ("", "-3", "0", "nan", "inf", "soon"):
        assert saved_seconds({ANN_SAVE_SECONDS: bad}) is None
    assert saved_seconds({}) is None


def test_save_seconds_update_only_when_it_moves() -> None:
    assert save_seconds_update({}, 41.2) == "42"
    assert save_seconds_update({ANN_SAVE_SECONDS: "40"}, 49) is None
    assert save_seconds_update({ANN_SAVE_SECONDS: "40"}, 51) == "51"
    assert save_seconds_update({ANN_SAVE_SECONDS: "40"}, 29) == "29"


def test_grace_covers_the_default_save_when_nothing_is_known() -> None:
    want = int(DEFAULT_SAVE_SECONDS + GRACE_MARGIN_S)
    assert termination_grace(None, {}, PreemptionSpec()) == want
    assert termination_grace(30, {}, PreemptionSpec()) == want


def test_grace_covers_the_measured_save() -> None:
    assert termination_grace(None, {ANN_SAVE_SECONDS: "100"}, PreemptionSpec()) == 115


def test_grace_is_bounded_by_max_grace_seconds() -> None:
    spec = PreemptionSpec(max_grace_seconds=90)
    assert termination_grace(None, {ANN_SAVE_SECONDS: "600"}, spec) == 90


def test_grace_never_lowers_a_larger_one() -> None:
    assert termination_grace(600, {ANN_SAVE_SECONDS: "100"}, PreemptionSpec()) is None
    assert termination_grace(115, {ANN_SAVE_SECONDS: "100"}, PreemptionSpec()) is None


def test_grace_below_kubernetes_default_is_never_set() -> None:
    spec = PreemptionSpec(max_grace_seconds=20)
    assert termination_grace(None, {}, spec) is None  # 20 < the default 30: leave it


def test_grace_off() -> None:
    assert termination_grace(None, {}, PreemptionSpec(save_on_eviction=False)) is None
    assert termination_grace(None, {}, PreemptionSpec(max_grace_seconds=0)) is None


def test_a_user_grace_of_odd_type_counts_as_absent() -> None:
    assert termination_grace(True, {}, PreemptionSpec()) == 75
    assert termination_grace("600", {}, PreemptionSpec()) == 75


def test_annotation_names_are_ours_except_kueues() -> None:
    assert ANN_BOOST == "kueue.x-k8s.io/priority-boost"
    for name in (ANN_BOOST_WRITTEN, ANN_BOOST_WRITTEN_AT, ANN_PREEMPTED, ANN_SAVE_SECONDS):
        assert name.startswith(c.PREFIX + "/")


# --------------------------------------------------------------------------- the hold


def _pod(phase: str = "Running", deleting: bool = False, grace: int | None = None) -> Any:
    pod: dict[str, Any] = {"metadata": {"name": "p"}, "spec": {}, "status": {"phase": phase}}
    if deleting:
        pod["metadata"]["deletionTimestamp"] = "2024-05-02T12:00:00Z"
    if grace is not None:
        pod["spec"]["terminationGracePeriodSeconds"] = grace
    return pod


def test_blocking_pods_are_those_not_ended_or_being_deleted() -> None:
    running, deleting = _pod(), _pod("Failed", deleting=True)
    ended, pending = _pod("Succeeded"), _pod("Pending")
    assert blocking_pods([running, deleting, ended, pending]) == [running, deleting, pending]
    assert blocking_pods([]) == []


def test_hold_release_rules() -> None:
    now = 1000.0
    held = f"{now - 10:.3f}"
    saving = [_pod(deleting=True, grace=75)]
    assert hold_release(held, saving, now=now, job_ended=False) is None
    assert hold_release(held, [], now=now, job_ended=False) == "the evicted pods have ended"
    assert hold_release(held, saving, now=now, job_ended=True) == "the job ended"
    assert "unreadable" in (hold_release("x", saving, now=now, job_ended=False) or "")
    # bounded: the longest grace plus the margin, then released with a reason
    late = now - 10 + 75 + HOLD_MARGIN_S
    assert hold_release(held, saving, now=late - 1, job_ended=False) is None
    why = hold_release(held, saving, now=late, job_ended=False)
    assert why is not None and "still there" in why
    # a deletion's own grace wins; none known: Kubernetes' default
    short = _pod(deleting=True, grace=600)
    short["metadata"]["deletionGracePeriodSeconds"] = 5
    assert hold_release(held, [short], now=now - 10 + 5 + HOLD_MARGIN_S, job_ended=False)
    assert (
        hold_release(held, [_pod()], now=now - 10 + 30 + HOLD_MARGIN_S - 1, job_ended=False) is None
    )
