"""Pulse interval rules: Young/Daly for the hazard, score, stall budget, policy bounds; costs."""

from __future__ import annotations

import itertools

import pytest
from decide_builders import make, measured

from ckpt_agent.decide.decision import Decision, SaveOutcome
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.policy.models import PulseTierSpec, Tier
from ckpt_agent.policy.scheduler_models import RiskSpec

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
        # the interval follows τ, also above the base interval (it was only a cap)
        (100.0, 0.1, 0.0, 2.0, 0.0, (200, "young_daly")),
        (100.0, 1.0, 0.1, 1.9, 0.9, (10, "min")),  # τ·(1 − 0.9) = 2 → floor 4 → min 10
        (100.0, 1.0, 0.5, 1.5, 0.9, (17, "stall_budget")),  # 0.5 s / 3 % of 1 s
        (1.0, 1.0, 0.01, 0.01, 0.0, (10, "min")),  # τ = 0.2 s → 1 step → policy min wins
        (86_400.0, 1.0, 0.01, 0.0, 0.0, (41, "young_daly")),  # default MTBF, 10 ms saves
        (86_400.0, 1.0, 0.0, 1.0, 0.0, (415, "young_daly")),  # τ = 415 steps (was: base 100)
        # stall budget 3 %: interval ≥ stall / (0.03 · step time)
        (86_400.0, 1.0, 3.0, 0.0, 0.4, (432, "score")),  # τ 720 · 0.6 > floor 100
        (86_400.0, 1.0, 1.8, 0.0, 0.4, (334, "score")),  # τ 557 · 0.6 > floor 60
        (100.0, 1.0, 3.0, 0.0, 0.4, (100, "stall_budget")),  # τ 24 · 0.6 = 14 < floor 100
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
    assert s.interval_for(0.0) == (500, "max")  # default MTBF: τ = √(2·2·86400) = 587 s
    s.set_mtbf(900.0)  # √(2·2·900) = 60 s
    assert s.interval_for(0.0) == (60, "young_daly")
    with pytest.raises(ValueError):
        s.set_mtbf(0.0)


# --------------------------------------------------------------------------- hazard


def _m3000() -> AdaptiveScheduler:
    """M 3000 s, every failure unannounced, 2 s steps, δ = 0.5 + 6.5 s (stall-budget floor
    ⌈0.5 / (0.03·2)⌉ = 9 steps): calm interval √(2·7·3000) = 205 s = 102 steps."""
    return measured(
        make(risk=RiskSpec(mtbf_seconds=3000.0, warned_fraction=0.0)),
        step_time=2.0,
        stall=0.5,
        persist=6.5,
    )


CALM = (102, "young_daly", 1.0, None)
"""What :func:`_m3000` decides while calm: (interval, rule, hazard, warning)."""


def _sized(d: Decision) -> tuple[int, str, float, str | None]:
    return d.interval, d.interval_rule, d.hazard, d.warning


def _warned(s: AdaptiveScheduler, step: int, now: float, warning: str | None) -> Decision:
    return s.observe(step, 1.0, system=SystemSignals(node_warning=warning), now=now)


@pytest.mark.parametrize(
    ("signals", "why"),
    [
        (SystemSignals(node_warning="NotReady"), "node warning: NotReady"),
        (SystemSignals(node_warning="DisruptionTarget"), "node warning: DisruptionTarget"),
        (SystemSignals(gpu_errors=2), "gpu_errors=2"),
    ],
)
def test_a_warning_shrinks_the_interval_and_it_relaxes_after(
    signals: SystemSignals, why: str
) -> None:
    # M 3000 s, δ 0.5 + 6.5 s, 2 s steps: calm τ = √(2·7·3000) = 205 s → 102 steps; warned
    # (warningMtbfSeconds 120): τ = √(2·7·120) = 41 s → 20 steps, hazard 3000/120 = 25
    s = _m3000()
    calm = s.observe(1, 1.0, now=2.0)
    assert _sized(calm) == CALM
    d = s.observe(2, 1.0, system=signals, now=4.0)
    # the system layer's score (0.25) shrinks it further while it fires: 20 · 0.75
    assert (d.interval, d.interval_rule, d.hazard) == (15, "score", 25.0)
    assert d.warning is not None and why in d.warning
    assert d.emergency  # the alarm's own emergency save still happens
    # it holds 60 s (warningHoldSeconds) after the last signal, then relaxes
    held = s.observe(30, 1.0, now=60.0)
    assert (held.interval, held.interval_rule, held.hazard) == (20, "warning", 25.0)
    assert _sized(s.observe(33, 1.0, now=66.0)) == CALM


def test_warning_saves_pulses_more_often_then_returns_to_the_calm_cadence() -> None:
    s = _m3000()
    ds = [_warned(s, i, 2.0 * i, "cordoned" if 200 <= i < 260 else None) for i in range(1, 600)]
    pulses = [d.step for d in ds if d.tier in (Tier.PULSE, Tier.FULL)]
    during = [p for p in pulses if 200 <= p < 290]
    assert len(during) >= 4  # onset emergency + every 20 steps while it holds
    later = [p for p in pulses if p >= 320]
    assert all(b - a == 102 for a, b in itertools.pairwise(later))


@pytest.mark.parametrize(
    ("mtbf", "expected"),
    [
        # Young/Daly: τ = √(2·δ·M) with δ = 2 s, 1 s steps: ∝ √M
        (100.0, 20),
        (400.0, 40),
        (900.0, 60),
        (3600.0, 120),
        (22_500.0, 300),
    ],
)
def test_mtbf_updates_change_the_interval_as_young_daly_says(mtbf: float, expected: int) -> None:
    s = measured(make(), stall=0.2, persist=1.8)  # stall-budget floor 7 steps
    s.set_mtbf(mtbf)
    assert s.mtbf_seconds == mtbf
    assert s.interval_for(0.0) == (expected, "young_daly")
    assert s.observe(1, 1.0, now=1.0).interval == expected


@pytest.mark.parametrize(
    ("warned", "hazard", "interval"),
    [
        # calm while a share w of the failures is announced: τ = √(2·δ·M/(1 − w))
        (0.0, 1.0, 20),
        (0.5, 0.5, 28),  # 20·√2
        (0.75, 0.25, 40),
        (0.9375, 0.0625, 80),
    ],
)
def test_calm_interval_grows_with_the_warned_share(
    warned: float, hazard: float, interval: int
) -> None:
    s = measured(
        make(risk=RiskSpec(mtbf_seconds=100.0, warned_fraction=warned)), stall=0.2, persist=1.8
    )
    d = s.observe(1, 1.0, now=1.0)
    assert d.hazard == pytest.approx(hazard)
    assert (d.interval, d.interval_rule) == (interval, "young_daly")


def test_warned_share_is_learned_from_the_warnings_seen() -> None:
    # M = 100 s; 1 s steps; a 1-step warning every 200 s: 5 episodes in 1000 s
    s = measured(
        make(risk=RiskSpec(mtbf_seconds=100.0, warning_hold_seconds=1.0)), stall=0.2, persist=1.8
    )
    assert s.hazard_at(0.0).multiplier == 1.0  # nothing seen: every failure unannounced
    for i in range(1, 1001):
        s.observe(i, 1.0, system=SystemSignals(gpu_errors=1 if i % 200 == 0 else 0), now=float(i))
    # 5 episodes / (999 s / 100 s + 1) ≈ 0.455 announced
    assert s.hazard_at(2000.0).multiplier == pytest.approx(1 - 5 / (999 / 100 + 1), rel=1e-6)
    capped = make(risk=RiskSpec(mtbf_seconds=100.0, max_warned_fraction=0.2))
    capped.observe(0, 1.0, system=SystemSignals(gpu_errors=1), now=0.0)
    assert capped.hazard_at(100.0).multiplier == pytest.approx(0.8)


def test_a_restart_gap_is_no_step_time_and_no_exposure() -> None:
    s = make()
    for i in range(5):
        s.observe(i, 1.0, now=2.0 * i)
    state = s.state_dict()
    r = make()
    r.load_state_dict(state)
    r.observe(5, 1.0, now=500.0)  # resumed from the checkpoint after a long restart
    assert r.step_time == pytest.approx(2.0)
    assert r.state_dict()["observed_seconds"] == pytest.approx(8.0)


def test_a_save_now_request_can_be_a_warning_too() -> None:
    """The operator's save-now signal (and SIGTERM) reach the scheduler as
    request_emergency: an emergency full save; with warning=True also the hazard of a
    warning (a plain request leaves the interval alone)."""
    s = _m3000()
    s.request_emergency("save-now")
    d = s.observe(1, 1.0, now=2.0)
    assert d.emergency and (d.interval, d.hazard, d.warning) == (102, 1.0, None)
    s.request_emergency("node cordoned: drain in progress", warning=True)
    d = s.observe(2, 1.0, now=4.0)
    assert d.emergency and d.tier == Tier.FULL
    assert (d.interval, d.interval_rule, d.hazard) == (20, "warning", 25.0)
    assert d.warning == "node cordoned: drain in progress"
    assert s.observe(33, 1.0, now=66.0).hazard == 1.0


def test_a_long_warning_is_cut() -> None:
    s = make()
    d = s.observe(1, 1.0, system=SystemSignals(node_warning="x" * 5000), now=1.0)
    assert d.warning is not None and len(d.warning) == 200
