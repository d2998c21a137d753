"""Restart planning against recorded PyTorchJobs (the ladder of ckpt_agent.decide.recovery inside)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from ckpt_agent.policy import RecoverySpec
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import (
    job_facts,
    label_templates_in_place,
    parse_time,
    unlabelled_replicas,
)
from ckpt_operator.planners.restart import (
    GiveUp,
    PlanRequest,
    Restart,
    RestartDecision,
    Skip,
    Wait,
    backoff_delay,
    build_restart_job,
    crash_loop_checkpoint,
    plan_restart,
    precheck_restart,
    restart_name,
)

FAILED_AT = parse_time("2024-05-02T11:02:17Z") or 0.0
R1_CREATED = parse_time("2024-05-02T11:02:30Z") or 0.0
LATER = FAILED_AT + 3600
RUN = "mnist-ddp-5f0c6a7e"


def ok(_: str) -> bool:
    return True


def history(rec: Callable[..., CheckpointRecord]) -> list[CheckpointRecord]:
    """A run before its first failure: heartbeats, pulses (chained) and a full."""
    return [
        rec("full", 1000, created_at=FAILED_AT - 900, manifest_hash="h1000"),
        rec("pulse", 1100, created_at=FAILED_AT - 600, manifest_hash="h1100", prev_hash="h1000"),
        rec("pulse", 1200, created_at=FAILED_AT - 300, manifest_hash="h1200", prev_hash="h1100"),
        rec("heartbeat", 1234, created_at=FAILED_AT - 10),
    ]


@pytest.mark.parametrize(
    ("name", "count", "expected"),
    [
        ("mnist-ddp", 0, "mnist-ddp-r1"),
        ("mnist-ddp-r1", 1, "mnist-ddp-r2"),
        ("mnist-ddp-r9", 9, "mnist-ddp-r10"),
        ("train-r1", 0, "train-r1-r1"),  # a user name that merely looks like a restart
        ("x" * 63, 0, "x" * 60 + "-r1"),
    ],
)
def test_restart_names_are_deterministic(name: str, count: int, expected: str) -> None:
    assert restart_name(name, count) == expected
    assert len(restart_name(name, count)) <= 63


@pytest.mark.parametrize(
    ("count", "expected"), [(0, 10.0), (1, 20.0), (2, 40.0), (6, 600.0), (200, 600.0)]
)
def test_backoff_doubles_up_to_the_cap(count: int, expected: float) -> None:
    spec = RecoverySpec(backoff_seconds=10, max_backoff_seconds=600)
    assert backoff_delay(spec, count) == expected
    assert backoff_delay(RecoverySpec(backoff_seconds=0), count) == 0.0


def test_first_failure_restarts_from_the_newest_verified_checkpoint(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    job = fixture("pytorchjob_failed.json")
    out = plan_restart(job, PlanRequest(RecoverySpec(), history(rec), LATER, ok))
    assert isinstance(out, Restart) and not out.replay
    d = out.decision
    assert (d.name, d.restart_count, d.resume_from, d.resume_step) == (
        "mnist-ddp-r1",
        1,
        "pulse_step_000000001200",
        1200,
    )
    assert d.action == "resume" and d.poisoned == () and out.crash_loop is None
    assert [(s.checkpoint_id, s.accepted) for s in out.ladder] == [
        ("pulse_step_000000001200", True)
    ]

    new = out.job
    ann = new["metadata"]["annotations"]
    assert new["metadata"]["name"] == "mnist-ddp-r1"
    assert new["metadata"]["namespace"] == "ml-team"
    assert ann[c.ANN_RUN_ID] == RUN
    assert ann[c.ANN_RESTART_COUNT] == "1"
    assert ann[c.ANN_RESUME_FROM] == "pulse_step_000000001200"
    assert ann[c.ANN_RESUME_STEP] == "1200"
    assert ann[c.ANN_RESTART_OF] == "mnist-ddp"
    assert ann[c.ANN_POLICY] == "llm-finetune" and ann[c.ANN_AUTO_RESUME] == "true"
    # the operator's bookkeeping and kubectl's copy of the old object are not carried over
    assert c.ANN_STATUS not in ann
    assert "kubectl.kubernetes.io/last-applied-configuration" not in ann
    # same spec, every pod template labelled for the (fail-closed) injection webhook;
    # a fresh object (no status, uid, resourceVersion, managedFields)
    expected = copy.deepcopy(job)
    assert label_templates_in_place(expected)
    assert new["spec"] == expected["spec"]
    assert unlabelled_replicas(new) == []
    assert set(new) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(new["metadata"]) == {"name", "namespace", "annotations"}


def test_corrupted_newest_walks_the_chain(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    job = fixture("pytorchjob_failed.json")

    def verify(cid: str) -> bool:
        if cid == "pulse_step_000000001200":
            raise ValueError("blob 3fa1 does not match its SHA-256 (corrupted)")
        return True

    out = plan_restart(job, PlanRequest(RecoverySpec(), history(rec), LATER, verify))
    assert isinstance(out, Restart)
    assert out.decision.resume_from == "pulse_step_000000001100"
    rejected, accepted = out.ladder
    assert rejected.checkpoint_id == "pulse_step_000000001200" and not rejected.accepted
    assert "SHA-256" in rejected.why
    assert accepted.checkpoint_id == "pulse_step_000000001100" and accepted.accepted


def test_crash_loop_poisons_the_resume_checkpoint(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    job = fixture("pytorchjob_r1_failed.json")  # restart 1 from pulse 1200, failed at once
    records = history(rec)
    out = plan_restart(job, PlanRequest(RecoverySpec(), records, LATER, ok))
    assert isinstance(out, Restart)
    assert out.crash_loop == "pulse_step_000000001200"
    assert out.decision.poisoned == ("pulse_step_000000001200",)
    assert out.decision.resume_from == "pulse_step_000000001100"
    assert out.decision.name == "mnist-ddp-r2" and out.decision.restart_count == 2
    assert out.job["metadata"]["annotations"][c.ANN_POISONED] == "pulse_step_000000001200"
    assert out.job["metadata"]["annotations"][c.ANN_RESTART_OF] == "mnist-ddp-r1"


def test_a_crash_on_a_checkpoint_that_fails_verification_is_explained_not_poisoned(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    """r1 died on its pin because the pin is corrupted (a pod's verdict, when the operator
    plans from the pods' reports): the ladder rejects it where it stands, each checkpoint
    verified once."""
    job = fixture("pytorchjob_r1_failed.json")  # restart 1 from pulse 1200, failed at once
    asked: list[str] = []

    def verify(cid: str) -> bool:
        asked.append(cid)
        if cid == "pulse_step_000000001200":
            raise ValueError("a pod found it corrupted")
        return True

    out = plan_restart(job, PlanRequest(RecoverySpec(), history(rec), LATER, verify))
    assert isinstance(out, Restart)
    assert out.crash_loop is None and out.decision.poisoned == ()
    assert out.decision.resume_from == "pulse_step_000000001100"
    rejected, _ = out.ladder
    assert rejected.checkpoint_id == "pulse_step_000000001200" and "corrupted" in rejected.why
    assert asked == ["pulse_step_000000001200", "pulse_step_000000001100"]  # once each


def test_progress_after_the_restart_is_not_a_crash_loop(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    job = fixture("pytorchjob_r1_failed.json")
    facts = job_facts(job)
    records = [*history(rec), rec("pulse", 1300, created_at=R1_CREATED + 20)]
    assert crash_loop_checkpoint(facts, records) is None
    # a heartbeat past the resume step, written by this job, is progress too
    assert crash_loop_checkpoint(facts, history(rec), [(1201, R1_CREATED + 5)]) is None
    # old checkpoints past the step (written before this job existed) are not
    old = [*history(rec), rec("pulse", 1300, created_at=R1_CREATED - 60)]
    assert crash_loop_checkpoint(facts, old) == "pulse_step_000000001200"
    # a heartbeat at the resume step itself is not progress
    assert crash_loop_checkpoint(facts, history(rec), [(1200, R1_CREATED + 5)]) is not None


def test_the_previous_runs_last_second_is_not_progress_of_the_restart(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    """Found on the real control plane: creationTimestamp is truncated to the second, so
    heartbeats the killed run wrote just before a quick restart carry times >= it."""
    facts = job_facts(fixture("pytorchjob_r1_failed.json"))
    heartbeats = [(1250, R1_CREATED + 0.3), (1251, R1_CREATED + 0.6)]
    assert crash_loop_checkpoint(facts, history(rec), heartbeats) == "pulse_step_000000001200"
    late = [*history(rec), rec("pulse", 1300, created_at=R1_CREATED + 0.9)]
    assert crash_loop_checkpoint(facts, late) == "pulse_step_000000001200"
    # from the next second on it is the restart's own progress
    assert crash_loop_checkpoint(facts, history(rec), [(1201, R1_CREATED + 1.2)]) is None


def test_poisoned_list_accumulates_across_the_chain(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    job = fixture("pytorchjob_r1_failed.json")
    ann = job["metadata"]["annotations"]
    ann[c.ANN_POISONED] = "pulse_step_000000001300"
    out = plan_restart(job, PlanRequest(RecoverySpec(), history(rec), LATER, ok))
    assert isinstance(out, Restart)
    assert out.decision.poisoned == ("pulse_step_000000001300", "pulse_step_000000001200")


def test_ladder_exhausted_is_terminal(fixture: Any, rec: Callable[..., CheckpointRecord]) -> None:
    job = fixture("pytorchjob_failed.json")

    def bad(cid: str) -> bool:
        return False

    out = plan_restart(
        job, PlanRequest(RecoverySpec(allow_heartbeat_rebuild=False), history(rec), LATER, bad)
    )
    assert isinstance(out, GiveUp) and out.reason == "LadderExhausted"
    assert "pulse_step_000000001200" in out.message and RUN in out.message


def test_only_unusable_checkpoints_gives_up(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    job = fixture("pytorchjob_failed.json")
    records = [rec("pulse", 100, status=CheckpointStatus.CORRUPTED)]
    out = plan_restart(job, PlanRequest(RecoverySpec(), records, LATER, ok))
    assert isinstance(out, GiveUp) and out.reason == "LadderExhausted"


def test_no_checkpoint_yet_restarts_from_the_beginning(fixture: Any) -> None:
    job = fixture("pytorchjob_failed.json")
    out = plan_restart(job, PlanRequest(RecoverySpec(), [], LATER, ok))
    assert isinstance(out, Restart) and out.decision.action == "fresh"
    assert out.decision.resume_from is None
    assert c.ANN_RESUME_FROM not in out.job["metadata"]["annotations"]


def test_checkpoints_vanished_after_a_resume_gives_up(fixture: Any) -> None:
    out = plan_restart(
        fixture("pytorchjob_r1_failed.json"), PlanRequest(RecoverySpec(), [], LATER, ok)
    )
    assert isinstance(out, GiveUp) and out.reason == "CheckpointsGone"


def test_max_restarts_counts_across_the_chain(fixture: Any) -> None:
    job = fixture("pytorchjob_r1_failed.json")
    out = precheck_restart(job, RecoverySpec(max_restarts=1), LATER)
    assert isinstance(out, GiveUp) and out.reason == "MaxRestartsExceeded"
    assert precheck_restart(job, RecoverySpec(max_restarts=2), LATER) is None
    assert isinstance(
        precheck_restart(fixture("pytorchjob_failed.json"), RecoverySpec(max_restarts=0), LATER),
        GiveUp,
    )


def test_backoff_waits_from_the_failure_time(fixture: Any) -> None:
    job = fixture("pytorchjob_r1_failed.json")  # restart 1 → 20 s backoff
    failed_at = parse_time("2024-05-02T11:03:05Z") or 0.0
    out = precheck_restart(job, RecoverySpec(backoff_seconds=10), failed_at + 5)
    assert isinstance(out, Wait) and out.seconds == pytest.approx(15.0)
    assert precheck_restart(job, RecoverySpec(backoff_seconds=10), failed_at + 20) is None


@pytest.mark.parametrize(
    ("fixture_name", "mutate", "reason"),
    [
        ("pytorchjob_running.json", None, "has not failed"),
        ("pytorchjob_succeeded.json", None, "succeeded"),
        (
            "pytorchjob_failed.json",
            lambda j: j["metadata"].update(deletionTimestamp="2024-05-02T11:02:20Z"),
            "being deleted",
        ),
        (
            "pytorchjob_failed.json",
            lambda j: j["metadata"]["annotations"].pop(c.ANN_AUTO_RESUME),
            "not opted in",
        ),
        (
            "pytorchjob_failed.json",
            lambda j: j["metadata"]["annotations"].update({c.ANN_AUTO_RESUME: "false"}),
            "not opted in",
        ),
        (
            "pytorchjob_failed.json",
            lambda j: j["metadata"]["annotations"].update(
                {c.ANN_STATUS: json.dumps({"state": "Restarted"})}
            ),
            "already handled",
        ),
        (
            "pytorchjob_failed.json",
            lambda j: j["metadata"]["annotations"].update(
                {c.ANN_STATUS: json.dumps({"state": "GaveUp"})}
            ),
            "already handled",
        ),
    ],
    ids=[
        "running",
        "succeeded",
        "deleted",
        "not-opted-in",
        "auto-resume-false",
        "restarted",
        "gave-up",
    ],
)
def test_never_restarts_what_it_must_not(
    fixture: Any, fixture_name: str, mutate: Any, reason: str
) -> None:
    job = fixture(fixture_name)
    if mutate:
        mutate(job)
    out = plan_restart(job, PlanRequest(RecoverySpec(), [], LATER, ok))
    assert isinstance(out, Skip) and reason in out.reason


def test_policy_disabling_auto_resume_gives_up_once(fixture: Any) -> None:
    out = precheck_restart(
        fixture("pytorchjob_failed.json"), RecoverySpec(auto_resume=False), LATER
    )
    assert isinstance(out, GiveUp) and out.reason == "AutoResumeDisabled"


def test_a_written_decision_is_replayed_verbatim(
    fixture: Any, rec: Callable[..., CheckpointRecord]
) -> None:
    job = fixture("pytorchjob_failed.json")
    first = plan_restart(job, PlanRequest(RecoverySpec(), history(rec), LATER, ok))
    assert isinstance(first, Restart)
    # the operator wrote its intent, then crashed before (or after) the create
    ann = job["metadata"]["annotations"]
    ann[c.ANN_RESTARTED_AS] = first.decision.name
    ann[c.ANN_RESTART_DECISION] = first.decision.to_json()
    # storage changed meanwhile (a newer pulse appeared): the decision must not change
    calls: list[str] = []

    def verify(cid: str) -> bool:
        calls.append(cid)
        return True

    newer = [*history(rec), rec("pulse", 1300, created_at=LATER - 5)]
    again = plan_restart(job, PlanRequest(RecoverySpec(), newer, LATER + 999, verify))
    assert isinstance(again, Restart) and again.replay
    assert again.decision == first.decision
    assert again.job == first.job
    assert calls == []  # no re-verification, no re-planning


def test_decision_round_trips_through_json() -> None:
    d = RestartDecision(
        name="j-r2",
        restart_count=2,
        resume_from="full_step_000000001000",
        resume_step=1000,
        action="rebuild_from_heartbeat",
        poisoned=("a", "b"),
        weights_from="pulse_step_000000000900",
        reason="why",
    )
    assert RestartDecision.from_mapping(json.loads(d.to_json())) == d


def test_restart_keeps_labels_and_owner_references(fixture: Any) -> None:
    job = fixture("pytorchjob_failed.json")
    job["metadata"]["labels"] = {"team": "a"}
    job["metadata"]["ownerReferences"] = [
        {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "wf", "uid": "u"}
    ]
    job["metadata"]["annotations"]["operator.ckpt.dev/last-handled-configuration"] = "{}"
    job["metadata"]["finalizers"] = ["operator.ckpt.dev/finalizer"]
    d = RestartDecision("mnist-ddp-r1", 1, None, None, "fresh")
    new = build_restart_job(job, d)
    assert new["metadata"]["labels"] == {"team": "a"}
    assert new["metadata"]["ownerReferences"][0]["name"] == "wf"
    assert "finalizers" not in new["metadata"]
    assert not any(k.startswith("operator.ckpt.dev/") for k in new["metadata"]["annotations"])
