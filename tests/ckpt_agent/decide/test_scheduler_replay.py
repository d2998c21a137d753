"""The scheduler's per-step fast path changes no decision (#27).

:meth:`AdaptiveScheduler.observe` answers steps where at most the heartbeat is due
without the full ``TierCounters.due`` / ``Decision(...)`` path. Two proofs, over long
seeded sequences of every kind of input (:mod:`scheduler_replay`):

* **golden**: the digest of every decision and every state dict of a run equals the
  one recorded with the scheduler as it was before the fast path (commit b4a97a2; CPython
  3.11, x86-64 glibc: ``math.log10``/``exp`` are the platform's);
* **quiet path vs full path**: the same run with the fast path switched off gives the
  same lines, call by call (independent of the platform), and the fast path did answer
  most steps (the comparison is not vacuous).
"""

from __future__ import annotations

import sys

import pytest
from scheduler_replay import CONFIGS, digest, replay, scheduler

from ckpt_agent.decide.decision import Decision
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.tiers import TierCounters
from ckpt_agent.policy.models import Tier

STEPS = 3000

GOLDEN = {
    ("defaults", 1): "cf4617858276f4d9c60dc0d29e78b007b2cbed2566f9eff4d40d17613075b180",
    ("defaults", 2): "6d891a8aa8a1de7d458f9f8833934701b397c758efad2bfdb4f89e4942ef7073",
    ("busy", 1): "30d8a6fb98863e8eabcb8d52c35f83a8298bbb30a7d59da2a907490a70c7b137",
    ("busy", 2): "a7f4a239f3b402e5e0a91a63030e3e851f2c3aeeddafb0555a6606006f72df3c",
    (
        "no risk, no heartbeat",
        1,
    ): "7d092385aab84691a04b32df90bf9d64a20a3c2c490d3808d06268917879675b",
    (
        "no risk, no heartbeat",
        2,
    ): "43dea70d0164201568d3043ad4e97baf8c084fc10f014f4a98fb7f23f9503de1",
    # recorded when the memory tier came (#31); the others are from b4a97a2, compared
    # without the memory tier's keys (scheduler_replay.MEMORY_KEYS): with it off, nothing
    # changed
    ("memory tier", 1): "410e616eb131b16cdd619c77491f01c126145057a0a0f4f05054fa7dd667dad5",
    ("memory tier", 2): "11d598c2ebb0aee6e976c86de513a3d95116bd0c7426d00a0fd6679d3c64e04a",
    ("warned share set", 1): "efc1f78b174440450e05b0c113b788be73b663ed478ca76909d440e3d57b1624",
    ("warned share set", 2): "e1dc31014a6e58a61d04920cfa665cbf82e3a92fcd7346f6911843b457b9cc86",
}


@pytest.mark.parametrize(("config", "seed"), sorted(GOLDEN))
def test_decisions_and_state_match_the_recorded_run(config: str, seed: int) -> None:
    assert digest(lambda: scheduler(config), seed, STEPS) == GOLDEN[(config, seed)]


def _full_path(config: str) -> AdaptiveScheduler:
    s = scheduler(config)
    s._quiet_path = False
    return s


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_quiet_path_gives_what_the_full_path_gives(
    config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = list(replay(lambda: _full_path(config), 3, STEPS))
    answered = {"due": 0}
    real_due = TierCounters.due

    def counted(self: TierCounters, *args: object, **kw: object) -> object:
        answered["due"] += 1
        return real_due(self, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(TierCounters, "due", counted)
    fast = list(replay(lambda: scheduler(config), 3, STEPS))
    for i, (a, b) in enumerate(zip(fast, full, strict=True)):
        assert a == b, f"call {i} differs:\nfast: {a}\nfull: {b}"
    observed = sum(1 for line in fast if line.startswith('{"anomaly"'))
    assert answered["due"] < observed / 3  # the fast path answered most steps


def test_quick_decision_is_the_decision_init_builds() -> None:
    for tier in (None, Tier.HEARTBEAT):
        args = dict(
            step=7,
            tier=tier,
            score=0.4,
            components={"loss": 0.4, "gradient": 0.0, "system": 0.0},
            interval=12,
            interval_rule="score",
            reason="nothing due",
            anomaly="loss_spike",
            hazard=0.5,
            warning=None,
        )
        quick = Decision.quick(**args)  # type: ignore[arg-type]
        built = Decision(save=tier is not None, **args)  # type: ignore[arg-type]
        assert quick == built
        assert repr(quick) == repr(built)
        assert quick.to_json_line() == built.to_json_line()
        assert sys.getsizeof(vars(quick)) <= sys.getsizeof(vars(built))  # keys shared too
        with pytest.raises(AttributeError):  # still frozen
            quick.step = 8  # type: ignore[misc]
