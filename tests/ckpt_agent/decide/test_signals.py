"""Signal layers (loss, gradient, system) as the scheduler sees them: tables where possible."""

from __future__ import annotations

import math
import random

import pytest
from decide_builders import BASELINE, GRAD, N, feed, loss_fired, make, one_anomaly

from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.policy.models import PulseTierSpec, Tier
from ckpt_agent.policy.scheduler_models import GradientLayerSpec, LossLayerSpec, SystemLayerSpec

# --------------------------------------------------------------------------- loss layer


def _noisy(level: float, n: int, rng: random.Random, rel: float = 0.1) -> list[float]:
    return [level * (1 + rng.uniform(-rel, rel)) for _ in range(n)]


def test_fast_descent_fires_on_the_steep_part_and_not_on_a_noisy_1e4_plateau() -> None:
    # the recursive slope is in decades per step: the steep part falls 0.1 decade per step
    rng = random.Random(7)
    plateau = _noisy(1e-4, 300, rng)  # a 1e-4-level plateau with ±10 % noise
    steep = [1e-4 * 10 ** (-0.1 * i) * (1 + rng.uniform(-0.1, 0.1)) for i in range(40)]
    tail = _noisy(1e-8, 300, rng)
    ds = feed(make(loss=LossLayerSpec(epsilon=1e-12)), plateau + steep + tail)
    fired = loss_fired(ds)
    assert fired, "the steep part must fire the loss layer"
    assert all(300 < s < 300 + 40 + 20 for s in fired), fired  # steep part (+ EWMA lag)
    assert min(fired) <= 300 + 7, "reacts within 7 steps"
    assert len(fired) >= 30
    assert not [s for s in fired if s < 300], "silent on the plateau"
    assert not [s for s in fired if s > 360], "silent on the lower plateau"


def test_steep_descent_x08_per_step_fires_within_7_steps() -> None:
    """The issue's case: loss × 0.8 per step; the window fit fired on 19 of the first 40 steps
    after a 20-point warm-up, the recursive slope crosses 0.05 at the 4th difference."""
    ds = feed(make(), [10.0 * 0.8**i for i in range(40)])
    fired = loss_fired(ds)
    assert fired[0] <= 7
    assert fired == list(range(fired[0], 40))
    assert ds[4].components["loss"] == 0.0  # warm-up and 3 steps in a row


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rel", [0.05, 0.1, 0.2])
def test_noisy_plateau_at_1e4_never_fires(seed: int, rel: float) -> None:
    rng = random.Random(seed)
    ds = feed(make(), _noisy(1e-4, 2000, rng, rel))
    assert loss_fired(ds) == []


@pytest.mark.parametrize(
    ("name", "curve", "fires"),
    [
        # log10 makes the detector scale-free: the same relative speed fires at any level
        ("steep at 1e+1", [10 * math.exp(-0.2 * i) for i in range(60)], True),
        ("steep at 1e-3", [1e-3 * math.exp(-0.2 * i) for i in range(60)], True),
        ("steep rise (divergence)", [0.1 * math.exp(0.2 * i) for i in range(60)], True),
        ("moderate descent (0.02 decade/step)", [10 ** (-0.02 * i) for i in range(200)], False),
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
    # alpha 1: the slope is the last difference; threshold 0.05 decade per step
    s = make(loss=LossLayerSpec(ewma_alpha=1.0, consecutive_steps=3, warmup_steps=0))
    halving = [1.0, 0.5, 0.25, 0.125, 0.0625]  # Δ = -0.301 per step
    table = [
        *zip(halving, [0, 0, 0, 0.4, 0.4], strict=True),  # 1st difference at the 2nd point
        (0.0625, 0.0),  # flat: resets the streak
        (0.03125, 0.0),
        (0.015625, 0.0),
        (0.0078125, 0.4),
    ]
    for i, (x, expected) in enumerate(table):
        d = s.observe(i, x, now=float(i))
        assert d.components["loss"] == expected, (i, x, d)


def test_loss_layer_warm_up() -> None:
    s = make(loss=LossLayerSpec(ewma_alpha=1.0, consecutive_steps=1, warmup_steps=3))
    got = [s.observe(i, 0.5**i, now=float(i)).components["loss"] for i in range(5)]
    assert got == [0.0, 0.0, 0.0, 0.4, 0.4]  # differences 1 and 2 are warm-up


def test_loss_slope_is_the_recursive_ewma_of_log_differences() -> None:
    s = make()
    s.observe(0, 1.0, now=0.0)
    assert s.loss_slope() is None
    expected = 0.0
    for i in range(1, 6):
        s.observe(i, 0.5**i, now=float(i))  # Δ = log10(0.5) per step (ε = 1e-8 is noise)
        expected = 0.2 * math.log10(0.5) + 0.8 * expected
        assert s.loss_slope() == pytest.approx(expected, rel=1e-5)


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
    s = make()
    feed(s, [1.0] * 20)
    assert s.observe(20, 1000.0, now=20.0).anomaly == "loss_spike"
    s = make()
    feed(s, [1.0] * 19)
    assert s.observe(19, 1000.0, now=19.0).anomaly is None


# --------------------------------------------------------------------------- gradient layer


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
    one_anomaly(s)
    d = s.observe(N + 1, 1.0, grad_norm=2.0, now=N + 1.0)
    assert d.lightweight
    pulses = [s.observe(i, 1.0, now=float(i)) for i in range(N + 2, 101)]
    regular = [d.step for d in pulses if d.tier == Tier.PULSE]
    # the gradient layer stays fired (score 0.35 → interval 65) until the next sample
    assert regular == [65]


def test_lightweight_request_is_absorbed_by_a_regular_save() -> None:
    s = make(gradient=GRAD, pulse=PulseTierSpec(base_interval=N + 1, min_interval=10))
    one_anomaly(s)
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
