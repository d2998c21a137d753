"""The fixed baselines keep the scheduler's full tier: same rules, event by event."""

from __future__ import annotations

import pytest

from ckpt_agent.decide.decision import SaveOutcome
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.sim_policies import FixedPolicy
from ckpt_agent.decide.simulate import Costs, replay, replay_fixed
from ckpt_agent.decide.traces import poisson_trace, training_curves
from ckpt_agent.policy.models import FullTierSpec, PulseTierSpec, Tier, TiersSpec
from ckpt_agent.policy.scheduler_models import RiskSpec, SchedulerSpec

CURVES = training_curves(40_000, seed=1)


@pytest.mark.parametrize(("every", "full_every"), [(7, 40), (102, 1000), (98, 1000), (50, 100)])
@pytest.mark.parametrize("seed", [1, 2])
def test_event_driven_fixed_replay_with_fulls_matches_the_step_loop(
    every: int, full_every: int, seed: int
) -> None:
    trace = poisson_trace("p", mtbf=2000.0, horizon=60_000.0, warned=0.5, seed=seed)
    a = replay(trace, FixedPolicy("f", every, full_every), CURVES, Costs())
    b = replay_fixed(trace, every, Costs(), "f", full_every)
    assert (a.saves, a.failures) == (b.saves, b.failures)
    assert a.lost_s == pytest.approx(b.lost_s)
    assert a.stall_s == pytest.approx(b.stall_s)


@pytest.mark.parametrize(("every", "full_every"), [(102, 1000), (98, 1000), (30, 100), (7, 40)])
def test_fixed_policy_saves_where_the_scheduler_does(every: int, full_every: int) -> None:
    """A fixed pulse interval under the real scheduler's tier rules: the same save steps."""
    tiers = TiersSpec(
        pulse=PulseTierSpec(base_interval=every, min_interval=every, max_interval=every),
        full=FullTierSpec(every_steps=full_every),
    )
    s = AdaptiveScheduler(SchedulerSpec(risk=RiskSpec(enabled=False)), tiers, start_time=0.0)
    fixed = FixedPolicy("f", every, full_every)
    got, want = [], []
    for step in range(3 * full_every + 1):  # the scheduler counts from its first step
        d = s.observe(step, 1.0, now=float(step))
        if d.tier in (Tier.PULSE, Tier.FULL):
            s.settle(SaveOutcome.taken(d, stall_seconds=0.0))
            got.append((step, d.tier == Tier.FULL))
        if fixed.decide(step, float(step), 1.0, 1.0, None) is not None:
            want.append((step, fixed.last_full == step))
    assert got == want


def test_plain_fixed_interval_is_unchanged() -> None:
    trace = poisson_trace("p", mtbf=2000.0, horizon=60_000.0, warned=0.0, seed=3)
    plain = replay_fixed(trace, 102, Costs())
    assert plain.saves == replay(trace, FixedPolicy("fixed", 102), CURVES, Costs()).saves
    # with the full tier's cadence the same pulse interval saves more often
    assert replay_fixed(trace, 102, Costs(), full_every=1000).saves > plain.saves
