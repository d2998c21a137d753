"""The four plans side by side (#31): cadences, the plans, the comparison and its table."""

from __future__ import annotations

import math

import pytest

from ckpt_agent.decide.fault_traces import NODE, ONE, PROCESS, Fault, FaultTrace, llama3_trace
from ckpt_agent.decide.memory_benchmark import (
    FIXED_EVERY,
    compare_tiers,
    costs_line,
    memory_every,
    scheduler_interval,
    tier_plans,
    tier_table,
    uncovered_share,
)
from ckpt_agent.decide.sim_memory import JIT, PEER, STORAGE, TierCosts
from ckpt_agent.decide.traces import LLAMA3_MTBF_S
from ckpt_agent.policy.models import TiersSpec

TRACE = llama3_trace(days=7, seed=0)


@pytest.mark.parametrize("mtbf", [3000.0, LLAMA3_MTBF_S])
def test_todays_interval_is_the_real_schedulers_young_daly(mtbf: float) -> None:
    c = TierCosts()
    # the scheduler's save cost is stall + persist (decide.simulate.Costs.delta)
    young_daly = math.sqrt(2 * (c.stall + c.persist) * mtbf) / c.step_time
    assert abs(scheduler_interval(mtbf, c) - young_daly) <= 2


def test_todays_interval_grows_with_the_mtbf_up_to_the_policys_bounds() -> None:
    c = TierCosts()
    got = [scheduler_interval(m, c) for m in (1_000.0, 3_000.0, LLAMA3_MTBF_S, 1e9)]
    assert got == sorted(got) and got[0] < got[-1]
    assert got[-1] <= TiersSpec().full.every_steps


def test_memory_cadence_young_daly_stall_budget_and_bandwidth() -> None:
    c = TierCosts(memory_stall=0.2, state_gib=0.0)
    assert memory_every(c, 1, 10_000.0) == math.floor(math.sqrt(2 * 0.2 * 10_000) / 2)  # 31
    # a tiny MTBF: the 3 % stall budget bounds it (0.2 s / (0.03 × 2 s) -> 4 steps)
    assert memory_every(c, 1, 1.0) == 4
    assert memory_every(c, 1, 1.0, stall_budget=0.5) == 1
    # replication slower than the snapshots: no faster than one replica at a time
    slow = TierCosts(memory_stall=0.0, state_gib=20.0, replica_gbps=1.0)
    assert memory_every(slow, 1, 1.0) == math.ceil(slow.replicate_s(1) / 2)
    assert memory_every(slow, 2, 1.0) == math.ceil(slow.replicate_s(2) / 2)
    assert memory_every(slow, 0, 1.0) == 1


def test_uncovered_share_counts_node_losses_whose_peers_are_lost() -> None:
    faults = (
        Fault(1.0, "a", NODE, ONE, 0.5, 0.1),
        Fault(2.0, "b", NODE, ONE, 0.1, 0.1),
        Fault(3.0, "c", PROCESS, ONE, 0.0, 0.1),
        Fault(4.0, "d", NODE, ONE, 1.0, 0.1),
    )
    trace = FaultTrace("t", 10.0, faults)
    assert uncovered_share(trace, 1) == pytest.approx((0.5 + 0.1 + 1.0) / 4)
    assert uncovered_share(trace, 2) == pytest.approx((0.25 + 0.01 + 1.0) / 4)
    assert uncovered_share(trace, 0) == pytest.approx(3 / 4)
    assert uncovered_share(FaultTrace("e", 1.0, ()), 1) == 0.0


def test_the_plans() -> None:
    c = TierCosts()
    plans = tier_plans(TRACE, c)
    assert [p.name for p in plans] == [
        "fixed, storage only",
        "today's tiers",
        "memory tier + replicas",
        "memory tier + replicas + JIT",
    ]
    fixed, today, mem, jit = plans
    assert (fixed.storage_every, fixed.in_memory, fixed.full_every) == (FIXED_EVERY, False, None)
    assert today.local_memory and today.memory_every is None and today.replicas == 0
    assert today.storage_every == scheduler_interval(TRACE.mtbf, c)
    # storage persists less often once memory covers most failures
    assert mem.storage_every > today.storage_every
    assert mem.memory_every == memory_every(c, 1, TRACE.mtbf) and mem.replicas == 1
    assert jit.jit and not mem.jit and jit.memory_every == mem.memory_every
    assert len(tier_plans(TRACE, c, jit=False)) == 3
    set_by_hand = tier_plans(TRACE, c, memory_every_steps=3, replicas=2, fixed_every=50)
    assert (set_by_hand[0].storage_every, set_by_hand[2].memory_every) == (50, 3)
    assert set_by_hand[2].replicas == 2
    assert tier_plans(TRACE, c, replicas=0)[2].name == "memory tier, no replica"


def test_the_comparison_ranks_the_plans_as_the_model_says() -> None:
    c = TierCosts()
    cmp = compare_tiers(TRACE, c, tier_plans(TRACE, c))
    fixed, today, mem, jit = cmp.results
    assert set(fixed.by_source()) >= {STORAGE} and fixed.by_source()[STORAGE] == len(TRACE.faults)
    assert mem.by_source()[PEER] > 0 and jit.by_source()[JIT] > 0
    per_failure = [r.lost_s / len(r.recoveries) for r in cmp.results]
    assert per_failure[3] < per_failure[2] < min(per_failure[0], per_failure[1])
    assert jit.goodput > today.goodput and mem.goodput > today.goodput
    assert all(r.lost_s <= c.step_time for r in jit.recoveries if r.fault.jit_possible)


def test_the_table() -> None:
    c = TierCosts()
    plans = tier_plans(TRACE, c)
    lines = tier_table(compare_tiers(TRACE, c, plans))
    assert lines[0].startswith(f"**{TRACE.name}**: {len(TRACE.faults)} failures")
    rows = [line for line in lines if line.startswith("| ") and "%" in line]
    assert [r.split(" | ")[0][2:] for r in rows] == [p.name for p in plans]
    assert all(len(r.split("|")) == 13 for r in rows)
    assert any("max lost steps, JIT possible" in line for line in lines)
    assert "state 10 GiB per node" in costs_line(c, 1)
