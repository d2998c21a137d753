"""Builders shared by the decide tests (importable by name: conftest.py puts this folder
on ``sys.path``).

* checkpoint records for the retention and recovery tables: :func:`record` and the
  status shorthands ``V, C, P, E``;
* schedulers and step feeds for the scheduler tests: :func:`make`, :func:`feed`, the
  gradient baseline, and the ``settle`` outcomes they use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckpt_agent.decide.decision import Decision, SaveOutcome
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.policy.models import (
    FullTierSpec,
    HeartbeatTierSpec,
    MemoryTierSpec,
    PulseTierSpec,
    Tier,
    TiersSpec,
)
from ckpt_agent.policy.scheduler_models import (
    GradientLayerSpec,
    LossLayerSpec,
    RiskSpec,
    SchedulerSpec,
    SystemLayerSpec,
)
from ckpt_agent.records import CheckpointRecord, CheckpointStatus

# --------------------------------------------------------------------------- records

V, C, P, E = (
    CheckpointStatus.VALID,
    CheckpointStatus.CORRUPTED,
    CheckpointStatus.PENDING,
    CheckpointStatus.EXPIRED,
)
TIERS = {"h": Tier.HEARTBEAT, "p": Tier.PULSE, "f": Tier.FULL}


def record(name: str, status: CheckpointStatus = V, *, score: float = 0.0) -> CheckpointRecord:
    """``record("p300")``: the pulse of step 300 (h = heartbeat, p = pulse, f = full);
    set further fields with :func:`dataclasses.replace`."""
    return CheckpointRecord(
        id=name, step=int(name[1:]), tier=TIERS[name[0]], status=status, score=score
    )


# --------------------------------------------------------------------------- schedulers


def make(
    *,
    loss: LossLayerSpec | None = None,
    gradient: GradientLayerSpec | None = None,
    system: SystemLayerSpec | None = None,
    risk: RiskSpec | None = None,
    pulse_now_score: float = 0.7,
    pulse: PulseTierSpec | None = None,
    full: FullTierSpec | None = None,
    heartbeat: HeartbeatTierSpec | None = None,
    memory: MemoryTierSpec | None = None,
    start_time: float = 0.0,
) -> AdaptiveScheduler:
    """A scheduler with default specs except the ones given."""
    spec = SchedulerSpec(
        loss=loss or LossLayerSpec(),
        gradient=gradient or GradientLayerSpec(),
        system=system or SystemLayerSpec(),
        risk=risk or RiskSpec(),
        pulse_now_score=pulse_now_score,
    )
    tiers = TiersSpec(
        pulse=pulse or PulseTierSpec(),
        full=full or FullTierSpec(),
        heartbeat=heartbeat or HeartbeatTierSpec(),
        memory=memory or MemoryTierSpec(),
    )
    return AdaptiveScheduler(spec, tiers, start_time=start_time)


def feed(
    s: AdaptiveScheduler, losses: Iterable[float], *, start: int = 0, dt: float = 1.0
) -> list[Decision]:
    """Observe ``losses`` at consecutive steps from ``start``, ``dt`` seconds apart."""
    return [s.observe(start + i, x, now=(start + i) * dt) for i, x in enumerate(losses)]


def tiers_of(ds: Iterable[Decision], tier: Tier) -> list[int]:
    """Steps whose decision carries ``tier``."""
    return [d.step for d in ds if d.tier == tier]


def loss_fired(ds: Sequence[Decision]) -> list[int]:
    """Steps where the loss layer fired."""
    return [d.step for d in ds if d.components["loss"] > 0]


GRAD = GradientLayerSpec(sample_every=1, min_samples=4, history=50)
# mean 1.1, std 0.058: single samples poke out (±1 std is sensitive), never two in a row
BASELINE = [1.0, 1.1, 1.1, 1.2, 1.1, 1.1] * 2
N = len(BASELINE)


def feed_grads(s: AdaptiveScheduler, grads: Iterable[float], *, start: int = 0) -> list[Decision]:
    """Observe loss 1.0 with gradient norms ``grads`` at consecutive steps from ``start``."""
    return [
        s.observe(start + i, 1.0, grad_norm=g, now=float(start + i)) for i, g in enumerate(grads)
    ]


def one_anomaly(s: AdaptiveScheduler) -> None:
    """:data:`BASELINE` then one anomalous sample: the next anomalous one fires the layer."""
    feed_grads(s, [*BASELINE, 2.0])


def pulse_at(step: int, *, lightweight: bool = False) -> Decision:
    """A pulse decision at ``step``."""
    return Decision(step=step, save=True, tier=Tier.PULSE, lightweight=lightweight)


def memory_at(step: int, tier: Tier | None = None) -> Decision:
    """A memory-tier snapshot decision at ``step`` (``tier``: what is due durably too)."""
    return Decision(step=step, save=tier is not None, tier=tier, memory=True, memory_interval=5)


def measured(
    s: AdaptiveScheduler,
    *,
    step_time: float | None = 1.0,
    stall: float | None = None,
    persist: float | None = None,
) -> AdaptiveScheduler:
    """Feed a step time and one pulse taken at step 0 with the given costs."""
    if step_time is not None:
        s.record_step_time(step_time)
    s.settle(SaveOutcome.taken(pulse_at(0), stall_seconds=stall, persist_seconds=persist))
    return s
