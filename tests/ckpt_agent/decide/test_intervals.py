"""Pulse interval rules: score, Young/Daly cap, stall budget, policy bounds; measured costs."""

from __future__ import annotations

import pytest
from decide_builders import make, measured

from ckpt_agent.decide.decision import SaveOutcome
from ckpt_agent.policy.models import PulseTierSpec, RiskSpec, Tier

# --------------------------------------------------------------------------- interval


@pytest.mark.parametrize(
    ("score", "interval", "rule"),
    [
        (0.0, 100, "base"),
        (0.25, 75, "score"),
        (0.35, 65, "score"),
        (0.4, 60, "score"),
        (0.6, 40, "score"),
        (0.75, 25, "score"),
        (0.85, 15, "score"),
        (0.9, 10, "score"),
        (0.95, 10, "min"),  # 100·0.05 = 5 → clamped to min 10
        (1.0, 10, "min"),  # score capped at 0.95 first
    ],
)
def test_interval_clamping_defaults(score: float, interval: int, rule: str) -> None:
    assert make().interval_for(score) == (interval, rule)


@pytest.mark.parametrize(
    ("pulse", "score", "expected"),
    [
        (PulseTierSpec(base_interval=50, min_interval=20, max_interval=60), 0.9, (20, "min")),
        (PulseTierSpec(base_interval=500, min_interval=10, max_interval=500), 0.0, (500, "base")),
        (PulseTierSpec(base_interval=10, min_interval=10, max_interval=10), 0.5, (10, "min")),
        (PulseTierSpec(base_interval=1, min_interval=1, max_interval=1), 0.95, (1, "score")),
    ],
)
def test_interval_clamping_custom(
    pulse: PulseTierSpec, score: float, expected: tuple[int, str]
) -> None:
    assert make(pulse=pulse).interval_for(score) == expected


@pytest.mark.parametrize(
    ("mtbf", "step_time", "stall", "persist", "score", "expected"),
    [
        # τ = √(2·δ·M): δ = 0.5 + 1.5 = 2 s, M = 100 s → 20 s → 20 steps of 1 s
        (100.0, 1.0, 0.5, 1.5, 0.0, (20, "young_daly")),
        (100.0, 0.5, 0.5, 1.5, 0.0, (40, "young_daly")),
        (100.0, 0.1, 0.0, 2.0, 0.0, (100, "base")),  # τ = 200 steps > 100: no cap
        (100.0, 1.0, 0.1, 1.9, 0.9, (10, "score")),  # already shorter than τ
        (100.0, 1.0, 0.5, 1.5, 0.9, (17, "stall_budget")),  # 0.5 s / 3 % of 1 s
        (1.0, 1.0, 0.01, 0.01, 0.0, (10, "min")),  # τ = 0.2 s → 1 step → policy min wins
        (86_400.0, 1.0, 0.01, 0.0, 0.0, (41, "young_daly")),  # default MTBF, 10 ms saves
        (86_400.0, 1.0, 0.0, 1.0, 0.0, (100, "base")),  # τ = 415 steps ≫ base
        # stall budget 3 %: interval ≥ stall / (0.03 · step time)
        (86_400.0, 1.0, 3.0, 0.0, 0.4, (100, "stall_budget")),
        (86_400.0, 1.0, 1.8, 0.0, 0.4, (60, "score")),  # floor 60 = interval
        (86_400.0, 1.0, 30.0, 0.0, 0.0, (500, "max")),  # floor 1000 → max wins
        (100.0, 1.0, 0.6, 0.0, 0.0, (20, "stall_budget")),  # τ=10.95→10 < floor 20
    ],
)
def test_young_daly_cap_and_stall_budget(
    mtbf: float,
    step_time: float,
    stall: float,
    persist: float,
    score: float,
    expected: tuple[int, str],
) -> None:
    s = measured(
        make(risk=RiskSpec(mtbf_seconds=mtbf)), step_time=step_time, stall=stall, persist=persist
    )
    assert s.interval_for(score) == expected


def test_risk_disabled_and_unknown_costs_leave_the_interval_alone() -> None:
    s = measured(make(risk=RiskSpec(enabled=False, mtbf_seconds=1.0)), stall=5.0, persist=5.0)
    assert s.interval_for(0.0) == (100, "base")
    s = make(risk=RiskSpec(mtbf_seconds=1.0))
    assert s.interval_for(0.0) == (100, "base")  # no cost and no step time measured yet
    assert s.young_daly_steps() is None


def test_step_time_comes_from_now_minus_save_stalls() -> None:
    s = make(risk=RiskSpec(mtbf_seconds=400.0))
    s.observe(0, 1.0, now=0.0)
    measured(s, step_time=None, stall=1.0, persist=1.0)  # δ = 2 s
    s.observe(1, 1.0, now=3.0)  # 3 s wall, 1 s of it stalled → 2 s per step
    assert s.step_time == pytest.approx(2.0)
    s.observe(11, 1.0, now=23.0)  # 10 steps in 20 s
    assert s.step_time == pytest.approx(2.0)
    assert s.young_daly_steps() == 20  # √(2·2·400) = 40 s / 2 s
    s.settle(SaveOutcome.persisted(Tier.PULSE, 1.0))  # async persist reported later: EWMA unchanged
    assert s.young_daly_steps() == 20
    d = s.observe(12, 1.0, now=25.0)
    assert (d.interval, d.interval_rule) == (20, "young_daly")


def test_mtbf_from_the_operator() -> None:
    s = measured(make(), stall=1.0, persist=1.0)
    assert s.interval_for(0.0) == (100, "base")
    s.set_mtbf(900.0)  # √(2·2·900) = 60 s
    assert s.interval_for(0.0) == (60, "young_daly")
    with pytest.raises(ValueError):
        s.set_mtbf(0.0)
