"""Storage only, today's tiers, memory tier + replicas (+ JIT) side by side (pure, #31).

:func:`compare_tiers` replays one
:class:`~ckpt_agent.decide.fault_traces.FaultTrace` through four
:class:`~ckpt_agent.decide.sim_memory.Plan` s
(:func:`~ckpt_agent.decide.sim_memory.replay_tiers`):

* ``fixed, storage only``: a save to storage every ``fixed_every`` steps, nothing in
  memory: every failure restores from storage;
* ``today's tiers``: the real scheduler's pulse interval for the trace's MTBF
  (:func:`scheduler_interval`: the default policy with ``risk.mtbfSeconds`` set to
  it) and its full tier; every save lands in node memory first, so a process crash
  resumes from memory, a node loss from storage;
* ``memory tier + replicas``: today's saves, plus a memory-tier snapshot every m
  steps (:func:`memory_every`) replicated to k peers; storage is saved at the
  scheduler's interval for the MTBF of the failures memory does not cover (a node
  loss whose peers are lost too: :func:`uncovered_share`), so less often;
* ``memory tier + replicas + JIT``: the same with just-in-time saves from the
  surviving replicas.

:func:`tier_table` prints goodput, lost work per failure (mean and p99, in steps
and seconds) and recovery time (mean and p99) per plan as a markdown table.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ckpt_agent.decide.fault_traces import NODE, FaultTrace
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.sim_memory import (
    SOURCES,
    Plan,
    TierCosts,
    TierResult,
    percentile,
    replay_tiers,
)
from ckpt_agent.decide.sim_policies import SAVE, SchedulerPolicy
from ckpt_agent.decide.traces import training_curves
from ckpt_agent.policy.models import Tier, TiersSpec
from ckpt_agent.policy.scheduler_models import RiskSpec, SchedulerSpec

__all__ = [
    "FIXED_EVERY",
    "TierComparison",
    "compare_tiers",
    "memory_every",
    "scheduler_interval",
    "tier_plans",
    "tier_table",
    "uncovered_share",
]

FIXED_EVERY = 100
"""The storage-only baseline's interval: the policy's base pulse interval (steps)."""

_WARMUP_STEPS = 3_000
"""Steps the real scheduler runs to settle its pulse interval (three full periods)."""


def scheduler_interval(mtbf: float, costs: TierCosts) -> int:
    """The pulse interval (steps) the real scheduler settles on with the default policy,
    ``risk.mtbfSeconds = mtbf`` and these save costs, no warnings: read off its
    decisions over :data:`_WARMUP_STEPS` steps (the steps from the save before the last
    pulse to it; a full resets the count, as :func:`~ckpt_agent.decide.sim_policies.full_now`
    replays)."""
    spec = SchedulerSpec(risk=RiskSpec(mtbf_seconds=max(mtbf, 1.0)))
    policy = SchedulerPolicy("today", lambda: AdaptiveScheduler(spec, start_time=0.0))
    curves = training_curves(_WARMUP_STEPS + 1, seed=0)
    now, saves = 0.0, [(0, Tier.FULL)]
    for step in range(1, _WARMUP_STEPS + 1):
        now += costs.step_time
        what = policy.decide(step, now, curves.loss[step], curves.grad[step], None)
        if what is None:
            continue
        stall = costs.stall if what == SAVE else costs.stall / 2
        policy.taken(stall, costs.persist)
        now += stall
        last = policy.last
        if what == SAVE and last is not None and last.tier is not None:
            saves.append((step, last.tier))
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(saves) if b[1] == Tier.PULSE]
    return max(1, gaps[-1]) if gaps else TiersSpec().full.every_steps


def memory_every(
    costs: TierCosts, replicas: int, mtbf: float, stall_budget: float | None = None
) -> int:
    """The memory tier's cadence (steps): Young/Daly's ``√(2·δ·M)`` for its own cost (δ: the
    snapshot stall) and the trace's MTBF, but no shorter than the stall budget allows
    (``risk.stallBudget``, default 3 %) nor than a snapshot takes to replicate to
    ``replicas`` peers."""
    budget = RiskSpec().stall_budget if stall_budget is None else stall_budget
    st = costs.step_time
    young_daly = math.floor(math.sqrt(2.0 * costs.memory_stall * max(mtbf, 0.0)) / st)
    by_stall = math.ceil(costs.memory_stall / (budget * st) - 1e-9)
    by_bandwidth = math.ceil(costs.replicate_s(replicas) / st - 1e-9) if replicas > 0 else 1
    return max(1, young_daly, by_stall, by_bandwidth)


def uncovered_share(trace: FaultTrace, replicas: int) -> float:
    """Expected share of the failures neither node memory nor a replica covers: node
    losses whose ``replicas`` peers are all lost too."""
    if not trace.faults:
        return 0.0
    lost = sum(f.peer_q**replicas if replicas > 0 else 1.0 for f in trace.faults if f.kind == NODE)
    return lost / len(trace.faults)


def tier_plans(
    trace: FaultTrace,
    costs: TierCosts,
    *,
    fixed_every: int = FIXED_EVERY,
    memory_every_steps: int | None = None,
    replicas: int = 1,
    jit: bool = True,
) -> list[Plan]:
    """The plans of the module docstring (without the JIT row when ``jit`` is False)."""
    full = TiersSpec().full.every_steps
    today = scheduler_interval(trace.mtbf, costs)
    m = (
        memory_every_steps
        if memory_every_steps is not None
        else memory_every(costs, replicas, trace.mtbf)
    )
    uncovered = max(uncovered_share(trace, replicas), 1e-3)
    storage = scheduler_interval(trace.mtbf / uncovered, costs)
    memory = Plan(
        "memory tier + replicas" if replicas > 0 else "memory tier, no replica",
        storage,
        full,
        local_memory=True,
        memory_every=m,
        replicas=replicas,
    )
    plans = [
        Plan("fixed, storage only", fixed_every),
        Plan("today's tiers", today, full, local_memory=True),
        memory,
    ]
    if jit:
        plans.append(Plan(f"{memory.name} + JIT", storage, full, True, m, replicas, jit=True))
    return plans


@dataclass(frozen=True)
class TierComparison:
    """Every plan on one trace."""

    trace: FaultTrace
    costs: TierCosts
    plans: tuple[Plan, ...]
    results: tuple[TierResult, ...]


def compare_tiers(trace: FaultTrace, costs: TierCosts, plans: list[Plan]) -> TierComparison:
    """Replay ``trace`` through every plan."""
    results = tuple(replay_tiers(trace, p, costs) for p in plans)
    return TierComparison(trace, costs, tuple(plans), results)


def _stats(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values) if values else math.nan
    return mean, percentile(values, 99.0)


def tier_table(cmp: TierComparison) -> list[str]:
    """The comparison as a markdown table, with a heading line and the sources."""
    t, c = cmp.trace, cmp.costs
    kinds = {k: sum(f.kind == k for f in t.faults) for k in ("process", "node")}
    jit_ok = sum(f.jit_possible for f in t.faults)
    lines = [
        f"**{t.name}**: {len(t.faults)} failures in {t.horizon / 86_400:,.1f} days "
        f"(MTBF {t.mtbf:,.0f} s): {kinds['process']} process crashes, {kinds['node']} node "
        f"losses; {jit_ok} with surviving replicas (JIT possible)",
        "",
        "| plan | storage every | memory every | stall s | goodput | lost/failure steps "
        "mean | p99 | lost s mean | p99 | recovery s mean | p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for plan, r in zip(cmp.plans, cmp.results, strict=True):
        lost_mean, lost_p99 = _stats([x.lost_s for x in r.recoveries])
        rec_mean, rec_p99 = _stats([x.recovery_s for x in r.recoveries])
        full = f" (full {plan.full_every})" if plan.full_every else ""
        mem = f"{plan.memory_every}" if plan.memory_every else "—"
        lines.append(
            f"| {plan.name} | {plan.storage_every}{full} | {mem} | {r.stall_s:,.0f} | "
            f"{r.goodput:.2%} | {lost_mean / c.step_time:,.1f} | {lost_p99 / c.step_time:,.1f} | "
            f"{lost_mean:,.1f} | {lost_p99:,.1f} | {rec_mean:,.1f} | {rec_p99:,.1f} |"
        )
    lines += ["", "Restored from (failures), and the most steps lost where JIT was possible:", ""]
    lines.append("| plan | " + " | ".join(SOURCES) + " | max lost steps, JIT possible |")
    lines.append("|---|" + "---:|" * (len(SOURCES) + 1))
    for r in cmp.results:
        counts = r.by_source()
        jit_lost = [x.lost_s / c.step_time for x in r.recoveries if x.fault.jit_possible]
        worst = f"{max(jit_lost):,.1f}" if jit_lost else "—"
        cells = " | ".join(str(counts[s]) for s in SOURCES)
        lines.append(f"| {r.plan} | {cells} | {worst} |")
    return lines


def costs_line(c: TierCosts, replicas: int) -> str:
    """The model's parameters in one line."""
    return (
        f"step {c.step_time:g} s; storage save: stall {c.stall:g} s, durable {c.persist:g} s "
        f"later; memory snapshot stall {c.memory_stall:g} s; state {c.state_gib:g} GiB per "
        f"node, replicated to {replicas} peer(s) at {c.replica_gbps:g} GB/s "
        f"({c.replicate_s(replicas):.1f} s each); recovery = restart {c.restart:g} s + read at "
        f"{c.local_read_gbps:g} (local) / {c.peer_read_gbps:g} (peer) / "
        f"{c.storage_read_gbps:g} (storage) GB/s"
    )
