"""AdaptiveScheduler: every rule of the adaptive design, as tables where possible."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Sequence

import pytest

from ckpt_agent.decide.scheduler import (
    AdaptiveScheduler,
    Decision,
    SystemSignals,
    merge_decisions,
    tier_rank,
)
from ckpt_agent.policy.models import (
    FullTierSpec,
    GradientLayerSpec,
    HeartbeatTierSpec,
    LossLayerSpec,
    PulseTierSpec,
    RiskSpec,
    SchedulerSpec,
    SystemLayerSpec,
    Tier,
    TiersSpec,
)

NO_RISK = RiskSpec(enabled=False)


def make(
    *,
    loss: LossLayerSpec | None = None,
    gradient: GradientLayerSpec | None = None,
    system: SystemLayerSpec | None = None,
    risk: RiskSpec | None = None,
    pulse_now_score: float = 0.7,
    pulse: PulseTierSpec | None = None,
    full: FullTierSpec | None = None,
    heartbeat: HeartbeatTierSpec | None = None,
    start_time: float = 0.0,
) -> AdaptiveScheduler:
    spec = SchedulerSpec(
        loss=loss or LossLayerSpec(),
        gradient=gradient or GradientLayerSpec(),
        system=system or SystemLayerSpec(),
        risk=risk or RiskSpec(),
        pulse_now_score=pulse_now_score,
    )
    tiers = TiersSpec(
        pulse=pulse or PulseTierSpec(),
        full=full or FullTierSpec(),
        heartbeat=heartbeat or HeartbeatTierSpec(),
    )
    return AdaptiveScheduler(spec, tiers, start_time=start_time)


def feed(
    s: AdaptiveScheduler, losses: Iterable[float], *, start: int = 0, dt: float = 1.0
) -> list[Decision]:
    return [s.observe(start + i, x, now=(start + i) * dt) for i, x in enumerate(losses)]


def loss_fired(ds: Sequence[Decision]) -> list[int]:
    return [d.step for d in ds if d.components["loss"] > 0]


# --------------------------------------------------------------------------- loss layer


def _noisy(level: float, n: int, rng: random.Random, rel: float = 0.1) -> list[float]:
    return [level * (1 + rng.uniform(-rel, rel)) for _ in range(n)]


def test_fast_descent_fires_on_the_steep_part_and_not_on_a_noisy_1e4_plateau() -> None:
    rng = random.Random(7)
    plateau = _noisy(1e-4, 300, rng)  # a 1e-4-level plateau with ±10 % noise
    steep = [1e-4 * 10 ** (-0.02 * i) * (1 + rng.uniform(-0.1, 0.1)) for i in range(100)]
    tail = _noisy(1e-6, 300, rng)
    ds = feed(make(), plateau + steep + tail)
    fired = loss_fired(ds)
    assert fired, "the steep part must fire the loss layer"
    assert all(300 < s < 300 + 100 + 40 for s in fired), fired  # steep part (+ EWMA lag)
    assert len(fired) >= 60
    assert not [s for s in fired if s < 300], "silent on the plateau"
    assert not [s for s in fired if s > 450], "silent on the lower plateau"


@pytest.mark.parametrize(
    ("name", "curve", "fires"),
    [
        # log10 makes the detector scale-free: the same relative speed fires at any level
        ("steep at 1e+1", [10 * math.exp(-0.05 * i) for i in range(120)], True),
        ("steep at 1e-3", [1e-3 * math.exp(-0.05 * i) for i in range(120)], True),
        ("steep rise (divergence)", [0.1 * math.exp(0.05 * i) for i in range(120)], True),
        ("slow training 2.0→1.5", [2.0 - 0.5 * i / 1000 for i in range(1000)], False),
        ("flat 1e-4", [1e-4] * 200, False),
        ("flat 3.0", [3.0] * 200, False),
        ("zero loss", [0.0] * 200, False),
        ("negative loss clamps to the floor", [-1.0] * 200, False),
    ],
)
def test_loss_layer_table(name: str, curve: list[float], fires: bool) -> None:
    ds = feed(make(), curve)
    assert bool(loss_fired(ds)) is fires, name


def test_loss_layer_needs_consecutive_steps_and_resets() -> None:
    # window 2 + alpha 1: slope per window = 2·Δlog10; threshold 0.05 ⇔ |Δlog10| > 0.025
    s = make(loss=LossLayerSpec(window=2, ewma_alpha=1.0, consecutive_steps=3))
    halving = [1.0, 0.5, 0.25, 0.125, 0.0625]  # Δ = -0.301 per step
    table = [
        *zip(halving, [0, 0, 0, 0.4, 0.4], strict=True),  # 1st slope at the 2nd point
        (0.0625, 0.0),  # flat: resets the streak
        (0.03125, 0.0),
        (0.015625, 0.0),
        (0.0078125, 0.4),
    ]
    for i, (x, expected) in enumerate(table):
        d = s.observe(i, x, now=float(i))
        assert d.components["loss"] == expected, (i, x, d)


def test_loss_slope_is_reported_and_window_sized() -> None:
    s = make()
    for i in range(19):
        s.observe(i, 1.0, now=float(i))
        assert s.loss_slope() is None
    s.observe(19, 1.0, now=19.0)
    assert s.loss_slope() == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("jump", "anomaly"), [(1.5, None), (3.0, None), (3.3, "loss_spike"), (100.0, "loss_spike")]
)
def test_loss_spike_is_an_anomaly(jump: float, anomaly: str | None) -> None:
    s = make()
    feed(s, [1.0] * 30)
    d = s.observe(30, jump, now=30.0)
    assert d.anomaly == anomaly
    assert d.components["loss"] == 0.0  # a spike alone adds nothing to the score


def test_no_spike_before_the_window_is_full() -> None:
    s = make()
    feed(s, [1.0] * 5)
    assert s.observe(5, 1000.0, now=5.0).anomaly is None


# --------------------------------------------------------------------------- gradient layer

GRAD = GradientLayerSpec(sample_every=1, min_samples=4, history=50)
# mean 1.1, std 0.058: single samples poke out (±1 std is sensitive), never two in a row
BASELINE = [1.0, 1.1, 1.1, 1.2, 1.1, 1.1] * 2
N = len(BASELINE)


@pytest.mark.parametrize(
    ("tail", "fired_at", "lightweight_at"),
    [
        ([2.0, 2.0], [1], [1]),  # 2 consecutive anomalous → fires on the 2nd
        ([2.0, 1.1, 2.0], [], []),  # not consecutive
        ([1.15, 1.05, 1.1], [], []),  # within mean ± std
        ([0.1, 0.1], [1], [1]),  # low side too
        ([2.0, 2.0, 2.5], [1, 2], [1]),  # stays fired, asks for one lightweight pulse
        ([2.0, math.nan, 2.0], [2], [2]),  # NaN is not a sample: the streak survives it
    ],
)
def test_gradient_anomaly_two_consecutive(
    tail: list[float], fired_at: list[int], lightweight_at: list[int]
) -> None:
    s = make(gradient=GRAD, pulse=PulseTierSpec(base_interval=500, max_interval=500))
    for i, g in enumerate(BASELINE):
        assert s.observe(i, 1.0, grad_norm=g, now=float(i)).components["gradient"] == 0.0
    fired, light = [], []
    for j, g in enumerate(tail):
        d = s.observe(N + j, 1.0, grad_norm=g, now=float(N + j))
        if d.components["gradient"]:
            fired.append(j)
            assert d.score == pytest.approx(0.35)
        if d.lightweight:
            light.append(j)
            assert d.tier == Tier.PULSE and d.save
            assert d.anomaly == "grad_anomaly"
            assert "lightweight" in d.reason
    assert fired == fired_at
    assert light == lightweight_at


def test_gradient_needs_min_samples_and_constant_history() -> None:
    s = make(gradient=GradientLayerSpec(sample_every=1, min_samples=4))
    ds = [s.observe(i, 1.0, grad_norm=g, now=float(i)) for i, g in enumerate([1, 100, 1, 100])]
    assert all(d.components["gradient"] == 0 for d in ds)  # < min_samples before each
    s = make(gradient=GradientLayerSpec(sample_every=1, min_samples=4))
    ds = [s.observe(i, 1.0, grad_norm=1.0, now=float(i)) for i in range(10)]
    ds += [s.observe(10 + i, 1.0, grad_norm=1.5, now=10.0 + i) for i in range(2)]
    assert [d.components["gradient"] for d in ds[-3:]] == [0.0, 0.0, 0.35]


def test_gradient_sampled_every_10_steps_and_history_bounded() -> None:
    s = make()
    assert s.wants_grad_norm(5)  # nothing sampled yet: sample now
    s.observe(5, 1.0, grad_norm=1.0, now=5.0)
    assert [step for step in range(5, 30) if s.wants_grad_norm(step)] == list(range(15, 30))
    s = make()
    for step in range(0, 1000):
        s.observe(step, 1.0, grad_norm=1.0 + (step % 7) * 0.01, now=float(step))
    state = s.state_dict()
    assert len(state["grad_samples"]) == 50
    assert state["last_grad_sample_step"] == 990
    assert s.wants_grad_norm(999) is False
    assert s.wants_grad_norm(1000) is True


def test_lightweight_pulse_does_not_reset_the_pulse_counter() -> None:
    s = make(gradient=GRAD)
    for i, g in enumerate([*BASELINE, 2.0]):
        s.observe(i, 1.0, grad_norm=g, now=float(i))
    d = s.observe(N + 1, 1.0, grad_norm=2.0, now=N + 1.0)
    assert d.lightweight
    pulses = [s.observe(i, 1.0, now=float(i)) for i in range(N + 2, 101)]
    regular = [d.step for d in pulses if d.tier == Tier.PULSE]
    # the gradient layer stays fired (score 0.35 → interval 65) until the next sample
    assert regular == [65]


def test_lightweight_request_is_absorbed_by_a_regular_save() -> None:
    s = make(gradient=GRAD, pulse=PulseTierSpec(base_interval=N + 1, min_interval=10))
    for i, g in enumerate([*BASELINE, 2.0]):
        s.observe(i, 1.0, grad_norm=g, now=float(i))
    d = s.observe(N + 1, 1.0, grad_norm=2.0, now=N + 1.0)  # pulse due (interval) and anomaly
    assert d.tier == Tier.PULSE and not d.lightweight
    assert "covered by this save" in d.reason


# --------------------------------------------------------------------------- system layer


@pytest.mark.parametrize(
    ("signals", "fires"),
    [
        (None, False),
        (SystemSignals(), False),  # no metrics (no GPU) = healthy
        (SystemSignals(gpu_errors=0), False),
        (SystemSignals(gpu_errors=1), True),
        (SystemSignals(write_latency_ms=15.0), False),  # not above the threshold
        (SystemSignals(write_latency_ms=math.nan), False),
    ],
)
def test_system_alarm_table(signals: SystemSignals | None, fires: bool) -> None:
    s = make()
    d = s.observe(10, 1.0, system=signals, now=10.0)
    assert (d.components["system"] == 0.25) is fires
    assert d.emergency is fires
    if fires:
        assert d.tier == Tier.FULL and d.high_risk and d.save
        assert "gpu_errors=1" in d.reason


def test_system_alarm_emergency_full_then_cooldown() -> None:
    s = make()
    bad = SystemSignals(gpu_errors=2)
    d = s.observe(1, 1.0, system=bad, now=1.0)
    assert (d.tier, d.emergency, d.high_risk) == (Tier.FULL, True, True)
    d = s.observe(2, 1.0, system=bad, now=2.0)
    assert d.components["system"] == 0.25 and not d.emergency  # cooldown (100 steps)
    assert d.tier == Tier.HEARTBEAT
    d = s.observe(101, 1.0, system=bad, now=101.0)
    assert d.emergency and d.tier == Tier.FULL


def test_emergency_tier_pulse() -> None:
    s = make(system=SystemLayerSpec(emergency_tier="pulse"))
    d = s.observe(1, 1.0, system=SystemSignals(gpu_errors=1), now=1.0)
    assert (d.tier, d.emergency, d.high_risk) == (Tier.PULSE, True, True)
    # an operator request at the same time still gets a full
    s = make(system=SystemLayerSpec(emergency_tier="pulse"))
    s.request_emergency("SIGTERM")
    d = s.observe(1, 1.0, system=SystemSignals(gpu_errors=1), now=1.0)
    assert (d.tier, d.emergency, d.high_risk) == (Tier.FULL, True, True)
    assert "SIGTERM" in d.reason and "system alarm" in d.reason


@pytest.mark.parametrize(
    ("latencies", "fired"),
    [
        # (now, latency ms): above 15 ms must be held for 5 s
        ([(0, 20), (2, 20), (4.9, 20)], [False, False, False]),
        ([(0, 20), (2, 20), (5, 20), (6, 30)], [False, False, True, True]),
        ([(0, 20), (3, 10), (5, 20), (9, 20), (10, 20)], [False, False, False, False, True]),
        ([(0, 20), (3, None), (5, 20), (9.9, 20)], [False, False, False, False]),  # missing
        ([(0, 16), (5, 16)], [False, True]),
    ],
)
def test_write_latency_must_be_sustained_for_5s(
    latencies: list[tuple[float, float | None]], fired: list[bool]
) -> None:
    s = make()
    got = [
        s.observe(i + 1, 1.0, system=SystemSignals(write_latency_ms=lat), now=t).components[
            "system"
        ]
        > 0
        for i, (t, lat) in enumerate(latencies)
    ]
    assert got == fired


def test_operator_emergency_request() -> None:
    s = make()
    s.observe(1, 1.0, now=1.0)
    s.request_emergency("SIGTERM")
    d = s.observe(2, 1.0, now=2.0)
    assert (d.tier, d.emergency, d.high_risk) == (Tier.FULL, True, False)
    assert "SIGTERM" in d.reason
    assert not s.observe(3, 1.0, now=3.0).emergency


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
    s = make(risk=RiskSpec(mtbf_seconds=mtbf))
    s.record_step_time(step_time)
    s.record_save(Tier.PULSE, 0, stall_seconds=stall, persist_seconds=persist)
    assert s.interval_for(score) == expected


def test_risk_disabled_and_unknown_costs_leave_the_interval_alone() -> None:
    s = make(risk=RiskSpec(enabled=False, mtbf_seconds=1.0))
    s.record_step_time(1.0)
    s.record_save(Tier.PULSE, 0, stall_seconds=5.0, persist_seconds=5.0)
    assert s.interval_for(0.0) == (100, "base")
    s = make(risk=RiskSpec(mtbf_seconds=1.0))
    assert s.interval_for(0.0) == (100, "base")  # no cost and no step time measured yet
    assert s.young_daly_steps() is None


def test_step_time_comes_from_now_minus_save_stalls() -> None:
    s = make(risk=RiskSpec(mtbf_seconds=400.0))
    s.observe(0, 1.0, now=0.0)
    s.record_save(Tier.PULSE, 0, stall_seconds=1.0, persist_seconds=1.0)  # δ = 2 s
    s.observe(1, 1.0, now=3.0)  # 3 s wall, 1 s of it stalled → 2 s per step
    assert s.step_time == pytest.approx(2.0)
    s.observe(11, 1.0, now=23.0)  # 10 steps in 20 s
    assert s.step_time == pytest.approx(2.0)
    assert s.young_daly_steps() == 20  # √(2·2·400) = 40 s / 2 s
    s.record_persist(Tier.PULSE, 1.0)  # async persist reported later: EWMA unchanged
    assert s.young_daly_steps() == 20
    d = s.observe(12, 1.0, now=25.0)
    assert (d.interval, d.interval_rule) == (20, "young_daly")


def test_mtbf_from_the_operator() -> None:
    s = make()
    s.record_step_time(1.0)
    s.record_save(Tier.PULSE, 0, stall_seconds=1.0, persist_seconds=1.0)
    assert s.interval_for(0.0) == (100, "base")
    s.set_mtbf(900.0)  # √(2·2·900) = 60 s
    assert s.interval_for(0.0) == (60, "young_daly")
    with pytest.raises(ValueError):
        s.set_mtbf(0.0)


# --------------------------------------------------------------------------- tiers


def tiers_of(ds: Iterable[Decision], tier: Tier) -> list[int]:
    return [d.step for d in ds if d.tier == tier]


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
    s.record_step_time(1.0)
    s.record_save(Tier.PULSE, 0, stall_seconds=30.0)
    ds = [s.observe(i, 1.0, now=float(i)) for i in range(0, 1001)]
    assert tiers_of(ds, Tier.PULSE) == [500]
    assert tiers_of(ds, Tier.FULL) == [1000]
    assert ds[500].interval_rule == "max"
    assert "500 steps since last pulse >= interval 500" in ds[500].reason


def test_score_at_or_above_07_pulses_now_on_the_rising_edge() -> None:
    s = make(
        loss=LossLayerSpec(weight=0.7, window=2, ewma_alpha=1.0, consecutive_steps=1),
        pulse=PulseTierSpec(base_interval=500, max_interval=500),
    )
    s.observe(0, 1.0, now=0.0)
    s.observe(1, 1.0, now=1.0)
    d = s.observe(2, 0.5, now=2.0)  # loss layer fires: score 0.7
    assert d.score == pytest.approx(0.7)
    assert d.tier == Tier.PULSE and "pulse now" in d.reason
    d = s.observe(3, 0.25, now=3.0)  # still ≥ 0.7, not a rising edge
    assert d.score == pytest.approx(0.7) and d.tier == Tier.HEARTBEAT
    s.observe(4, 0.25, now=4.0)  # falls back
    d = s.observe(5, 0.125, now=5.0)
    assert d.tier == Tier.PULSE


def test_score_below_07_does_not_pulse_now() -> None:
    s = make(
        loss=LossLayerSpec(weight=0.69, window=2, ewma_alpha=1.0, consecutive_steps=1),
        pulse=PulseTierSpec(base_interval=500, max_interval=500),
    )
    s.observe(0, 1.0, now=0.0)
    s.observe(1, 1.0, now=1.0)
    assert s.observe(2, 0.5, now=2.0).tier == Tier.HEARTBEAT


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


# --------------------------------------------------------------------------- NaN / inf


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_is_an_anomaly_and_never_folded(bad: float) -> None:
    s = make()
    feed(s, [1.0] * 50)
    before = s.state_dict()
    d = s.observe(50, bad, now=50.0)
    assert d.anomaly == "nan"
    assert d.tier == Tier.HEARTBEAT  # heartbeat still written
    assert "deferred" in d.reason
    after = s.state_dict()
    for key in ("ewma", "loss_window", "loss_streak", "grad_samples", "prev_score"):
        assert after[key] == before[key], key
    json.dumps(after, allow_nan=False)  # nothing non-finite leaked into the state


def test_nan_defers_pulse_and_emergency_to_the_next_finite_step() -> None:
    s = make()
    feed(s, [1.0] * 100)  # step 0..99
    s.request_emergency("save-now")
    d = s.observe(100, math.nan, now=100.0)  # pulse due and emergency pending
    assert d.tier == Tier.HEARTBEAT and not d.emergency
    assert "pending: emergency" in d.reason
    d = s.observe(101, 1.0, now=101.0)
    assert d.tier == Tier.FULL and d.emergency


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_grad_norm_is_an_anomaly_and_not_sampled(bad: float) -> None:
    s = make(gradient=GRAD)
    for i, g in enumerate(BASELINE):
        s.observe(i, 1.0, grad_norm=g, now=float(i))
    before = s.state_dict()["grad_samples"]
    d = s.observe(N, 1.0, grad_norm=bad, now=float(N))
    assert d.anomaly == "nan"
    assert s.state_dict()["grad_samples"] == before
    assert d.components["gradient"] == 0.0


def test_nan_outranks_other_anomalies() -> None:
    s = make(gradient=GRAD)
    for i, g in enumerate([*BASELINE, 2.0]):
        s.observe(i, 1.0, grad_norm=g, now=float(i))
    d = s.observe(N + 1, math.nan, grad_norm=2.0, now=N + 1.0)
    assert d.anomaly == "nan"


# --------------------------------------------------------------------------- engine feedback


def test_record_failed_makes_the_tier_due_again() -> None:
    s = make()
    ds = feed(s, [1.0] * 101)
    assert ds[100].tier == Tier.PULSE
    s.record_failed(ds[100])
    d = s.observe(101, 1.0, now=101.0)
    assert d.tier == Tier.PULSE and "retry" in d.reason
    assert s.observe(102, 1.0, now=102.0).tier == Tier.HEARTBEAT


def test_record_save_outside_observe_resets_counters() -> None:
    s = make()
    feed(s, [1.0] * 50)
    s.record_save(Tier.FULL, 49, stall_seconds=0.1, persist_seconds=0.2)
    ds = feed(s, [1.0] * 200, start=50)
    assert tiers_of(ds, Tier.PULSE) == [149, 249]
    with pytest.raises(ValueError):
        s.record_save(Decision(step=1, save=False, tier=None), 1)


def test_rewind_after_resume_restarts_trends() -> None:
    s = make()
    feed(s, [1.0] * 300)
    d = s.observe(150, 1.0, now=400.0)  # resumed from an older checkpoint
    assert d.step == 150
    state = s.state_dict()
    assert state["last_pulse"] <= 150
    assert [s for s, _ in state["loss_window"]] == [150] and state["loss_streak"] == 0
    ds = feed(s, [1.0] * 120, start=151, dt=1.0)
    assert tiers_of(ds, Tier.PULSE) == [250]


# --------------------------------------------------------------------------- serialization


def test_decision_json_line_round_trip() -> None:
    s = make(gradient=GRAD)
    for i, g in enumerate([*BASELINE, 2.0]):
        s.observe(i, 1.0, grad_norm=g, now=float(i))
    d = s.observe(N + 1, 1.0, grad_norm=2.0, now=N + 1.0)
    line = d.to_json_line()
    assert "\n" not in line
    data = json.loads(line)
    for key in ("step", "score", "components", "interval", "tier", "reason"):
        assert key in data
    assert data["tier"] == "pulse" and data["components"]["gradient"] == 0.35
    assert Decision.from_dict(data) == d
    assert Decision.from_dict(json.loads(Decision(step=3, save=False, tier=None).to_json_line()))
    with pytest.raises(ValueError, match="unknown"):
        Decision.from_dict({**data, "bogus": 1})


def _drive(s: AdaptiveScheduler, start: int, n: int, seed: int) -> list[Decision]:
    rng = random.Random(seed)
    out = []
    for step in range(start, start + n):
        loss = 2.0 * math.exp(-step / 80) * (1 + rng.uniform(-0.05, 0.05))
        grad = rng.choice([1.0, 1.1, 0.9, 5.0]) if step % 10 == 0 else None
        sysm = SystemSignals(gpu_errors=1) if step == start + 17 else None
        d = s.observe(step, loss, grad_norm=grad, system=sysm, now=step * 0.5)
        if d.tier in (Tier.PULSE, Tier.FULL):
            s.record_save(d, step, stall_seconds=0.05, persist_seconds=0.3)
        out.append(d)
    return out


def test_state_round_trip_gives_identical_decisions() -> None:
    a = make(risk=RiskSpec(mtbf_seconds=50.0))
    _drive(a, 0, 150, seed=1)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    assert len(json.dumps(state)) < 8000  # small
    b = make(risk=RiskSpec(mtbf_seconds=50.0))
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    assert _drive(a, 150, 200, seed=2) == _drive(b, 150, 200, seed=2)
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({**state, "version": 99})


# --------------------------------------------------------------------------- distributed


def D(tier: Tier | None, **kw: object) -> Decision:
    return Decision(step=7, save=tier is not None, tier=tier, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("decisions", "tier", "lightweight", "emergency"),
    [
        ([D(Tier.HEARTBEAT), D(Tier.HEARTBEAT)], Tier.HEARTBEAT, False, False),
        ([D(None), D(Tier.HEARTBEAT)], Tier.HEARTBEAT, False, False),
        ([D(None), D(None)], None, False, False),
        ([D(Tier.HEARTBEAT), D(Tier.PULSE, lightweight=True)], Tier.PULSE, True, False),
        ([D(Tier.PULSE), D(Tier.PULSE, lightweight=True)], Tier.PULSE, False, False),
        ([D(Tier.FULL, emergency=True), D(Tier.PULSE, lightweight=True)], Tier.FULL, False, True),
    ],
)
def test_merge_decisions_table(
    decisions: list[Decision], tier: Tier | None, lightweight: bool, emergency: bool
) -> None:
    for perm in itertools.permutations(decisions):
        m = merge_decisions(perm)
        assert (m.tier, m.lightweight, m.emergency, m.save) == (
            tier,
            lightweight,
            emergency,
            tier is not None,
        )
        assert m == merge_decisions(decisions)  # order-independent


def test_merge_takes_max_score_min_interval_and_worst_anomaly() -> None:
    a = D(
        Tier.HEARTBEAT,
        score=0.25,
        components={"loss": 0.0, "gradient": 0.0, "system": 0.25},
        interval=75,
        interval_rule="score",
        anomaly="grad_anomaly",
        reason="a",
    )
    b = D(
        Tier.HEARTBEAT,
        score=0.4,
        components={"loss": 0.4, "gradient": 0.0, "system": 0.0},
        interval=60,
        interval_rule="score",
        anomaly="nan",
        reason="b",
    )
    m = merge_decisions([a, b])
    assert m.score == 0.4 and m.components == {"loss": 0.4, "gradient": 0.0, "system": 0.25}
    assert (m.interval, m.anomaly, m.reason) == (60, "nan", "a | b")
    with pytest.raises(ValueError):
        merge_decisions([])
    with pytest.raises(ValueError, match="different steps"):
        merge_decisions([a, Decision(step=8, save=False, tier=None)])


def test_ranks_agree_after_adopting_the_merged_decision() -> None:
    ranks = [make(), make(), make()]
    for step in range(0, 60):
        ds = [
            r.observe(
                step,
                1.0,
                system=SystemSignals(gpu_errors=1 if (i == 2 and step == 30) else 0),
                now=float(step),
            )
            for i, r in enumerate(ranks)
        ]
        merged = merge_decisions(ds)
        for r in ranks:
            r.adopt(merged)
        if step == 30:
            assert merged.tier == Tier.FULL and merged.emergency
    keys = ("last_pulse", "last_full", "last_heartbeat", "last_emergency")
    states = [{k: r.state_dict()[k] for k in keys} for r in ranks]
    assert states[0] == states[1] == states[2]
    assert states[0]["last_full"] == 30


def test_tier_rank_order() -> None:
    assert [tier_rank(t) for t in (None, Tier.HEARTBEAT, Tier.PULSE, Tier.FULL)] == [-1, 0, 1, 2]
