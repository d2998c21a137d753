"""Retention: which checkpoints to keep and which to delete (pure, no I/O).

:func:`plan_retention` takes catalog records and returns a :class:`RetentionPlan`
that puts **every** record in exactly one of ``keep`` or ``delete``, each with
the reason. The operator (and ``ckpt gc``) applies it; nothing here touches
storage.

Rules, in order of precedence:

1. **Protections** (nothing, not even a budget, removes these):

   * the newest valid checkpoint of every tier (Orbax #526: keeping "best"
     must never evict the newest, or the run becomes unresumable);
   * critical checkpoints (score ≥ ``critical_score``): kept forever;
   * *last known good*: for every anomaly that the run has not moved past
     (``resolved_step`` is None, or no valid weights checkpoint exists at or
     after it), the newest valid weights checkpoint (pulse/full) taken
     strictly before the anomaly step and not itself flagged;
   * pending checkpoints (still being validated: never touched);
   * everything the above depend on (``depends_on``, transitively).

2. **Class rules** for valid checkpoints, counted *per tier* (so a routine
   heartbeat never evicts the only routine pulse), newest first, protected
   ones using their slot too: important (score in
   [``important_score``, ``critical_score``)) keeps the newest
   ``important_keep``; routine keeps the newest ``routine_keep``. Heartbeats
   are a ring and usually routine, so normally only the newest survives. The
   class is ``record.retention_class`` when set, else :func:`classify` of the
   score.

3. **Dependencies**: a checkpoint that any kept checkpoint depends on is kept
   (whatever its status), with the dependent named in the reason.

4. **Budgets** (optional): ``max_age_hours`` drops unprotected class-rule
   keeps older than the limit; then ``max_total_gb`` (10⁹ bytes) drops the
   oldest unprotected keeps until the kept ``size_bytes`` fit. A checkpoint
   still needed by a kept one stays. When protections alone exceed the size
   budget, :attr:`RetentionPlan.over_budget_bytes` says by how much.

5. Corrupted checkpoints are deleted; expired ones (released earlier) are
   listed in ``delete`` again so that an interrupted deletion is retried.

"Newest" is by resume lineage, then step (:func:`_order_key`). Delete in
:attr:`RetentionPlan.deletion_order` (newest first): a crash half
way never leaves a surviving checkpoint whose dependency is already gone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ckpt_agent.policy.models import RetentionSpec
from ckpt_agent.records import AnomalyEvent, CheckpointRecord, CheckpointStatus, RetentionClass

__all__ = ["GB", "RetentionPlan", "classify", "effective_class", "plan_retention"]

GB = 1_000_000_000
"""Bytes per GB in ``max_total_gb``."""


def classify(score: float, spec: RetentionSpec | None = None) -> RetentionClass:
    """Retention class of a score: ≥ critical → critical, ≥ important → important, else routine."""
    spec = spec if spec is not None else RetentionSpec()
    if score >= spec.critical_score:
        return RetentionClass.CRITICAL
    if score >= spec.important_score:
        return RetentionClass.IMPORTANT
    return RetentionClass.ROUTINE


def effective_class(record: CheckpointRecord, spec: RetentionSpec | None = None) -> RetentionClass:
    """The class assigned at save time, or the one derived from the score."""
    if record.retention_class is not None:
        return record.retention_class
    return classify(record.score, spec)


@dataclass(frozen=True)
class RetentionPlan:
    """Result of :func:`plan_retention`: every record id is in exactly one of keep/delete."""

    keep: dict[str, str] = field(default_factory=dict)
    """Checkpoint id → why it is kept."""
    delete: dict[str, str] = field(default_factory=dict)
    """Checkpoint id → why it may be deleted."""
    deletion_order: tuple[str, ...] = ()
    """``delete`` ids, newest first (dependents before their dependencies)."""
    pinned: tuple[str, ...] = ()
    """Last-known-good checkpoints pinned by unresolved anomalies."""
    protected: tuple[str, ...] = ()
    """Ids no budget may remove (sorted)."""
    bytes_kept: int = 0
    """Sum of ``size_bytes`` over ``keep``."""
    bytes_freed: int = 0
    """Sum of ``size_bytes`` over ``delete``."""
    over_budget_bytes: int = 0
    """How far protected checkpoints alone exceed ``max_total_gb`` (0: within budget)."""
    warnings: tuple[str, ...] = ()
    """Inconsistencies found (missing dependencies, duplicate ids)."""


def _order_key(r: CheckpointRecord) -> tuple[int, int, float, str]:
    """Oldest to newest: by resume lineage first (a rewind's new lineage is newer than every
    step of the one it left, whatever their numbers), then step. Writers refuse a step
    that is not after the run's last (``StepOrderError``), so within a lineage step order
    is time order: a lower-numbered checkpoint never counts as older than it is."""
    return (r.lineage.epoch, r.step, r.created_at, r.id)


def _closure(roots: Iterable[str], by_id: dict[str, CheckpointRecord]) -> dict[str, str]:
    """Ids reachable through ``depends_on`` from ``roots`` (excluding roots) → first dependent."""
    out: dict[str, str] = {}
    stack = list(roots)
    seen = set(stack)
    while stack:
        cur = stack.pop()
        rec = by_id.get(cur)
        if rec is None:
            continue
        for dep in rec.depends_on:
            if dep not in seen and dep in by_id:
                seen.add(dep)
                out[dep] = cur
                stack.append(dep)
    return out


def plan_retention(
    records: Sequence[CheckpointRecord],
    spec: RetentionSpec | None = None,
    anomalies: Sequence[AnomalyEvent] = (),
    now: float | None = None,
) -> RetentionPlan:
    """Decide which checkpoints to keep (see the module docstring for the rules).

    ``now`` (Unix seconds) is only used by ``max_age_hours``; default: the
    newest ``created_at`` among the records.
    """
    spec = spec if spec is not None else RetentionSpec()
    warnings: list[str] = []
    by_id: dict[str, CheckpointRecord] = {}
    for r in records:
        if r.id in by_id:
            warnings.append(f"duplicate id {r.id}: the later record wins")
        by_id[r.id] = r
    for r in by_id.values():
        for dep in r.depends_on:
            if dep not in by_id:
                warnings.append(f"{r.id} depends on unknown {dep}")

    ordered = sorted(by_id.values(), key=_order_key, reverse=True)  # newest first
    valid = [r for r in ordered if r.status == CheckpointStatus.VALID]

    protected: dict[str, str] = {}  # id -> reason
    rule_keep: dict[str, str] = {}  # unprotected class-rule keeps
    delete: dict[str, str] = {}

    def protect(rid: str, why: str) -> None:
        protected[rid] = f"{protected[rid]}; {why}" if rid in protected else why

    # 1. protections
    for tier in sorted({r.tier for r in valid}, key=lambda t: t.value):
        newest = next(r for r in valid if r.tier == tier)
        protect(newest.id, f"newest valid {tier.value}")
    for r in ordered:
        if r.status == CheckpointStatus.PENDING:
            protect(r.id, "pending validation")
    for r in valid:
        if effective_class(r, spec) == RetentionClass.CRITICAL:
            protect(r.id, f"critical (score {r.score:.2f}): kept forever")
    pinned: list[str] = []
    newest_weights_step = max((r.step for r in valid if r.has_weights), default=None)
    for ev in sorted(anomalies, key=lambda e: e.step):
        moved_past = ev.resolved_step is not None and (
            newest_weights_step is not None and newest_weights_step >= ev.resolved_step
        )
        if moved_past:
            continue
        good = next(
            (r for r in valid if r.has_weights and r.step < ev.step and r.anomaly is None),
            None,
        )
        if good is None:
            warnings.append(f"no valid checkpoint before the {ev.kind} at step {ev.step}")
            continue
        protect(good.id, f"last known good before {ev.kind} at step {ev.step}")
        if good.id not in pinned:
            pinned.append(good.id)

    # 2. class rules per tier; 5. corrupted / expired
    counts: dict[tuple[str, RetentionClass], int] = {}
    for r in ordered:
        if r.id in protected:
            if r.status == CheckpointStatus.VALID:  # a protected one still uses its class slot
                key = (r.tier.value, effective_class(r, spec))
                counts[key] = counts.get(key, 0) + 1
            continue
        if r.status == CheckpointStatus.CORRUPTED:
            delete[r.id] = "corrupted"
            continue
        if r.status == CheckpointStatus.EXPIRED:
            delete[r.id] = "expired (released earlier)"
            continue
        cls = effective_class(r, spec)
        key = (r.tier.value, cls)
        limit = spec.important_keep if cls == RetentionClass.IMPORTANT else spec.routine_keep
        n = counts.get(key, 0)
        if n < limit:
            counts[key] = n + 1
            rule_keep[r.id] = f"{cls.value} {r.tier.value} #{n + 1} of {limit}"
        else:
            delete[r.id] = f"{cls.value} {r.tier.value} beyond the newest {limit}"

    # 3. dependencies of protected ones are protected too
    for dep, dependent in _closure(protected, by_id).items():
        if dep not in protected:
            protected[dep] = f"dependency of {dependent}"
            rule_keep.pop(dep, None)
            delete.pop(dep, None)

    def kept_now() -> dict[str, str]:
        roots = {**protected, **rule_keep}
        kept = dict(roots)
        for dep, dependent in _closure(roots, by_id).items():
            if dep not in kept:
                kept[dep] = f"dependency of {dependent}"
        return kept

    # 4. budgets: only unprotected class-rule keeps can go, oldest first
    budget_dropped: dict[str, str] = {}
    if spec.max_age_hours is not None:
        ref = now if now is not None else max((r.created_at for r in ordered), default=0.0)
        limit_s = spec.max_age_hours * 3600.0
        for rid in list(rule_keep):
            age = ref - by_id[rid].created_at
            if age > limit_s:
                del rule_keep[rid]
                budget_dropped[rid] = f"older than {spec.max_age_hours:g} h"
    over_budget = 0
    if spec.max_total_gb is not None:
        limit_b = int(spec.max_total_gb * GB)
        kept = kept_now()
        total = sum(by_id[i].size_bytes for i in kept)
        for rid in sorted(rule_keep, key=lambda i: _order_key(by_id[i])):
            if total <= limit_b:
                break
            del rule_keep[rid]
            budget_dropped[rid] = f"over the {spec.max_total_gb:g} GB budget (oldest first)"
            kept = kept_now()
            total = sum(by_id[i].size_bytes for i in kept)
        over_budget = max(0, total - limit_b)

    keep = kept_now()
    for rid, why in budget_dropped.items():
        if rid not in keep:
            delete[rid] = why
    for rid in keep:
        delete.pop(rid, None)
    # anything a kept checkpoint depends on that was marked for deletion stays
    for rid in by_id:
        if rid not in keep and rid not in delete:  # pragma: no cover - defensive
            delete[rid] = "not selected by any rule"

    deletion_order = tuple(
        r.id for r in sorted((by_id[i] for i in delete), key=_order_key, reverse=True)
    )
    prot_all = set(protected)
    return RetentionPlan(
        keep=keep,
        delete=delete,
        deletion_order=deletion_order,
        pinned=tuple(pinned),
        protected=tuple(sorted(prot_all)),
        bytes_kept=sum(by_id[i].size_bytes for i in keep),
        bytes_freed=sum(by_id[i].size_bytes for i in delete),
        over_budget_bytes=over_budget,
        warnings=tuple(warnings),
    )
