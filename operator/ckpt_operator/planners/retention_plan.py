"""Retention reconciliation: a policy's runs → storage deletions + policy status (pure).

The reconciler (``handlers.py``) lists the checkpoints of every run that
uses a policy, calls :func:`plan_policy_retention`, deletes
:attr:`PolicyRetentionPlan.deletions` in order through the checkpoint
source, and writes :func:`retention_status` into the policy's status.

The decisions are :func:`ckpt_agent.decide.retention.plan_retention`'s. This module
adds a second, independent guard (:func:`guard_deletions`): whatever the
plan says, the newest valid checkpoint of a run and anything a kept
checkpoint depends on are never deleted.

A pass is bounded (issue #28): :class:`PassBudget` keeps its time and the entries its
listings may examine; a run whose listing stopped at the bound is planned from what was
seen but only its corrupted checkpoints are deleted (``partial``);
:func:`deletion_batches` orders the deletions so that a run with few goes before one
with many; :func:`manifest_refusal` keeps the blob GC away from rank manifests too large
for the operator's memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.decide.retention import RetentionPlan, plan_retention
from ckpt_agent.policy import RetentionSpec
from ckpt_agent.records import AnomalyEvent, CheckpointRecord, CheckpointStatus
from ckpt_operator.model.jobs import format_time

__all__ = [
    "LISTING_SHARE",
    "Deletion",
    "PassBudget",
    "PolicyRetentionPlan",
    "RunRetention",
    "anomalies_from_records",
    "deletion_batches",
    "guard_deletions",
    "manifest_refusal",
    "plan_policy_retention",
    "retention_status",
]

LISTING_SHARE = 0.5
"""Share of a pass's time its listings may use: the rest is left for deleting, so a run
that holds more garbage than one pass can list still loses some of it every pass."""


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
    partial: bool = False
    """The listing stopped at the pass's bound: only corrupted checkpoints are deleted."""

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
            if run.partial:
                out.append(f"{run.run_id}: listed in part: only corrupted checkpoints deleted")
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
    runs: Mapping[str, Sequence[CheckpointRecord]],
    spec: RetentionSpec,
    now: float,
    *,
    partial: Collection[str] = (),
) -> PolicyRetentionPlan:
    """Plan retention for every run of a policy (runs in sorted order, deletions newest first).

    A run in ``partial`` was listed only in part (the pass's bound): what a full listing
    would keep cannot be known (a newer checkpoint may be unseen, a size budget would
    count the wrong ones), so of its plan only the deletions of corrupted checkpoints
    stand — they are garbage whatever else the run holds (nothing restores through an
    unreadable or failed checkpoint) — minus what the guard refuses (a seen checkpoint
    depends on it).
    """
    out: list[RunRetention] = []
    for run_id in sorted(runs):
        records = tuple(runs[run_id])
        plan = plan_retention(records, spec, anomalies_from_records(records), now)
        allowed, refused = guard_deletions(records, plan)
        by_id = {r.id: r for r in records}
        cut = run_id in partial
        deletions = tuple(
            Deletion(run_id, rid, by_id[rid].size_bytes if rid in by_id else 0, plan.delete[rid])
            for rid in allowed
            if rid in plan.delete
            and (not cut or (rid in by_id and by_id[rid].status == CheckpointStatus.CORRUPTED))
        )
        out.append(RunRetention(run_id, records, plan, deletions, refused, partial=cut))
    return PolicyRetentionPlan(tuple(out))


def deletion_batches(plan: PolicyRetentionPlan, size: int) -> list[tuple[Deletion, ...]]:
    """The plan's deletions in batches of at most ``size``, one run per batch, each run's
    in the plan's order (newest first); runs with fewer deletions first (ties: by id), so
    a pass cut short by its budget has finished the small runs and spent what was left on
    the large one, instead of one run's garbage starving the others every pass."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    runs = sorted((r for r in plan.runs if r.deletions), key=lambda r: (len(r.deletions), r.run_id))
    return [r.deletions[i : i + size] for r in runs for i in range(0, len(r.deletions), size)]


def manifest_refusal(run_id: str, largest: tuple[str, int] | None, cap: int) -> str | None:
    """Why the blob GC of ``run_id`` must not run (None: it may): its largest rank
    manifest (key, bytes, from the listing) is over ``cap``. The GC parses every rank
    manifest of the run whole; parsed JSON takes ~26x its size in memory (a 24 MiB
    manifest cost the operator +630 MB RSS)."""
    if largest is None or largest[1] <= cap:
        return None
    key, size = largest
    return (
        f"blob GC of run {run_id} skipped: rank manifest {key} is {size / 2**20:.1f} MiB, "
        f"over the operator's limit of {cap / 2**20:.1f} MiB (--gc-max-manifest-bytes; "
        "parsing it would take ~26x that in memory): collect this run's blobs with "
        "`ckpt gc` where memory allows, or raise the limit together with the operator's "
        "memory limit"
    )


@dataclass
class PassBudget:
    """Time and listing allowance of one policy's retention pass, and where it was cut.

    ``seconds`` from the pass's start (None: no time bound); ``max_entries`` keys its
    listings may examine in all (None: no bound). Listings get :data:`LISTING_SHARE` of
    the time, split evenly among the runs still to list (:meth:`listing_deadline`,
    :meth:`entries_for`); deleting stops at the deadline (:meth:`expired`). Only reads
    the clock: safe to consult from a worker thread.
    """

    seconds: float | None = None
    max_entries: int | None = None
    clock: Callable[[], float] = time.monotonic
    started: float = math.nan
    entries_used: int = 0
    cuts: list[str] = field(default_factory=list)
    """Why the pass did less than all of its work, one line each (empty: it did all)."""

    def __post_init__(self) -> None:
        if math.isnan(self.started):
            self.started = self.clock()

    @property
    def deadline(self) -> float | None:
        return None if self.seconds is None else self.started + self.seconds

    def remaining(self) -> float:
        d = self.deadline
        return math.inf if d is None else max(0.0, d - self.clock())

    def expired(self) -> bool:
        d = self.deadline
        return d is not None and self.clock() >= d

    def listing_deadline(self, runs_left: int) -> float | None:
        """When the next run's listing must stop: an even share, among ``runs_left`` runs,
        of what is left of the listing part of the pass."""
        if self.seconds is None:
            return None
        end = self.started + self.seconds * LISTING_SHARE
        now = self.clock()
        return now + max(0.0, end - now) / max(1, runs_left)

    def entries_for(self, runs_left: int) -> int | None:
        """Keys the next run's listing may examine: an even share of what is left."""
        if self.max_entries is None:
            return None
        return max(0, self.max_entries - self.entries_used) // max(1, runs_left)

    def spend(self, entries: int) -> None:
        self.entries_used += entries

    def cut(self, why: str) -> None:
        self.cuts.append(why)

    @property
    def cut_short(self) -> bool:
        return bool(self.cuts)

    def summary(self, *, deleted: int, planned: int) -> str:
        """One line for the status condition and the Event of a pass cut short."""
        limits = []
        if self.seconds is not None:
            limits.append(f"{self.seconds:g} s (--retention-budget)")
        if self.max_entries is not None:
            limits.append(f"{self.max_entries:,} listed entries (--retention-max-entries)")
        return (
            f"pass cut short at its budget of {' and '.join(limits) or 'nothing'}: "
            f"{deleted} of {planned} planned deletion(s) done, the rest at the next pass; "
            + "; ".join(self.cuts)
        )


def retention_status(
    plan: PolicyRetentionPlan,
    *,
    deleted: Iterable[Deletion],
    previous: Mapping[str, Any] | None,
    jobs: int,
    now: float,
    carried: Iterable[str] = (),
) -> dict[str, Any]:
    """Status fields (camelCase) after applying ``deleted`` (the deletions that succeeded).

    Counts describe what remains in storage: checkpoints whose deletion
    failed are still stored and counted as ``expiredCheckpoints`` (released by
    retention, to be retried on the next pass). Runs in ``carried`` were not listed this
    pass (its budget ran out first): their ``lastValid`` entry is the previous status's.
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
    before = prev.get("lastValid")
    if isinstance(before, Mapping):
        for run_id in carried:
            if run_id not in last_valid and isinstance(before.get(run_id), Mapping):
                last_valid[run_id] = dict(before[run_id])
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
