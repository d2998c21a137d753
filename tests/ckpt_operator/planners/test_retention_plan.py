"""Retention reconciliation: plans per run, the safety guard, and the policy status."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from ckpt_agent.decide.retention import RetentionPlan
from ckpt_agent.policy import RetentionSpec
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_operator.planners.retention_plan import (
    LISTING_SHARE,
    Deletion,
    PassBudget,
    PolicyRetentionPlan,
    RunRetention,
    anomalies_from_records,
    deletion_batches,
    guard_deletions,
    manifest_refusal,
    plan_policy_retention,
    retention_status,
)

NOW = 1714650000.0
Rec = Callable[..., CheckpointRecord]


def run(rec: Rec) -> list[CheckpointRecord]:
    return [
        rec("pulse", 100, created_at=NOW - 500, size=100, score=0.1),
        rec("pulse", 200, created_at=NOW - 400, size=100, score=0.6),
        rec("pulse", 300, created_at=NOW - 300, size=100, score=0.9),  # critical
        rec("pulse", 400, created_at=NOW - 200, size=100, score=0.1),
        rec("pulse", 500, created_at=NOW - 100, size=100, score=0.1),
        rec("heartbeat", 510, created_at=NOW - 90, size=1),
        rec("heartbeat", 520, created_at=NOW - 80, size=1),
        rec("pulse", 450, created_at=NOW - 150, size=100, status=CheckpointStatus.CORRUPTED),
    ]


def test_deletes_what_the_classes_no_longer_keep(rec: Rec) -> None:
    plan = plan_policy_retention({"run-a": run(rec)}, RetentionSpec(), NOW)
    deleted = [d.checkpoint_id for d in plan.deletions]
    assert deleted == [
        "heartbeat_step_000000000510",  # heartbeats: only the newest survives
        "pulse_step_000000000450",  # corrupted
        "pulse_step_000000000400",  # routine beyond the newest 1
        "pulse_step_000000000100",
    ]
    kept = set(plan.runs[0].plan.keep)
    assert {"pulse_step_000000000500", "pulse_step_000000000300", "pulse_step_000000000200"} <= kept
    assert "heartbeat_step_000000000520" in kept
    # newest first, so a crash mid-way never strands a dependent
    steps = [int(d.checkpoint_id[-12:]) for d in plan.deletions]
    assert steps == sorted(steps, reverse=True)


def test_never_deletes_the_newest_valid_or_a_dependency(rec: Rec) -> None:
    records = [
        rec("full", 100, created_at=NOW - 300),
        rec("pulse", 200, created_at=NOW - 200, depends_on=("full_step_000000000100",)),
        rec("pulse", 300, created_at=NOW - 100),
    ]
    # a (hypothetically wrong) plan that deletes everything
    bad = RetentionPlan(
        keep={"pulse_step_000000000200": "x"},
        delete={r.id: "y" for r in records},
        deletion_order=tuple(r.id for r in reversed(records)),
    )
    allowed, refused = guard_deletions(records, bad)
    assert allowed == []
    assert set(refused) == {
        "pulse_step_000000000300",
        "pulse_step_000000000200",
        "full_step_000000000100",
    }
    assert "also keeps" in refused["pulse_step_000000000200"]
    assert "newest valid" in refused["pulse_step_000000000300"]
    assert "depends on it" in refused["full_step_000000000100"]


def test_unresolved_anomaly_pins_last_known_good(rec: Rec) -> None:
    records = [
        rec("pulse", 100, created_at=NOW - 400, score=0.1),
        rec("pulse", 200, created_at=NOW - 300, score=0.1),
        rec("pulse", 300, created_at=NOW - 200, score=0.1, anomaly="nan"),
        rec("pulse", 400, created_at=NOW - 100, score=0.1, anomaly="nan"),
    ]
    events = anomalies_from_records(records)
    assert [(e.step, e.kind, e.resolved_step) for e in events] == [
        (300, "nan", None),
        (400, "nan", None),
    ]
    plan = plan_policy_retention({"r": records}, RetentionSpec(), NOW)
    assert "pulse_step_000000000200" in plan.runs[0].plan.keep  # last known good before NaN
    # once a clean checkpoint follows, the anomaly counts as resolved
    records.append(rec("pulse", 500, created_at=NOW - 50, score=0.1))
    events = anomalies_from_records(records)
    assert [e.resolved_step for e in events] == [500, 500]


def test_status_counts_what_remains(rec: Rec) -> None:
    plan = plan_policy_retention({"run-a": run(rec), "run-b": []}, RetentionSpec(), NOW)
    done = [d for d in plan.deletions if d.checkpoint_id != "pulse_step_000000000100"]
    status = retention_status(
        plan,
        deleted=done,
        previous={"deletedByRetention": 7, "bytesDeletedByRetention": 10},
        jobs=3,
        now=NOW,
    )
    assert status["jobs"] == 3 and status["runs"] == 2
    assert status["deletedByRetention"] == 7 + len(done)
    assert status["bytesDeletedByRetention"] == 10 + sum(d.size_bytes for d in done)
    # 8 records, 3 deleted → 5 left, one of which (pulse 100) failed to delete: expired
    assert status["checkpoints"] == 5 and status["expiredCheckpoints"] == 1
    assert status["validCheckpoints"] == 4
    assert status["bytesStored"] == 100 * 4 + 1
    assert status["lastValid"]["run-a"] == {
        "step": 520,
        "tier": "heartbeat",
        "checkpointId": "heartbeat_step_000000000520",
        "time": "2024-05-02T11:38:40Z",
    }
    assert "run-b" not in status["lastValid"]
    assert status["lastRetentionTime"] == "2024-05-02T11:40:00Z"


def test_budget_deletions_respect_protections(rec: Rec) -> None:
    records = [rec("pulse", s, created_at=NOW - 1000 + s, size=10**9, score=0.6) for s in (1, 2, 3)]
    plan = plan_policy_retention({"r": records}, RetentionSpec(max_total_gb=1.5), NOW)
    deleted = {d.checkpoint_id for d in plan.deletions}
    assert "pulse_step_000000000003" not in deleted  # newest valid, always
    assert deleted == {"pulse_step_000000000001", "pulse_step_000000000002"}


# --------------------------------------------------------------------------- bounded passes


class Ticks:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_partial_run_deletes_only_its_corrupted_checkpoints(rec: Rec) -> None:
    full = plan_policy_retention({"run-a": run(rec)}, RetentionSpec(), NOW)
    cut = plan_policy_retention({"run-a": run(rec)}, RetentionSpec(), NOW, partial={"run-a"})
    assert len(full.deletions) > 1
    assert [d.checkpoint_id for d in cut.deletions] == ["pulse_step_000000000450"]
    assert cut.runs[0].partial and not full.runs[0].partial
    assert any("listed in part" in w for w in cut.warnings)


def test_a_partial_run_never_deletes_what_a_seen_checkpoint_depends_on(rec: Rec) -> None:
    records = [
        rec("pulse", 100, created_at=NOW - 200, status=CheckpointStatus.CORRUPTED),
        rec("pulse", 200, created_at=NOW - 100, depends_on=("pulse_step_000000000100",)),
    ]
    plan = plan_policy_retention({"r": records}, RetentionSpec(), NOW, partial={"r"})
    assert plan.deletions == ()


def test_batches_take_small_runs_first_one_run_per_batch_in_plan_order() -> None:
    def deletions(run_id: str, n: int) -> tuple[Deletion, ...]:
        return tuple(Deletion(run_id, f"c{i}", 1, "corrupted") for i in range(n))

    def run_of(run_id: str, n: int) -> RunRetention:
        return RunRetention(run_id, (), RetentionPlan(keep={}, delete={}), deletions(run_id, n))

    plan = PolicyRetentionPlan((run_of("a-garbage", 5), run_of("b", 2), run_of("c", 0)))
    batches = deletion_batches(plan, 2)
    assert [[(d.run_id, d.checkpoint_id) for d in b] for b in batches] == [
        [("b", "c0"), ("b", "c1")],
        [("a-garbage", "c0"), ("a-garbage", "c1")],
        [("a-garbage", "c2"), ("a-garbage", "c3")],
        [("a-garbage", "c4")],
    ]
    assert deletion_batches(PolicyRetentionPlan(()), 10) == []
    with pytest.raises(ValueError, match="batch size"):
        deletion_batches(plan, 0)


def test_manifest_refusal_names_the_manifest_the_limit_and_what_to_do() -> None:
    cap = 8 << 20
    assert manifest_refusal("r", None, cap) is None
    assert manifest_refusal("r", ("r/steps/x/rank_00000.json", cap), cap) is None
    why = manifest_refusal("r", ("r/steps/x/rank_00000.json", 24 << 20), cap)
    assert why is not None
    assert "r/steps/x/rank_00000.json is 24.0 MiB" in why and "8.0 MiB" in why
    assert "--gc-max-manifest-bytes" in why and "ckpt gc" in why


def test_budget_time_share_and_deadline() -> None:
    clock = Ticks(100.0)
    budget = PassBudget(10.0, None, clock=clock)
    assert budget.deadline == 110.0 and budget.remaining() == 10.0 and not budget.expired()
    # listings get LISTING_SHARE of the pass, split evenly among the runs left
    assert LISTING_SHARE == 0.5
    assert budget.listing_deadline(1) == 105.0
    assert budget.listing_deadline(5) == 101.0
    clock.now = 104.0
    assert budget.listing_deadline(2) == 104.5
    clock.now = 106.0  # past the listing part: a listing gets nothing more
    assert budget.listing_deadline(3) == 106.0
    clock.now = 110.0
    assert budget.expired() and budget.remaining() == 0.0


def test_budget_entries_are_shared_among_the_runs_left() -> None:
    budget = PassBudget(None, 1000, clock=Ticks())
    assert budget.entries_for(4) == 250
    budget.spend(250)  # the garbage run took its share
    assert budget.entries_for(3) == 250
    budget.spend(10)  # a small run left most of its share to the others
    assert budget.entries_for(2) == 370
    budget.spend(10_000)
    assert budget.entries_for(1) == 0


def test_an_unbounded_budget_never_expires_or_cuts() -> None:
    budget = PassBudget(clock=Ticks())
    assert budget.deadline is None and budget.listing_deadline(3) is None
    assert budget.entries_for(3) is None and budget.remaining() == math.inf
    assert not budget.expired() and not budget.cut_short


def test_budget_summary_says_what_was_done_what_is_left_and_which_flags() -> None:
    budget = PassBudget(60.0, 100_000, clock=Ticks())
    budget.cut("run r: listing stopped after 50,000 entries (out of time)")
    budget.cut("40 deletion(s) left for the next pass")
    assert budget.cut_short
    text = budget.summary(deleted=10, planned=50)
    assert text.startswith("pass cut short at its budget of 60 s (--retention-budget) and ")
    assert "100,000 listed entries (--retention-max-entries)" in text
    assert "10 of 50 planned deletion(s) done, the rest at the next pass" in text
    assert text.endswith("(out of time); 40 deletion(s) left for the next pass")


def test_status_keeps_the_last_valid_of_runs_not_listed_this_pass(rec: Rec) -> None:
    plan = plan_policy_retention({"run-a": run(rec)}, RetentionSpec(), NOW)
    previous = {
        "lastValid": {"run-b": {"step": 7, "tier": "full", "checkpointId": "full_step_7"}},
    }
    status = retention_status(
        plan, deleted=[], previous=previous, jobs=2, now=NOW, carried=["run-b", "run-c"]
    )
    assert status["lastValid"]["run-b"]["step"] == 7 and "run-c" not in status["lastValid"]
    assert "run-a" in status["lastValid"]
    dropped = retention_status(plan, deleted=[], previous=previous, jobs=1, now=NOW)
    assert "run-b" not in dropped["lastValid"]
