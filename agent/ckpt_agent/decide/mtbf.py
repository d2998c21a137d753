"""The run's MTBF estimate from the policy's prior, the run's failures and its node pool's
(pure, no I/O; the operator computes it at every restart, the simulator replays it).

A gamma-prior posterior mean of the failure rate, written as an MTBF::

    M = (w₀·prior + T_pool + T_run) / (w₀ + n_pool + n_run)

* ``prior``: the policy's ``risk.mtbfSeconds``, worth :data:`PRIOR_FAILURES` failures;
* ``n_run`` failures of this run in ``T_run`` seconds since it started;
* the node pool's evidence (:class:`PoolEvidence`): failures of *other* runs on the same
  node pool, ``n_pool`` in ``node_seconds`` node-seconds of running, converted to this
  run's size (``T_pool = node_seconds / nodes``: a run on ``k`` nodes fails ``k`` times
  as often as one on a single node) and capped at :data:`POOL_MAX_FAILURES` failures'
  worth (both scaled down together, keeping the pool's rate), so that a busy pool
  informs a new run's first restarts and the run's own failures soon outweigh it.

Without failures of the run or the pool (``n_run + n_pool ≤ 0``) the prior stands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["POOL_MAX_FAILURES", "PRIOR_FAILURES", "PoolEvidence", "estimate_mtbf"]

PRIOR_FAILURES = 1.0
"""How many failures' worth of weight the policy's ``mtbfSeconds`` carries."""
POOL_MAX_FAILURES = 4.0
"""The most failures' worth of weight the node pool's evidence carries."""


@dataclass(frozen=True)
class PoolEvidence:
    """What other runs on the run's node pool showed."""

    failures: float
    """Their failures (a failure of a run spread over several pools counts in shares)."""
    node_seconds: float
    """Their running time, summed over their nodes on the pool."""
    nodes: int
    """The nodes this run runs on (its pool exposure is ``node_seconds / nodes``)."""

    def weighed(self, prior_s: float) -> tuple[float, float]:
        """(failures, seconds of this run's exposure), capped at :data:`POOL_MAX_FAILURES`
        failures' worth (exposure counts ``prior_s`` seconds per failure's worth)."""
        n = self.failures if math.isfinite(self.failures) and self.failures > 0 else 0.0
        seconds = self.node_seconds / max(self.nodes, 1)
        t = seconds if math.isfinite(seconds) and seconds > 0 else 0.0
        worth = max(n, t / prior_s)
        scale = min(1.0, POOL_MAX_FAILURES / worth) if worth > 0 else 1.0
        return n * scale, t * scale


def estimate_mtbf(
    prior_s: float, failures: int, elapsed_s: float, pool: PoolEvidence | None = None
) -> float:
    """The policy's MTBF blended with what the run showed: ``failures`` failures in
    ``elapsed_s`` seconds since it started, and with its node ``pool``'s evidence (see
    the module docstring)."""
    n_pool, t_pool = pool.weighed(prior_s) if pool is not None else (0.0, 0.0)
    n_run = max(failures, 0)
    t_run = elapsed_s if n_run > 0 and math.isfinite(elapsed_s) and elapsed_s > 0 else 0.0
    if n_run > 0 and t_run <= 0:
        n_run = 0  # failures with no known time: no evidence
    if n_run + n_pool <= 0:
        return prior_s
    return (PRIOR_FAILURES * prior_s + t_pool + t_run) / (PRIOR_FAILURES + n_pool + n_run)
