"""Tier cadence: heartbeat, pulse, full, pulse-now, the long-run rule, tier order."""

from __future__ import annotations

import pytest
from decide_builders import feed, make, measured, tiers_of

from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.tiers import tier_rank
from ckpt_agent.policy.models import HeartbeatTierSpec, PulseTierSpec, Tier
from ckpt_agent.policy.scheduler_models import LossLayerSpec

# --------------------------------------------------------------------------- tiers


def test_pulse_cadence_and_heartbeat_every_step() -> None:
    ds = feed(make(), [1.0] * 401)
    assert tiers_of(ds, Tier.PULSE) == [100, 200, 300, 400]
    assert all(d.save for d in ds)
    assert {d.tier for d in ds} == {Tier.HEARTBEAT, Tier.PULSE}


@pytest.mark.parametrize(
    ("heartbeat", "expected"),
    [
        (HeartbeatTierSpec(every_steps=5), [0, 5, 10, 15]),
        (HeartbeatTierSpec(enabled=False), []),
    ],
)
def test_heartbeat_cadence(heartbeat: HeartbeatTierSpec, expected: list[int]) -> None:
    ds = feed(make(heartbeat=heartbeat), [1.0] * 20)
    assert tiers_of(ds, Tier.HEARTBEAT) == expected
    assert [d.step for d in ds if d.save] == expected


def test_max_interval_forces_a_save() -> None:
    # saves are so slow that the stall budget wants 1000 steps; max (500) still wins
    s = make(pulse=PulseTierSpec(base_interval=100, min_interval=10, max_interval=500))
    measured(s, stall=30.0)
    ds = [s.observe(i, 1.0, now=float(i)) for i in range(0, 1001)]
    assert tiers_of(ds, Tier.PULSE) == [500]
    assert tiers_of(ds, Tier.FULL) == [1000]
    assert ds[500].interval_rule == "max"
    assert "500 steps since last pulse >= interval 500" in ds[500].reason


def _loss_scored(weight: float) -> AdaptiveScheduler:
    """Only the loss layer can fire (score = ``weight``): on any halving after two flat steps
    (alpha 1: the slope is the last difference; no warm-up)."""
    s = make(
        loss=LossLayerSpec(weight=weight, ewma_alpha=1.0, consecutive_steps=1, warmup_steps=0),
        pulse=PulseTierSpec(base_interval=500, max_interval=500),
    )
    s.observe(0, 1.0, now=0.0)
    s.observe(1, 1.0, now=1.0)
    return s


def test_score_at_or_above_07_pulses_now_on_the_rising_edge() -> None:
    s = _loss_scored(0.7)
    d = s.observe(2, 0.5, now=2.0)  # loss layer fires: score 0.7
    assert d.score == pytest.approx(0.7)
    assert d.tier == Tier.PULSE and "pulse now" in d.reason
    d = s.observe(3, 0.25, now=3.0)  # still ≥ 0.7, not a rising edge
    assert d.score == pytest.approx(0.7) and d.tier == Tier.HEARTBEAT
    s.observe(4, 0.25, now=4.0)  # falls back
    d = s.observe(5, 0.125, now=5.0)
    assert d.tier == Tier.PULSE


def test_score_below_07_does_not_pulse_now() -> None:
    assert _loss_scored(0.69).observe(2, 0.5, now=2.0).tier == Tier.HEARTBEAT


@pytest.mark.parametrize(
    ("hours_at_step_500", "full_at_500"),
    [(1.0, False), (359.9, False), (360.1, True), (24.0 * 20, True)],
)
def test_full_every_1000_then_500_after_15_days(
    hours_at_step_500: float, full_at_500: bool
) -> None:
    s = make()
    s.observe(0, 1.0, now=0.0)
    d = s.observe(500, 1.0, now=hours_at_step_500 * 3600)
    assert (d.tier == Tier.FULL) is full_at_500
    if full_at_500:
        assert "run older than 360 h" in d.reason


def test_full_every_1000_resets_the_pulse_counter() -> None:
    ds = feed(make(pulse=PulseTierSpec(base_interval=300, max_interval=500)), [1.0] * 2001)
    assert tiers_of(ds, Tier.FULL) == [1000, 2000]
    assert tiers_of(ds, Tier.PULSE) == [300, 600, 900, 1300, 1600, 1900]


def test_start_time_defaults_to_first_now() -> None:
    s = AdaptiveScheduler()
    s.observe(0, 1.0, now=1000.0)
    assert s.start_time == 1000.0
    clock = iter([5.0, 6.0])
    s = AdaptiveScheduler(clock=lambda: next(clock))
    s.observe(0, 1.0)
    s.observe(1, 1.0)
    assert s.start_time == 5.0 and s.step_time == pytest.approx(1.0)


def test_tier_rank_order() -> None:
    assert [tier_rank(t) for t in (None, Tier.HEARTBEAT, Tier.PULSE, Tier.FULL)] == [-1, 0, 1, 2]


@pytest.mark.parametrize(
    ("base", "fulls", "pulses"),
    [
        # full due within a quarter of the pulse interval: the pulse is taken as the full
        (98, [980], [98 * k for k in range(1, 10)] + [1078, 1176]),  # 20 <= 98/4
        (102, [1000], [102 * k for k in range(1, 10)] + [1102]),  # 82 > 102/4
        (300, [1000], [300, 600, 900]),  # 100 > 300/4: two saves
        (125, [1000], [125 * k for k in range(1, 8)] + [1125]),  # the full at 1000 is due
    ],
)
def test_a_pulse_just_before_a_full_is_taken_as_the_full(
    base: int, fulls: list[int], pulses: list[int]
) -> None:
    ds = feed(make(pulse=PulseTierSpec(base_interval=base, max_interval=500)), [1.0] * 1200)
    assert tiers_of(ds, Tier.FULL) == fulls
    assert tiers_of(ds, Tier.PULSE) == pulses
    if fulls[0] < 1000:
        assert "full due in 20 steps: taken now" in ds[fulls[0]].reason
