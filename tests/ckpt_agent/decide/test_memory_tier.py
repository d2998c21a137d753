"""The memory tier in the scheduler (#31): when a memory-only snapshot is due, its interval,
and that it never moves the durable tiers."""

from __future__ import annotations

import math

import pytest
from decide_builders import feed, make, memory_at, pulse_at

from ckpt_agent.decide.decision import Decision, SaveOutcome, merge_decisions
from ckpt_agent.decide.intervals import MEMORY_RULES, CostModel, memory_interval
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.policy.models import (
    CheckpointPolicySpec,
    FullTierSpec,
    HeartbeatTierSpec,
    MemoryTierSpec,
    PulseTierSpec,
    Tier,
)
from ckpt_agent.policy.scheduler_models import RiskSpec, SchedulerSpec

FIXED_PULSE = PulseTierSpec(base_interval=50, min_interval=50, max_interval=50)


def _no_risk(memory: MemoryTierSpec) -> AdaptiveScheduler:
    return make(
        risk=RiskSpec(enabled=False),
        pulse=FIXED_PULSE,
        heartbeat=HeartbeatTierSpec(enabled=False),
        full=FullTierSpec(every_steps=10_000),
        memory=memory,
    )


def _memory_steps(ds: list[Decision]) -> list[int]:
    return [d.step for d in ds if d.memory]


def test_off_by_default_no_memory_decision() -> None:
    s = make(heartbeat=HeartbeatTierSpec(enabled=False))
    ds = feed(s, [1.0] * 200)
    assert not any(d.memory for d in ds)
    assert {d.memory_interval for d in ds} == {0}
    assert s.memory_interval() == (0, "off")


def test_fixed_interval_between_pulses_never_durable() -> None:
    s = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=7))
    ds = feed(s, [1.0] * 101)
    pulses = [d.step for d in ds if d.tier == Tier.PULSE]
    assert pulses == [50, 100]
    # from step 0: 7, 14, ..., 49; the pulse at 50 resets it: 57, ..., 99
    assert _memory_steps(ds) == [*range(7, 50, 7), *range(57, 100, 7)]
    for d in ds:
        if d.memory:
            assert d.memory_only and d.snapshot_tier == Tier.PULSE
            assert not d.save and d.tier is None  # nothing durable is due
            assert d.memory_interval == 7
            assert "memory: " in d.reason
    assert all(not d.memory for d in ds if d.tier == Tier.PULSE)  # the pulse covers it


def test_memory_with_a_heartbeat_due_keeps_the_heartbeat() -> None:
    s = make(
        risk=RiskSpec(enabled=False),
        pulse=FIXED_PULSE,
        heartbeat=HeartbeatTierSpec(every_steps=1),
        full=FullTierSpec(every_steps=10_000),
        memory=MemoryTierSpec(enabled=True, every_steps=5),
    )
    d = feed(s, [1.0] * 6)[5]
    assert d.memory and d.tier == Tier.HEARTBEAT and d.save
    assert d.memory_only and d.snapshot_tier == Tier.PULSE


def test_deferred_is_due_at_the_next_step_then_counts_from_the_one_taken() -> None:
    s = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=5))
    ds = feed(s, [1.0] * 6)
    assert _memory_steps(ds) == [5]
    s.settle(SaveOutcome.deferred(ds[5]))  # no free slot
    d6, d7 = feed(s, [1.0, 1.0], start=6)
    assert d6.memory and "retry after no free slot" in d6.reason
    assert not d7.memory  # adopted optimistically at 6
    s.settle(SaveOutcome.taken(d6, stall_seconds=0.01))
    later = feed(s, [1.0] * 10, start=8)
    assert _memory_steps(later) == [11, 16]


def test_a_memory_snapshot_moves_no_durable_counter() -> None:
    s = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=3))
    ds = feed(s, [1.0] * 51)
    for d in ds:
        if d.memory:
            s.settle(SaveOutcome.taken(d, stall_seconds=0.001))
    assert [d.step for d in ds if d.tier == Tier.PULSE] == [50]  # not delayed
    state = s.state_dict()
    assert state["last_pulse"] == 50 and state["last_memory"] == 50


def test_a_failed_pulse_stays_due_after_a_memory_snapshot() -> None:
    s = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=2))
    feed(s, [1.0] * 51)
    s.settle(SaveOutcome.failed(Tier.PULSE))
    d51 = feed(s, [1.0], start=51)[0]
    assert d51.tier == Tier.PULSE and not d51.memory


def test_a_lightweight_pulse_is_no_memory_snapshot() -> None:
    s = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=4))
    feed(s, [1.0] * 3)
    s.adopt(pulse_at(3, lightweight=True))
    assert feed(s, [1.0], start=4)[0].memory


def test_not_on_a_non_finite_loss() -> None:
    s = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=2))
    ds = feed(s, [1.0, 1.0, math.nan, math.nan, 1.0])
    assert _memory_steps(ds) == [4]


def test_memory_off_stops_it() -> None:
    s = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=2))
    s.memory_off()
    assert not any(d.memory for d in feed(s, [1.0] * 20))
    assert s.memory_interval() == (0, "off")


def test_rewind_keeps_no_counter_in_the_future() -> None:
    s = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=5))
    feed(s, [1.0] * 40)
    ds = feed(s, [1.0] * 6, start=20)  # resumed from step 20
    assert _memory_steps(ds) == [25]


def test_state_round_trip_keeps_the_memory_counter() -> None:
    a = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=5))
    feed(a, [1.0] * 8)
    a.settle(SaveOutcome.deferred(memory_at(7)))
    b = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=5))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert feed(b, [1.0], start=8)[0].memory  # the retry survived
    old = {k: v for k, v in a.state_dict().items() if k not in ("last_memory", "memory_retry")}
    c = _no_risk(memory=MemoryTierSpec(enabled=True, every_steps=5))
    c.load_state_dict({k: v for k, v in old.items() if k != "memory_cost"})  # before the tier
    assert c.state_dict()["last_memory"] is None


# --------------------------------------------------------------------------- interval


def _model(step_time: float | None, stall: float | None, mtbf: float = 3600.0) -> CostModel:
    m = CostModel(mtbf)
    if step_time is not None:
        m.record_step_time(step_time)
    m.memory.add(stall, None)
    return m


SPEC = SchedulerSpec()  # risk on, stall budget 3 %
TIER = MemoryTierSpec(enabled=True, base_interval=10, min_interval=2, max_interval=400)


@pytest.mark.parametrize(
    ("tier", "spec", "model", "hazard", "expected"),
    [
        (MemoryTierSpec(enabled=True, every_steps=3), SPEC, _model(1.0, 5.0), 1.0, (3, "fixed")),
        (TIER, SPEC, _model(None, None), 1.0, (10, "base")),  # nothing measured
        (TIER, SPEC, _model(1.0, None), 1.0, (10, "base")),  # no stall measured
        # √(2 · 0.05 · 3600) = 18.97 s at 1 s per step
        (TIER, SPEC, _model(1.0, 0.05), 1.0, (18, "young_daly")),
        # a warning quadruples the hazard: half the interval
        (TIER, SPEC, _model(1.0, 0.05), 4.0, (9, "warning")),
        # 0.5 s of stall: Young/Daly says 60 steps, the 3 % budget 17 (not binding)...
        (TIER, SPEC, _model(1.0, 0.5), 1.0, (60, "young_daly")),
        # ...but with a short MTBF the budget wins: √(2·0.5·10)=3 < ⌈0.5/0.03⌉ = 17
        (TIER, SPEC, _model(1.0, 0.5, mtbf=10.0), 1.0, (17, "stall_budget")),
        (TIER, SPEC, _model(1.0, 0.0001, mtbf=10.0), 1.0, (2, "min")),
        (TIER, SPEC, _model(0.01, 0.5), 1.0, (400, "max")),
        # without risk: the base interval, clamped
        (TIER, SchedulerSpec(risk=RiskSpec(enabled=False)), _model(1.0, 0.05), 1.0, (10, "base")),
        (
            MemoryTierSpec(enabled=True, base_interval=1, min_interval=3),
            SchedulerSpec(risk=RiskSpec(enabled=False)),
            _model(1.0, 0.05),
            1.0,
            (3, "min"),
        ),
    ],
)
def test_memory_interval_table(
    tier: MemoryTierSpec,
    spec: SchedulerSpec,
    model: CostModel,
    hazard: float,
    expected: tuple[int, str],
) -> None:
    got = memory_interval(tier, spec, model, hazard)
    assert got == expected
    assert got[1] in MEMORY_RULES


def test_adaptive_interval_follows_the_measured_stall() -> None:
    s = make(
        risk=RiskSpec(mtbf_seconds=3600.0),
        pulse=FIXED_PULSE,
        memory=MemoryTierSpec(enabled=True, base_interval=10, max_interval=1000),
        heartbeat=HeartbeatTierSpec(enabled=False),
        full=FullTierSpec(every_steps=10_000),
    )
    d = feed(s, [1.0] * 3)[-1]
    assert d.memory_interval == 10  # before anything is measured
    s.settle(SaveOutcome.taken(memory_at(2), stall_seconds=0.05))
    d = feed(s, [1.0] * 3, start=3)[-1]
    st = s.step_time  # about 1 s per step (the stall is not training time)
    assert st is not None and 0.9 < st <= 1.0
    assert d.memory_interval == math.floor(math.sqrt(2 * 0.05 * 3600) / st)  # √(2·δ·M)
    assert d.memory_interval in (18, 19)
    # a durable pulse's (larger) stall does not feed the memory tier's cost
    s.settle(SaveOutcome.taken(pulse_at(5), stall_seconds=5.0, persist_seconds=20.0))
    st = s.step_time or 1.0
    assert feed(s, [1.0], start=6)[0].memory_interval == math.floor(math.sqrt(2 * 0.05 * 3600) / st)


# --------------------------------------------------------------------------- decisions


def test_decision_round_trip_and_older_dicts() -> None:
    d = memory_at(12, Tier.HEARTBEAT)
    assert Decision.from_dict(d.to_dict()) == d
    old = {k: v for k, v in pulse_at(3).to_dict().items() if not k.startswith("memory")}
    back = Decision.from_dict(old)
    assert not back.memory and back.memory_interval == 0


def test_outcomes_of_a_memory_decision() -> None:
    taken = SaveOutcome.taken(memory_at(4), stall_seconds=0.01)
    assert taken.memory and taken.tier == Tier.PULSE and not taken.lightweight
    assert SaveOutcome.deferred(memory_at(4)).memory
    assert not SaveOutcome.taken(pulse_at(4)).memory
    # a pulse due with the memory flag is a durable pulse
    both = Decision(step=4, save=True, tier=Tier.PULSE, memory=True)
    assert not both.memory_only and not SaveOutcome.taken(both).memory


@pytest.mark.parametrize(
    ("tiers", "memories", "memory"),
    [
        ((None, None), (True, False), True),
        ((Tier.HEARTBEAT, None), (False, True), True),
        ((Tier.PULSE, None), (False, True), False),  # the pulse covers it
        ((Tier.FULL, Tier.HEARTBEAT), (True, True), False),
        ((None, None), (False, False), False),
    ],
)
def test_merge(
    tiers: tuple[Tier | None, Tier | None], memories: tuple[bool, bool], memory: bool
) -> None:
    ds = [
        Decision(step=9, save=t is not None, tier=t, memory=m, memory_interval=i)
        for t, m, i in zip(tiers, memories, (6, 4), strict=True)
    ]
    merged = merge_decisions(ds)
    assert merged.memory is memory
    assert merged.memory_interval == 4


# --------------------------------------------------------------------------- policy


def test_policy_needs_the_sidecar() -> None:
    with pytest.raises(ValueError, match=r"tiers.memory.enabled needs agent.sidecar: true"):
        CheckpointPolicySpec.model_validate({"tiers": {"memory": {"enabled": True}}})
    ok = CheckpointPolicySpec.model_validate(
        {"tiers": {"memory": {"enabled": True, "everySteps": 4}}, "agent": {"sidecar": True}}
    )
    assert ok.tiers.memory.every_steps == 4
    with pytest.raises(ValueError, match=r"tiers.memory.minInterval must be <="):
        MemoryTierSpec.model_validate({"minInterval": 5, "maxInterval": 4})  # alone: fine
        CheckpointPolicySpec.model_validate(
            {"tiers": {"memory": {"minInterval": 5, "maxInterval": 4}}}
        )


@pytest.mark.parametrize(("uncovered", "expected"), [(1.0, 60), (0.25, 120), (0.01, 500)])
def test_the_pulse_is_sized_for_the_failures_memory_does_not_cover(
    uncovered: float, expected: int
) -> None:
    """Young/Daly for the pulse's δ = 0.5 s at M = 3600 s: 60 steps; with a quarter of the
    failures uncovered M is 4× longer and the interval 2× (storage persists less often)."""
    s = make(
        risk=RiskSpec(mtbf_seconds=3600.0),
        pulse=PulseTierSpec(base_interval=100, min_interval=10, max_interval=500),
        memory=MemoryTierSpec(enabled=True, every_steps=5, uncovered_share=uncovered),
    )
    s.record_step_time(1.0)
    s.settle(SaveOutcome.taken(pulse_at(0), stall_seconds=0.1, persist_seconds=0.4))
    assert s.interval_for(0.0)[0] == expected
    s.memory_off()  # no memory snapshots: storage must cover every failure again
    assert s.interval_for(0.0)[0] == 60
