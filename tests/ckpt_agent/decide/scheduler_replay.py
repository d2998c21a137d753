"""A long, seeded, adversarial sequence of scheduler inputs (importable by name: conftest.py
puts this folder on ``sys.path``), replayed by ``test_scheduler_replay.py``.

Every kind of input :class:`~ckpt_agent.decide.scheduler.AdaptiveScheduler` takes, mixed
by a seeded :class:`random.Random`: plateaus with noise, falling and rising loss (the loss
layer fires), spikes, NaN/inf and negative losses, sampled gradient norms with outlier runs
(the gradient layer fires) and NaN norms, storage latency below and above the threshold
(sustained and not), GPU errors, node warnings that come, change and go, save-now requests
(with and without a warning), skipped steps, rewinds, long pauses, settle outcomes of every
kind (taken with and without costs, deferred, failed, persisted later), MTBF updates,
measured step times, and state-dict round trips through JSON.

:func:`replay` returns one line per call: the decision's JSON line (or the answer of
:meth:`~ckpt_agent.decide.scheduler.AdaptiveScheduler.wants_grad_norm`) and the
scheduler's state dict after it, so two schedulers can be compared step by step and a run
summarized in one digest.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

from ckpt_agent.decide.decision import SaveOutcome
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.signals import SystemSignals
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
    RiskSpec,
    SchedulerSpec,
    SystemLayerSpec,
)

Factory = Callable[[], AdaptiveScheduler]

CONFIGS: dict[str, Callable[[], tuple[SchedulerSpec, TiersSpec]]] = {
    "defaults": lambda: (SchedulerSpec(), TiersSpec()),
    "busy": lambda: (
        SchedulerSpec(
            gradient=GradientLayerSpec(sample_every=3, min_samples=4, std_multiplier=2.0),
            risk=RiskSpec(mtbf_seconds=600.0, warning_mtbf_seconds=30.0, warning_hold_seconds=20.0),
        ),
        TiersSpec(
            heartbeat=HeartbeatTierSpec(every_steps=10),
            pulse=PulseTierSpec(base_interval=20, min_interval=5, max_interval=50),
            full=FullTierSpec(every_steps=200, long_run_every_steps=70, long_run_after_hours=0.05),
        ),
    ),
    "no risk, no heartbeat": lambda: (
        SchedulerSpec(risk=RiskSpec(enabled=False), pulse_now_score=0.3),
        TiersSpec(
            heartbeat=HeartbeatTierSpec(enabled=False),
            pulse=PulseTierSpec(base_interval=15, min_interval=3, max_interval=40),
            full=FullTierSpec(every_steps=120),
        ),
    ),
    "memory tier": lambda: (
        SchedulerSpec(risk=RiskSpec(mtbf_seconds=900.0)),
        TiersSpec(
            heartbeat=HeartbeatTierSpec(every_steps=4),
            pulse=PulseTierSpec(base_interval=40, min_interval=10, max_interval=80),
            full=FullTierSpec(every_steps=300),
            memory=MemoryTierSpec(enabled=True, base_interval=10, min_interval=8, max_interval=20),
        ),
    ),
    "warned share set": lambda: (
        SchedulerSpec(
            system=SystemLayerSpec(
                emergency_tier="pulse", emergency_cooldown_steps=10, sustained_seconds=0.0
            ),
            risk=RiskSpec(warned_fraction=0.5, mtbf_seconds=3600.0),
            pulse_now_score=0.35,
        ),
        TiersSpec(
            heartbeat=HeartbeatTierSpec(every_steps=3),
            pulse=PulseTierSpec(base_interval=30, min_interval=2, max_interval=60),
            full=FullTierSpec(every_steps=90),
        ),
    ),
}


def scheduler(config: str) -> AdaptiveScheduler:
    spec, tiers = CONFIGS[config]()
    return AdaptiveScheduler(spec, tiers, start_time=1000.0)


class _Regime:
    """The loss and signal regime that holds for a stretch of steps."""

    def __init__(self, rng: random.Random) -> None:
        self.kind = rng.choice(["plateau"] * 5 + ["fall", "rise", "noisy", "tiny"])
        self.left = rng.randint(5, 80)
        self.latency = rng.choice([None] * 8 + [3.0, 3.0, 30.0, math.inf, math.nan])
        self.warning = rng.choice([None] * 30 + ["NotReady", "cordoned", "memory pressure"])
        self.grad_bad = rng.random() < 0.2


def _inputs(seed: int, steps: int) -> Iterator[tuple[str, Any]]:
    """The calls of one run: ``("observe", (step, loss, grad, system, now))`` and others."""
    rng = random.Random(seed)
    step, now, loss = 0, 0.0, 2.0
    regime = _Regime(rng)
    for _ in range(steps):
        if regime.left <= 0:
            regime = _Regime(rng)
        regime.left -= 1
        r = rng.random()
        if r < 0.01:
            step = max(0, step - rng.randint(1, 30))  # resumed from an older checkpoint
        elif r < 0.04:
            step += rng.randint(2, 6)
        else:
            step += 1
        now += 1000.0 if rng.random() < 0.005 else rng.uniform(0.2, 2.0)
        factor = {"plateau": 1.0, "fall": 0.8, "rise": 1.3, "noisy": 1.0, "tiny": 1.0}[regime.kind]
        loss = min(max(loss * factor, 1e-6), 1e6)
        noise = 0.3 if regime.kind == "noisy" else 0.05
        value = loss * (1.0 + rng.uniform(-noise, noise))
        if regime.kind == "tiny":
            value = rng.choice([0.0, -0.5, 1e-12, value])
        r = rng.random()
        if r < 0.01:
            value = math.nan
        elif r < 0.015:
            value = rng.choice([math.inf, -math.inf])
        elif r < 0.02:
            value *= 50.0  # a spike
        grad: float | None = None
        if rng.random() < 0.5:
            yield "wants", step
            grad = rng.gauss(1.0, 0.05) * (8.0 if regime.grad_bad and rng.random() < 0.7 else 1.0)
            if rng.random() < 0.01:
                grad = math.nan
        system: SystemSignals | None = None
        if rng.random() < 0.7:
            gpu = 1 if rng.random() < 0.003 else rng.choice([None, 0])
            system = SystemSignals(
                gpu_errors=gpu, write_latency_ms=regime.latency, node_warning=regime.warning
            )
        yield "observe", (step, value, grad, system, now)
        r = rng.random()
        if r < 0.005:
            yield "emergency", ("operator asked", rng.random() < 0.5)
        elif r < 0.01:
            yield "mtbf", rng.choice([600.0, 3600.0, 86400.0])
        elif r < 0.02:
            yield "step_time", rng.choice([0.1, 0.2, math.nan, -1.0])
        elif r < 0.03:
            yield "roundtrip", None
        yield "settle", rng.random()
        if rng.random() < 0.05:
            yield "persisted", (rng.choice([Tier.PULSE, Tier.FULL]), rng.uniform(0.5, 5.0))


def replay(make: Factory, seed: int, steps: int) -> Iterator[str]:
    """Feed one seeded run to a scheduler from ``make``; one line per call."""
    s = make()
    last = None
    for kind, arg in _inputs(seed, steps):
        if kind == "wants":
            assert isinstance(arg, int)
            yield f"wants {arg} {s.wants_grad_norm(arg)}"
            continue
        if kind == "observe":
            step, loss, grad, system, now = arg
            last = s.observe(step, loss, grad, system=system, now=now)
            yield _line(last.to_dict(), s, compact=True)
        elif kind == "emergency":
            reason, warning = arg
            s.request_emergency(reason, warning=warning)
        elif kind == "mtbf":
            s.set_mtbf(float(arg))
        elif kind == "step_time":
            s.record_step_time(float(arg))
        elif kind == "roundtrip":
            state = json.loads(json.dumps(s.state_dict()))
            s = make()
            s.load_state_dict(state)
        elif kind == "settle" and last is not None and last.memory_only:
            r = float(arg)
            if r < 0.7:
                s.settle(SaveOutcome.taken(last, stall_seconds=r / 100))
            elif r < 0.9:
                s.settle(SaveOutcome.deferred(last))
            else:
                s.settle(SaveOutcome.persisted(Tier.PULSE, r, memory=True))
        elif kind == "settle" and last is not None and last.save and last.tier is not None:
            r = float(arg)
            if last.tier is Tier.HEARTBEAT:
                continue
            if r < 0.6:
                s.settle(SaveOutcome.taken(last, stall_seconds=r / 10, persist_seconds=r * 4))
            elif r < 0.7:
                s.settle(SaveOutcome.taken(last))
            elif r < 0.85:
                s.settle(SaveOutcome.deferred(last))
            else:
                s.settle(SaveOutcome.failed(last.tier, step=last.step))
        elif kind == "persisted":
            tier, seconds = arg
            s.settle(SaveOutcome.persisted(tier, seconds))
        else:
            continue
        yield _line(s.state_dict(), s)


MEMORY_KEYS = ("memory", "memory_interval", "last_memory", "memory_retry", "memory_cost")
"""What the memory tier added to decisions and the state (after the goldens were recorded)."""


def _line(data: dict[str, Any], s: AdaptiveScheduler, *, compact: bool = False) -> str:
    """One replay line: sorted JSON; without :data:`MEMORY_KEYS` when the memory tier is
    off, so that a run without it is compared bit for bit with the goldens recorded before
    the tier existed."""
    if not s.tiers.memory.enabled:
        data = {k: v for k, v in data.items() if k not in MEMORY_KEYS}
    if compact:  # Decision.to_json_line's form
        return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return json.dumps(data, sort_keys=True)


def digest(make: Factory, seed: int, steps: int) -> str:
    """SHA-256 of everything :func:`replay` yields (any changed bit of a decision or of the
    state changes it)."""
    h = hashlib.sha256()
    for line in replay(make, seed, steps):
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()
