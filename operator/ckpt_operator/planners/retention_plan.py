"""Retention reconciliation: a policy's runs → storage deletions + policy status (pure).

The reconciler (``handlers.py``) lists the checkpoints of every run that
uses a policy, calls :func:`plan_policy_retention`, deletes
:attr:`PolicyRetentionPlan.deletions` in order through the checkpoint
source, and writes :func:`retention_status` into the policy's status.

The decisions are :func:`ckpt_agent.decide.retention.plan_retention`'s. This module
adds a second, independent guard (:func:`guard_deletions`): whatever the
plan says, the newest valid checkpoint of a run and anything a kept
checkpoint depends on are never deleted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.decide.retention import RetentionPlan, plan_retention
from ckpt_agent.policy import RetentionSpec
from ckpt_agent.records import AnomalyEvent, CheckpointRecord, CheckpointStatus
from ckpt_operator.model.jobs import format_time

__all__ = [
    "Deletion",
    "PolicyRetentionPlan",
    "RunRetention",
    "anomalies_from_records",
    "guard_deletions",
    "plan_policy_retention",
    "retention_status",
]


@dataclass(frozen=True)
class Deletion:
    """One checkpoint to delete from storage."""

    run_id: str
    checkpoint_id: str
    size_bytes: int
    reason: str


@dataclass(frozen=True)
class RunRetention:
    """The plan for one run."""

    run_id: str
    records: tuple[CheckpointRecord, ...]
    plan: RetentionPlan
    deletions: tuple[Deletion, ...]
    refused: Mapping[str, str] = field(default_factory=dict)
    """Deletions the guard refused (id → why); these are logged as warnings."""

    @property
    def newest_valid(self) -> CheckpointRecord | None:
        valid = [r for r in self.records if r.status == CheckpointStatus.VALID]
        return max(valid, key=lambda r: (r.step, r.created_at, r.id), default=None)


@dataclass(frozen=True)
class PolicyRetentionPlan:
    """The plans of every run of one policy."""

    runs: tuple[RunRetention, ...]

    @property
    def deletions(self) -> tuple[Deletion, ...]:
        return tuple(d for run in self.runs for d in run.deletions)

    @property
    def warnings(self) -> tuple[str, ...]:
        out: list[str] = []
        for run in self.runs:
            out += [f"{run.run_id}: {w}" for w in run.plan.warnings]
            out += [f"{run.run_id}: refused to delete {k}: {v}" for k, v in run.refused.items()]
        return tuple(out)


def anomalies_from_records(records: Sequence[CheckpointRecord]) -> list[AnomalyEvent]:
    """Anomalies as the manifests record them (the operator has no decision log).

    An anomaly at step ``s`` counts as resolved at the first later valid
    weights checkpoint that is not itself flagged; until then retention pins
    the last known good checkpoint before it.
    """
    ordered = sorted(records, key=lambda r: (r.step, r.created_at))
    out: list[AnomalyEvent] = []
    for i, rec in enumerate(ordered):
        if rec.anomaly is None:
            continue
        resolved = next(
            (
                r.step
                for r in ordered[i + 1 :]
                if r.step > rec.step
                and r.anomaly is None
                and r.has_weights
                and r.status == CheckpointStatus.VALID
            ),
            None,
        )
        out.append(AnomalyEvent(step=rec.step, kind=rec.anomaly, resolved_step=resolved))
    return out


def guard_deletions(
    records: Sequence[CheckpointRecord], plan: RetentionPlan
) -> tuple[list[str], dict[str, str]]:
    """The plan's deletion order minus anything that must survive; returns (ids, refused)."""
    by_id = {r.id: r for r in records}
    must_keep: dict[str, str] = {}
    valid = [r for r in records if r.status == CheckpointStatus.VALID]
    if valid:
        newest = max(valid, key=lambda r: (r.step, r.created_at, r.id))
        must_keep[newest.id] = "newest valid checkpoint of the run"
    for rid in plan.keep:
        must_keep.setdefault(rid, "the plan also keeps it")
    # Transitive dependencies of every kept checkpoint.
    stack = [rid for rid in plan.keep if rid in by_id]
    seen = set(stack)
    while stack:
        cur = by_id.get(stack.pop())
        if cur is None:
            continue
        for dep in cur.depends_on:
            if dep not in seen:
                seen.add(dep)
                must_keep.setdefault(dep, f"a kept checkpoint ({cur.id}) depends on it")
                stack.append(dep)
    order = list(plan.deletion_order) or sorted(plan.delete)
    allowed = [rid for rid in order if rid not in must_keep]
    refused = {rid: must_keep[rid] for rid in order if rid in must_keep}
    return allowed, refused


def plan_policy_retention(
    runs: Mapping[str, Sequence[CheckpointRecord]], spec: RetentionSpec, now: float
) -> PolicyRetentionPlan:
    """Plan retention for every run of a policy (runs in sorted order, deletions newest first)."""
    out: list[RunRetention] = []
    for run_id in sorted(runs):
        records = tuple(runs[run_id])
        plan = plan_retention(records, spec, anomalies_from_records(records), now)
        allowed, refused = guard_deletions(records, plan)
        by_id = {r.id: r for r in records}
        deletions = tuple(
            Deletion(run_id, rid, by_id[rid].size_bytes if rid in by_id else 0, plan.delete[rid])
            for rid in allowed
            if rid in plan.delete
        )
        out.append(RunRetention(run_id, records, plan, deletions, refused))
    return PolicyRetentionPlan(tuple(out))


def retention_status(
    plan: PolicyRetentionPlan,
    *,
    deleted: Iterable[Deletion],
    previous: Mapping[str, Any] | None,
    jobs: int,
    now: float,
) -> dict[str, Any]:
    """Status fields (camelCase) after applying ``deleted`` (the deletions that succeeded).

    Counts describe what remains in storage: checkpoints whose deletion
    failed are still stored and counted as ``expiredCheckpoints`` (released by
    retention, to be retried on the next pass).
    """
    done = {(d.run_id, d.checkpoint_id) for d in deleted}
    prev = previous or {}
    checkpoints = valid = stored = expired = 0
    last_valid: dict[str, dict[str, Any]] = {}
    for run in plan.runs:
        planned = {d.checkpoint_id for d in run.deletions}
        for rec in run.records:
            if (run.run_id, rec.id) in done:
                continue
            checkpoints += 1
            stored += rec.size_bytes
            if rec.id in planned or rec.status == CheckpointStatus.EXPIRED:
                expired += 1
            elif rec.status == CheckpointStatus.VALID:
                valid += 1
        newest = run.newest_valid
        if newest is not None:
            entry: dict[str, Any] = {
                "step": newest.step,
                "tier": newest.tier.value,
                "checkpointId": newest.id,
            }
            if newest.created_at > 0:
                entry["time"] = format_time(newest.created_at)
            last_valid[run.run_id] = entry
    n_deleted = len(done)
    bytes_deleted = sum(
        d.size_bytes
        for run in plan.runs
        for d in run.deletions
        if (d.run_id, d.checkpoint_id) in done
    )
    return {
        "jobs": jobs,
        "runs": len(plan.runs),
        "checkpoints": checkpoints,
        "validCheckpoints": valid,
        "expiredCheckpoints": expired,
        "bytesStored": stored,
        "deletedByRetention": int(prev.get("deletedByRetention") or 0) + n_deleted,
        "bytesDeletedByRetention": int(prev.get("bytesDeletedByRetention") or 0) + bytes_deleted,
        "lastValid": last_valid,
        "lastRetentionTime": format_time(now),
    }
