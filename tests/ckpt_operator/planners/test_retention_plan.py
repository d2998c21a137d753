"""Retention reconciliation: plans per run, the safety guard, and the policy status."""

from __future__ import annotations

from collections.abc import Callable

from ckpt_agent.decide.retention import RetentionPlan
from ckpt_agent.policy import RetentionSpec
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_operator.planners.retention_plan import (
    anomalies_from_records,
    guard_deletions,
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
