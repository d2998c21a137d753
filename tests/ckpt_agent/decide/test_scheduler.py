"""AdaptiveScheduler as a whole: NaN/inf handling, engine feedback (settle), state, agreement."""

from __future__ import annotations

import json
import math
import random

import pytest
from decide_builders import (
    BASELINE,
    GRAD,
    N,
    feed,
    feed_grads,
    make,
    memory_at,
    one_anomaly,
    pulse_at,
    tiers_of,
)

from ckpt_agent.decide.decision import Decision, SaveOutcome, SaveResult, merge_decisions
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.policy.models import HeartbeatTierSpec, Tier
from ckpt_agent.policy.scheduler_models import RiskSpec

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
    for key in ("ewma", "loss_last", "loss_trend", "loss_streak", "grad_samples", "prev_score"):
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
    feed_grads(s, BASELINE)
    before = s.state_dict()["grad_samples"]
    d = s.observe(N, 1.0, grad_norm=bad, now=float(N))
    assert d.anomaly == "nan"
    assert s.state_dict()["grad_samples"] == before
    assert d.components["gradient"] == 0.0


def test_nan_outranks_other_anomalies() -> None:
    s = make(gradient=GRAD)
    one_anomaly(s)
    d = s.observe(N + 1, math.nan, grad_norm=2.0, now=N + 1.0)
    assert d.anomaly == "nan"


# --------------------------------------------------------------------------- engine feedback


def test_a_deferred_save_is_due_again() -> None:
    s = make()
    ds = feed(s, [1.0] * 101)
    assert ds[100].tier == Tier.PULSE
    s.settle(SaveOutcome.deferred(ds[100]))
    d = s.observe(101, 1.0, now=101.0)
    assert d.tier == Tier.PULSE and "retry" in d.reason
    assert s.observe(102, 1.0, now=102.0).tier == Tier.HEARTBEAT


def test_a_save_taken_outside_observe_resets_counters() -> None:
    s = make()
    feed(s, [1.0] * 50)
    s.settle(
        SaveOutcome(SaveResult.TAKEN, Tier.FULL, step=49, stall_seconds=0.1, persist_seconds=0.2)
    )
    ds = feed(s, [1.0] * 200, start=50)
    assert tiers_of(ds, Tier.PULSE) == [149, 249]
    with pytest.raises(ValueError):
        s.settle(SaveOutcome.taken(Decision(step=1, save=False, tier=None)))


def _changed(before: dict[str, object], after: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in after.items() if before[k] != v}


NO_COST = {"stall": None, "persist": None}


@pytest.mark.parametrize(
    ("earlier", "outcome", "changed"),
    [
        (
            [],
            SaveOutcome.taken(pulse_at(49), stall_seconds=0.1, persist_seconds=0.2),
            {
                "last_heartbeat": 49,
                "last_pulse": 49,
                "last_memory": 49,
                "costs": {
                    "heartbeat": NO_COST,
                    "pulse": {"stall": 0.1, "persist": 0.2},
                    "full": NO_COST,
                },
            },
        ),
        (  # lightweight: only the heartbeat counter, no cost
            [],
            SaveOutcome.taken(pulse_at(49, lightweight=True), stall_seconds=0.1),
            {"last_heartbeat": 49},
        ),
        (
            [],
            SaveOutcome(SaveResult.TAKEN, Tier.FULL, step=49, stall_seconds=0.3),
            {
                "last_heartbeat": 49,
                "last_pulse": 49,
                "last_memory": 49,
                "last_full": 49,
                "costs": {
                    "heartbeat": NO_COST,
                    "pulse": NO_COST,
                    "full": {"stall": 0.3, "persist": None},
                },
            },
        ),
        ([], SaveOutcome(SaveResult.TAKEN, Tier.HEARTBEAT, step=49), {"last_heartbeat": 49}),
        (
            [],
            SaveOutcome.persisted(Tier.PULSE, 1.5, step=40),
            {
                "costs": {
                    "heartbeat": NO_COST,
                    "pulse": {"stall": None, "persist": 1.5},
                    "full": NO_COST,
                }
            },
        ),
        ([], SaveOutcome.persisted(Tier.PULSE, math.nan), {}),  # non-finite: ignored
        ([], SaveOutcome.deferred(pulse_at(49)), {"retry_tier": "pulse"}),
        ([], SaveOutcome.failed("full"), {"retry_tier": "full"}),
        ([SaveOutcome.failed(Tier.FULL)], SaveOutcome.failed(Tier.PULSE), {}),  # highest stays
        ([SaveOutcome.failed(Tier.PULSE)], SaveOutcome.failed(Tier.FULL), {"retry_tier": "full"}),
        (  # a lower tier taken leaves a higher retry pending
            [SaveOutcome.failed(Tier.FULL)],
            SaveOutcome(SaveResult.TAKEN, Tier.HEARTBEAT, step=49),
            {"last_heartbeat": 49},
        ),
        (  # the retried tier (or a higher one) taken clears it
            [SaveOutcome.failed(Tier.PULSE)],
            SaveOutcome(SaveResult.TAKEN, Tier.FULL, step=49),
            {
                "last_heartbeat": 49,
                "last_pulse": 49,
                "last_memory": 49,
                "last_full": 49,
                "retry_tier": None,
            },
        ),
        (  # a memory-tier snapshot: its own counter and costs, nothing durable
            [],
            SaveOutcome.taken(memory_at(49), stall_seconds=0.01),
            {"last_memory": 49, "memory_cost": {"stall": 0.01, "persist": None}},
        ),
        (
            [],
            SaveOutcome.persisted(Tier.PULSE, 0.4, memory=True),
            {"memory_cost": {"stall": None, "persist": 0.4}},
        ),
        ([], SaveOutcome.deferred(memory_at(49)), {"memory_retry": True}),
        ([], SaveOutcome.failed(Tier.PULSE, memory=True), {"memory_retry": True}),
        (  # a pending pulse retry stays: a memory snapshot never reaches storage
            [SaveOutcome.failed(Tier.PULSE)],
            SaveOutcome.taken(memory_at(49)),
            {"last_memory": 49},
        ),
        (  # a memory retry is cleared by the next memory snapshot or a pulse
            [SaveOutcome.deferred(memory_at(48))],
            SaveOutcome.taken(pulse_at(49)),
            {
                "last_heartbeat": 49,
                "last_pulse": 49,
                "last_memory": 49,
                "memory_retry": False,
            },
        ),
        (  # a persist result never clears a retry
            [SaveOutcome.failed(Tier.PULSE)],
            SaveOutcome.persisted(Tier.FULL, 2.0),
            {
                "costs": {
                    "heartbeat": NO_COST,
                    "pulse": NO_COST,
                    "full": {"stall": None, "persist": 2.0},
                }
            },
        ),
    ],
)
def test_settle_table(
    earlier: list[SaveOutcome], outcome: SaveOutcome, changed: dict[str, object]
) -> None:
    s = make(heartbeat=HeartbeatTierSpec(every_steps=1000))
    feed(s, [1.0] * 50)
    for o in earlier:
        s.settle(o)
    before = s.state_dict()
    s.settle(outcome)
    assert _changed(before, s.state_dict()) == changed


@pytest.mark.parametrize(
    ("outcome", "tier", "retry"),
    [
        (SaveOutcome.deferred(pulse_at(100)), Tier.PULSE, True),
        (SaveOutcome.failed(Tier.FULL, step=100), Tier.FULL, True),
        (SaveOutcome.persisted(Tier.PULSE, 0.5), Tier.HEARTBEAT, False),
        (SaveOutcome.taken(pulse_at(100), stall_seconds=0.01), Tier.HEARTBEAT, False),
    ],
)
def test_settle_then_observe(outcome: SaveOutcome, tier: Tier, retry: bool) -> None:
    s = make()
    ds = feed(s, [1.0] * 101)
    assert ds[100].tier == Tier.PULSE
    s.settle(outcome)
    d = s.observe(101, 1.0, now=101.0)
    assert d.tier == tier and ("retry" in d.reason) is retry


def test_settled_stall_is_excluded_from_the_step_time() -> None:
    s = make()
    s.observe(0, 1.0, now=0.0)
    s.settle(SaveOutcome.taken(pulse_at(0), stall_seconds=1.0))
    s.observe(1, 1.0, now=3.0)  # 3 s wall, 1 s of it stalled
    assert s.step_time == pytest.approx(2.0)
    s.settle(SaveOutcome.persisted(Tier.PULSE, 5.0))  # a persist is not a stall
    s.observe(2, 1.0, now=5.0)
    assert s.step_time == pytest.approx(2.0)


def test_rewind_after_resume_restarts_trends() -> None:
    s = make()
    feed(s, [1.0] * 300)
    d = s.observe(150, 1.0, now=400.0)  # resumed from an older checkpoint
    assert d.step == 150
    state = s.state_dict()
    assert state["last_pulse"] <= 150
    assert state["loss_folded"] == 0 and state["loss_streak"] == 0  # the trend restarted
    assert state["loss_trend"] == 0.0
    ds = feed(s, [1.0] * 120, start=151, dt=1.0)
    assert tiers_of(ds, Tier.PULSE) == [250]


# --------------------------------------------------------------------------- state


def _drive(s: AdaptiveScheduler, start: int, n: int, seed: int) -> list[Decision]:
    rng = random.Random(seed)
    out = []
    for step in range(start, start + n):
        loss = 2.0 * math.exp(-step / 80) * (1 + rng.uniform(-0.05, 0.05))
        grad = rng.choice([1.0, 1.1, 0.9, 5.0]) if step % 10 == 0 else None
        sysm = SystemSignals(gpu_errors=1) if step == start + 17 else None
        d = s.observe(step, loss, grad_norm=grad, system=sysm, now=step * 0.5)
        if d.tier in (Tier.PULSE, Tier.FULL):
            s.settle(SaveOutcome.taken(d, stall_seconds=0.05, persist_seconds=0.3))
        out.append(d)
    return out


def test_state_dict_keys_and_order_are_stable() -> None:
    """The checkpointed format: one flat dict, every part's keys in a fixed order."""
    assert list(make().state_dict()) == [
        "version",
        "start_time",
        "mtbf",
        "last_step",
        "last_now",
        "ewma",
        "loss_last",
        "loss_trend",
        "loss_folded",
        "loss_streak",
        "grad_samples",
        "grad_streak",
        "last_grad_sample_step",
        "latency_high_since",
        "system_alarms",
        "system_owed",
        "last_heartbeat",
        "last_pulse",
        "last_full",
        "last_memory",
        "memory_retry",
        "last_emergency",
        "prev_score",
        "first_step",
        "pending_emergency",
        "pending_high_risk",
        "pending_emergency_tier",
        "pending_lightweight",
        "retry_tier",
        "step_time",
        "costs",
        "memory_cost",
        "warning",
        "warning_until",
        "warning_since",
        "warning_episodes",
        "observed_seconds",
    ]


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
