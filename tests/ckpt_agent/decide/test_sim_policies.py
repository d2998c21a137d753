"""The simulator's policies (decide.sim_policies): the full-tier rule, fixed and refined policies."""

from __future__ import annotations

import pytest

from ckpt_agent.decide.mtbf import estimate_mtbf
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.sim_policies import SAVE, FixedPolicy, RefinedPolicy, full_now
from ckpt_agent.policy.scheduler_models import RiskSpec, SchedulerSpec


@pytest.mark.parametrize(
    ("since_save", "since_full", "every", "full_every", "full"),
    [
        (10, 10, 10, None, False),  # no full tier
        (3, 100, 10, 100, True),  # the full is due
        (10, 98, 10, 100, True),  # a pulse due with the full 2 steps away (<= 10/4): the full
        (10, 90, 10, 100, False),  # 10 steps away: a pulse
        (5, 98, 10, 100, False),  # no pulse due yet, the full not yet due
    ],
)
def test_full_now_is_the_schedulers_full_tier_rule(
    since_save: int, since_full: int, every: int, full_every: int | None, full: bool
) -> None:
    assert full_now(since_save, since_full, every, full_every) is full


def test_a_fixed_policy_saves_every_n_steps_and_resumes_from_its_snapshot() -> None:
    p = FixedPolicy("f", 3)
    asked = [p.decide(step, 0.0, 1.0, 1.0, None) for step in range(1, 10)]
    assert [i + 1 for i, a in enumerate(asked) if a == SAVE] == [3, 6, 9]
    snap = p.snapshot()
    p.decide(12, 0.0, 1.0, 1.0, None)
    p.restore(snap)
    assert p.decide(11, 0.0, 1.0, 1.0, None) is None and p.decide(12, 0.0, 1.0, 1.0, None) == SAVE


def test_the_refined_policy_starts_at_the_prior_and_refines_at_each_restart() -> None:
    policy = RefinedPolicy("r", lambda: AdaptiveScheduler(SchedulerSpec(), start_time=0.0))
    assert policy.scheduler.mtbf_seconds == RiskSpec().mtbf_seconds == 86_400
    policy.decide(1, 1000.0, 1.0, 1.0, None)
    policy.restore(None)  # the first failure, at 1,000 s: a fresh start
    assert policy.scheduler.mtbf_seconds == pytest.approx(estimate_mtbf(86_400, 1, 1000.0))
    snap = policy.snapshot()
    policy.decide(2, 4000.0, 1.0, 1.0, None)
    policy.restore(snap)  # the second, at 4,000 s: resumed from a save, then refined
    assert policy.scheduler.mtbf_seconds == pytest.approx(estimate_mtbf(86_400, 2, 4000.0))
    assert policy.scheduler.mtbf_seconds == pytest.approx((86_400 + 4000) / 3)
