"""The MTBF blend the operator hands a restarted run: prior, the run's failures, its pool's."""

from __future__ import annotations

import math

import pytest

from ckpt_agent.decide.mtbf import POOL_MAX_FAILURES, PRIOR_FAILURES, PoolEvidence, estimate_mtbf

H = 3600.0
P = 86_400.0
"""The policy's default prior."""


@pytest.mark.parametrize(
    ("failures", "elapsed", "pool", "expected"),
    [
        # nothing observed: the prior stands
        (0, 1000.0, None, P),
        (-1, 1000.0, None, P),
        (3, 0.0, None, P),  # failures with no known time are no evidence
        (3, -5.0, None, P),
        (3, math.nan, None, P),
        (3, math.inf, None, P),
        # the run's failures: (w₀·prior + T) / (w₀ + n)
        (1, H, None, (P + H) / 2),
        (9, 9 * H, None, (P + 9 * H) / 10),
        # the pool: 2 failures in 10 node-hours, this run on 1 node
        (0, 0.0, PoolEvidence(2, 10 * H, 1), (P + 10 * H) / 3),
        (1, H, PoolEvidence(2, 10 * H, 1), (P + 10 * H + H) / 4),
        # ... on 5 nodes the run is exposed 5 times as much: 10 node-hours are 2 run-hours
        (1, H, PoolEvidence(2, 10 * H, 5), (P + 2 * H + H) / 4),
        # a pool with 100 failures in 100 node-hours counts 4 failures' worth (its rate kept)
        (1, H, PoolEvidence(100, 100 * H, 1), (P + 4 * H + H) / (1 + 4 + 1)),
        # exposure without failures: at most 4 × the prior's worth of seconds
        (1, H, PoolEvidence(0, 1e9, 1), (P + 4 * P + H) / 2),
        (1, H, PoolEvidence(0, H, 1), (P + H + H) / 2),
        # a pool with nothing in it, or garbage, changes nothing
        (1, H, PoolEvidence(0, 0.0, 1), (P + H) / 2),
        (1, H, PoolEvidence(math.nan, math.inf, 0), (P + H) / 2),
        (1, H, PoolEvidence(-3, -H, 2), (P + H) / 2),
        (0, 0.0, PoolEvidence(0, 1e6, 1), P),  # no failure anywhere: the prior
    ],
)
def test_blend_table(
    failures: int, elapsed: float, pool: PoolEvidence | None, expected: float
) -> None:
    assert estimate_mtbf(P, failures, elapsed, pool) == pytest.approx(expected)


def test_the_weights() -> None:
    assert (PRIOR_FAILURES, POOL_MAX_FAILURES) == (1.0, 4.0)
    assert PoolEvidence(8, 80 * H, 2).weighed(P) == pytest.approx((4.0, 20 * H))
    assert PoolEvidence(1, 2 * H, 1).weighed(P) == pytest.approx((1.0, 2 * H))


def test_the_runs_own_failures_soon_outweigh_its_pool() -> None:
    """A reliable pool (MTBF 100 h per node) and a flaky run (one failure per hour)."""
    pool = PoolEvidence(10, 1000 * H, 1)
    runs = (1, 2, 5, 20, 100, 1000)
    estimates = [estimate_mtbf(P, n, n * H, pool) for n in runs]
    assert estimates == sorted(estimates, reverse=True)  # falling towards the run's rate
    pull = [estimate_mtbf(P, n, n * H, pool) / estimate_mtbf(P, n, n * H) for n in runs]
    assert min(pull[:3]) > 3 and pull[-1] < 1.1  # the pool weighs 4 failures at most
    # a flaky pool (40 failures in 40 node-hours) pulls a run's first estimate down: the
    # prior alone leaves it at half a day
    assert estimate_mtbf(P, 1, H) == 45_000
    assert estimate_mtbf(P, 1, H, PoolEvidence(40, 40 * H, 1)) == pytest.approx(17_400)


def test_a_bigger_run_on_the_same_pool_gets_a_shorter_mtbf() -> None:
    small = estimate_mtbf(P, 1, H, PoolEvidence(4, 40 * H, 1))
    big = estimate_mtbf(P, 1, H, PoolEvidence(4, 40 * H, 8))
    assert big < small
