"""Facts about a run the operator hands its pods (pure): when the run started, its MTBF.

The agent's scheduler sizes checkpoint intervals by the mean time between
failures and tightens them for long runs (``longRunAfterHours``, counted from
the run's start). A restarted pod would otherwise start both from scratch: the
operator knows when the chain's first job was created and how often the run
failed, and passes both (``CKPT_RUN_STARTED_AT``, ``CKPT_MTBF_SECONDS``). The MTBF
blends the policy's prior with the run's failures and its node pool's
(:func:`ckpt_agent.decide.mtbf.estimate_mtbf`, shared with the simulator).
"""

from __future__ import annotations

import math

from ckpt_agent.policy.agent_config import (
    ENV_MTBF_SECONDS,
    ENV_RESUME_PIN,
    ENV_RESUME_WEIGHTS,
    ENV_RUN_STARTED_AT,
)
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import JobFacts

__all__ = [
    "agent_run_env",
    "mtbf_of",
    "run_started_at",
]


def _positive(raw: str | None) -> float | None:
    try:
        value = float(raw or "")
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def run_started_at(facts: JobFacts) -> float | None:
    """When the run's first job was created: carried along the chain, else this job's
    creation time (None: unknown)."""
    carried = _positive(facts.annotations.get(c.ANN_RUN_STARTED_AT))
    return carried if carried is not None else facts.created_at


def mtbf_of(facts: JobFacts) -> float | None:
    """The estimate the job carries (None: none yet; the policy's applies)."""
    return _positive(facts.annotations.get(c.ANN_MTBF_SECONDS))


def agent_run_env(facts: JobFacts) -> dict[str, str]:
    """What the job's pods get besides the policy: the weights of a heartbeat rebuild, a
    manual restart's pin identity, the run's start time and MTBF (only those known)."""
    env = {
        ENV_RESUME_WEIGHTS: facts.annotations.get(c.ANN_RESUME_WEIGHTS, ""),
        ENV_RESUME_PIN: facts.annotations.get(c.ANN_RESUME_PIN, ""),
    }
    started = run_started_at(facts)
    if started is not None:
        env[ENV_RUN_STARTED_AT] = f"{started:.0f}"
    mtbf = mtbf_of(facts)
    if mtbf is not None:
        env[ENV_MTBF_SECONDS] = f"{mtbf:.6g}"
    return {k: v for k, v in env.items() if v}
