"""A warning that holds for a long time: one emergency save per episode, and the warned
hazard decays and ends (``decide.signals.SystemLayer.owed``, ``decide.hazard``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from decide_builders import make

from ckpt_agent.decide.decision import Decision
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.policy.models import Tier
from ckpt_agent.policy.scheduler_models import RiskSpec

STEP_S = 2.0
"""Seconds per step in these tables."""

Script = Callable[[int], SystemSignals | None]
"""The system signals at a step."""


def _run(s: AdaptiveScheduler, steps: int, script: Script) -> list[Decision]:
    return [s.observe(i, 1.0, system=script(i), now=STEP_S * i) for i in range(1, steps + 1)]


def _node(spans: list[tuple[int, int, str]]) -> Script:
    """A node warning ``text`` on the steps ``[start, stop)`` of each span."""

    def at(step: int) -> SystemSignals | None:
        for start, stop, text in spans:
            if start <= step < stop:
                return SystemSignals(node_warning=text)
        return None

    return at


def _emergencies(ds: list[Decision]) -> list[int]:
    return [d.step for d in ds if d.emergency]


@pytest.mark.parametrize(
    ("script", "steps", "expected"),
    [
        # a cordon of 2,000 steps: one save at its onset (it was one every 100 steps)
        (_node([(1, 2001, "cordoned")]), 2100, [1]),
        # cleared, then raised again: a new episode
        (_node([(1, 150, "cordoned"), (161, 400, "cordoned")]), 400, [1, 161]),
        # raised again within the cooldown (100 steps): its save waits for the cooldown
        (_node([(1, 50, "cordoned"), (56, 400, "cordoned")]), 400, [1, 101]),
        # cleared before the cooldown ended: that episode is over, no save owed
        (_node([(1, 50, "cordoned"), (56, 80, "cordoned")]), 400, [1]),
        # another warning while one holds (a taint after the cordon) is a new episode
        (_node([(1, 150, "cordoned"), (150, 900, "taint karpenter.sh/disrupted")]), 900, [1, 150]),
        (_node([(1, 50, "cordoned"), (50, 900, "NotReady")]), 900, [1, 101]),
        # storage latency sustained for 2,000 s: one save when it becomes sustained (5 s)
        (lambda i: SystemSignals(write_latency_ms=40.0), 1000, [4]),  # from 2 s, at 8 s
        # new GPU errors are new evidence every time (bounded by the cooldown)
        (lambda i: SystemSignals(gpu_errors=1), 350, [1, 101, 201, 301]),
        (lambda i: SystemSignals(gpu_errors=1 if i in (1, 30, 150) else 0), 350, [1, 150]),
    ],
)
def test_one_emergency_save_per_alarm_episode(
    script: Script, steps: int, expected: list[int]
) -> None:
    ds = _run(make(), steps, script)
    assert _emergencies(ds) == expected
    assert all(d.tier == Tier.FULL and d.high_risk for d in ds if d.emergency)


def test_the_owed_save_survives_a_restart_of_the_scheduler() -> None:
    s = make()
    cordon = _node([(1, 50, "cordoned"), (56, 400, "cordoned")])
    _run(s, 60, cordon)  # the second episode is owed, the cooldown holds it
    r = make()
    r.load_state_dict(s.state_dict())
    ds = [r.observe(i, 1.0, system=cordon(i), now=STEP_S * i) for i in range(61, 200)]
    assert _emergencies(ds) == [101]


# --------------------------------------------------------------------------- hazard decay

RISK = RiskSpec(mtbf_seconds=3600.0, warned_fraction=0.5, warning_mtbf_seconds=120.0)
"""Calm multiplier 0.5; warned 3600/120 = 30; the warning's age decays it past 120 s."""


def _decay(age: float) -> float:
    return 30.0 * math.exp(-(age - 120.0) / 120.0)


@pytest.mark.parametrize(
    ("age", "hazard", "warned", "system"),
    [
        (0.0, 30.0, True, 0.25),
        (60.0, 30.0, True, 0.25),
        (120.0, 30.0, True, 0.25),
        (240.0, _decay(240.0), True, 0.25),  # 30/e ≈ 11
        (480.0, _decay(480.0), True, 0.25),  # ≈ 1.5
        (600.0, _decay(600.0), True, 0.25),  # ≈ 0.55, still above calm
        # 30·e^(−(age−120)/120) ≤ 0.5 from age 120·(1 + ln 60) ≈ 611 s: the warning ends
        (620.0, 0.5, False, 0.0),
        (3600.0, 0.5, False, 0.0),
    ],
)
def test_a_warning_that_holds_decays_and_ends(
    age: float, hazard: float, warned: bool, system: float
) -> None:
    s = make(risk=RISK)
    s.observe(0, 1.0, now=0.0)
    ds = _run(s, int(age / STEP_S) + 1, lambda i: SystemSignals(node_warning="cordoned"))
    d = ds[-1]
    assert d.hazard == pytest.approx(hazard)
    assert (d.warning is not None) is warned
    assert d.components["system"] == system


def test_a_new_alarm_or_request_restarts_the_decay() -> None:
    s = make(risk=RISK)
    cordon = SystemSignals(node_warning="cordoned")
    for i in range(1, 400):  # 800 s of the same cordon: decayed out
        d = s.observe(i, 1.0, system=cordon, now=STEP_S * i)
    assert d.warning is None and d.hazard == pytest.approx(0.5)
    # a taint arrives on the cordoned node: a new warning at full strength, and a save
    d = s.observe(400, 1.0, system=SystemSignals(node_warning="tainted"), now=800.0)
    assert (d.hazard, d.emergency, d.warning) == (30.0, True, "node warning: tainted")
    for i in range(401, 800):
        d = s.observe(i, 1.0, system=cordon, now=STEP_S * i)
    assert d.warning is None
    # a new warning request (the operator's next request id) restarts it too
    s.request_emergency("node NotReady", warning=True)
    d = s.observe(800, 1.0, system=cordon, now=1600.0)
    assert d.hazard == 30.0 and d.emergency and d.warning == "node NotReady"


def test_a_warning_that_lapses_and_rises_again_starts_a_new_age() -> None:
    s = make(risk=RISK)
    _run(s, 200, lambda i: SystemSignals(node_warning="cordoned"))  # 400 s: decaying
    assert s.hazard_at(400.0).multiplier == pytest.approx(_decay(398.0))  # since step 1, 2 s
    # calm for longer than warningHoldSeconds (60 s), then warned again: full strength
    s.observe(201, 1.0, now=402.0)
    d = s.observe(260, 1.0, system=SystemSignals(node_warning="cordoned"), now=520.0)
    assert d.hazard == 30.0 and d.emergency
