"""The simulator's "prior then refined" row and the gradient spikes the rules catch."""

from __future__ import annotations

import math

import pytest

from ckpt_agent.decide.benchmark import Case, gradient_spikes_caught, run_case, verdict
from ckpt_agent.decide.sim_policies import REFINED


def test_the_refined_row_is_compared_at_its_own_io() -> None:
    cmp = run_case(Case(600.0, 0.0, seed=5, steps=40_000))
    assert [r.policy for r in cmp.results][:2] == ["adaptive", REFINED]
    refined = cmp.results[1]
    assert cmp.same_io[REFINED].io == pytest.approx(refined.io, rel=0.05)
    assert math.isfinite(cmp.ratio(REFINED))
    # from a prior 144 times the true MTBF the intervals start far too long
    assert refined.avoidable > cmp.results[0].avoidable
    _, lines = verdict([cmp])
    assert f"refined: {cmp.ratio(REFINED):.3f}×, not checked" in lines[0]


def test_the_simulated_gradient_spikes_are_caught_by_every_rule() -> None:
    """The training curves' × 5 gradient-norm spikes (30 steps, at 30,000 and 50,000):
    the gradient layer, sampling every 10 steps, fires on each of them at ±1, 2, 3σ."""
    for k in (1.0, 2.0, 3.0):
        assert gradient_spikes_caught(k, steps=60_000) == (2, 2)
