"""The dynamic pulse interval and the measured costs it depends on (pure, no I/O).

Pulse interval (steps), applied in this order; the last rule that changed it
is :attr:`~ckpt_agent.decide.decision.Decision.interval_rule` (one of
:data:`INTERVAL_RULES`):

1. the starting interval: the Young/Daly optimum ``τ = √(2·δ·M/h)`` seconds,
   converted to steps with the measured step time, with δ the measured pulse
   cost (stall + persist), M the MTBF (with the memory tier: the MTBF of the failures
   it does not cover, ``M / tiers.memory.uncoveredShare``) and h the hazard multiplier
   (:mod:`ckpt_agent.decide.hazard`: below 1 while calm when some failures
   are announced, above 1 while a warning holds); rule ``young_daly``, or
   ``warning`` while a warning holds. Without ``risk.enabled`` or before the
   step time and δ are measured: ``base_interval`` (rule ``base``);
2. the score shrinks it: ``start · (1 − min(score, max_interval_score))``
   (rule ``score`` when the score is above 0);
3. stall-budget floor: ``⌈stall / (budget · step_time)⌉`` so that pulses
   stall at most ``budget`` of training time; applied when higher (rule
   ``stall_budget``);
4. hard clamp to ``[min_interval, max_interval]`` (rules ``min`` / ``max``):
   the policy's bounds always win, so a pulse is taken at least every
   ``max_interval`` steps.

:class:`CostModel` keeps the inputs: the MTBF, the step time (an EWMA of wall
time per step minus save stalls) and per-tier EWMAs of stall and persist seconds
(the memory tier's apart: :attr:`CostModel.memory`).

Memory-tier interval (steps; ``tiers.memory``, :func:`memory_interval`), the rule in
:data:`MEMORY_RULES`: ``everySteps`` when set (``fixed``); else Young/Daly's optimum for
its own cost, ``√(2·δ·M/h)`` with δ the measured stall of a memory snapshot (what it costs
training: the persister records and pushes it off the training thread), converted to steps
(``young_daly``), ``base_interval`` before δ and the step time are measured or without
``risk.enabled`` (``base``); then the same stall-budget floor as the pulse
(``stall_budget``) and the clamp to ``[min_interval, max_interval]`` (``min`` / ``max``).
The replica bandwidth bounds it by back-pressure, not by a rule: a snapshot that finds no
free slot waits for the next step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_agent.decide.signals import ewma, finite
from ckpt_agent.policy.models import MemoryTierSpec, PulseTierSpec, Tier
from ckpt_agent.policy.scheduler_models import SchedulerSpec

__all__ = [
    "INTERVAL_RULES",
    "MEMORY_RULES",
    "CostModel",
    "SaveCost",
    "bound_interval",
    "memory_interval",
    "pulse_interval",
]

INTERVAL_RULES = ("base", "young_daly", "warning", "score", "stall_budget", "min", "max")
"""Values of :attr:`~ckpt_agent.decide.decision.Decision.interval_rule`."""
MEMORY_RULES = ("fixed", "base", "young_daly", "warning", "stall_budget", "min", "max")
"""The rules :func:`memory_interval` may end on."""

_COST_ALPHA = 0.3
"""EWMA factor for measured save costs."""
_STEP_TIME_ALPHA = 0.2
"""EWMA factor for the measured step time."""
_PAUSE_FACTOR = 20.0
"""A step this many times slower than the measured step time is a pause, not a step."""


@dataclass
class SaveCost:
    """EWMA of the measured stall and persist seconds of one tier."""

    stall: float | None = None
    persist: float | None = None

    def add(self, stall: float | None, persist: float | None) -> None:
        """Fold measured seconds in (None, negative and non-finite values are ignored)."""
        if finite(stall) and stall is not None and stall >= 0:
            self.stall = stall if self.stall is None else ewma(self.stall, stall, _COST_ALPHA)
        if finite(persist) and persist is not None and persist >= 0:
            self.persist = (
                persist if self.persist is None else ewma(self.persist, persist, _COST_ALPHA)
            )

    @property
    def total(self) -> float | None:
        if self.stall is None and self.persist is None:
            return None
        return (self.stall or 0.0) + (self.persist or 0.0)


class CostModel:
    """MTBF, measured step time and per-tier save costs."""

    def __init__(self, mtbf: float) -> None:
        self.mtbf = mtbf
        self.step_time: float | None = None
        self.costs: dict[Tier, SaveCost] = {t: SaveCost() for t in Tier}
        self.memory = SaveCost()
        """The memory tier's snapshots (stall; persist: its persister's record time)."""
        self.stall_since_step = 0.0
        """Save stalls since the last measured step (not training time)."""

    def record_step_time(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            prev = self.step_time  # ewma() inlined: this runs every step
            self.step_time = (
                seconds
                if prev is None
                else _STEP_TIME_ALPHA * seconds + (1.0 - _STEP_TIME_ALPHA) * prev
            )

    def measure_steps(self, wall_seconds: float, steps: int) -> bool:
        """``steps`` steps took ``wall_seconds``; save stalls since the last call are excluded.

        False (nothing folded) when that is no step time: a gap over
        :data:`_PAUSE_FACTOR` times the measured step time is a pause (a restart
        from a checkpoint, a suspended job), not training."""
        dt = (wall_seconds - self.stall_since_step) / steps
        if not (dt > 0 and math.isfinite(dt)):
            return False
        if self.step_time is not None and dt > _PAUSE_FACTOR * self.step_time:
            return False
        self.record_step_time(dt)
        return True

    def reset_stall(self) -> None:
        self.stall_since_step = 0.0

    def add_stall(self, stall: float | None) -> None:
        if finite(stall) and stall is not None and stall > 0:
            self.stall_since_step += stall

    def young_daly_steps(self) -> int | None:
        """The uncapped Young/Daly interval in steps, when cost and step time are known."""
        st, delta = self.step_time, self.costs[Tier.PULSE].total
        if st is None or st <= 0 or delta is None or delta <= 0:
            return None
        return max(1, math.floor(math.sqrt(2.0 * delta * self.mtbf) / st))

    def state_dict(self) -> dict[str, Any]:
        """``step_time`` and ``costs`` (the MTBF is stored by the scheduler, first)."""
        return {
            "step_time": self.step_time,
            "costs": {
                t.value: {"stall": c.stall, "persist": c.persist} for t, c in self.costs.items()
            },
            "memory_cost": {"stall": self.memory.stall, "persist": self.memory.persist},
        }

    def load_state_dict(self, state: Mapping[str, Any], *, default_mtbf: float) -> None:
        self.mtbf = float(state.get("mtbf", default_mtbf))
        self.step_time = state.get("step_time")
        self.costs = {t: SaveCost() for t in Tier}
        self.stall_since_step = 0.0
        for name, c in dict(state.get("costs", {})).items():
            self.costs[Tier(name)] = SaveCost(stall=c.get("stall"), persist=c.get("persist"))
        m = dict(state.get("memory_cost") or {})
        self.memory = SaveCost(stall=m.get("stall"), persist=m.get("persist"))


def pulse_interval(
    score: float,
    spec: SchedulerSpec,
    pulse: PulseTierSpec,
    model: CostModel,
    hazard: float = 1.0,
    uncovered: float = 1.0,
) -> tuple[int, str]:
    """The dynamic pulse interval for ``score`` at hazard multiplier ``hazard``, and its rule.
    ``uncovered``: the share of failures the memory tier does not cover (1: no memory tier);
    the Young/Daly interval is sized for their MTBF, ``mtbf / uncovered``."""
    interval, rule = pulse.base_interval, "base"
    yd = _young_daly(spec, model, model.costs[Tier.PULSE].total, hazard, uncovered)
    if yd is not None:
        interval, rule = yd
    if score > 0:
        capped = min(score, spec.max_interval_score)
        interval, rule = max(1, int(interval * (1.0 - capped) + 0.5)), "score"
    return bound_interval(interval, rule, spec, pulse, model)


def bound_interval(
    interval: int, rule: str, spec: SchedulerSpec, pulse: PulseTierSpec, model: CostModel
) -> tuple[int, str]:
    """Rules 3 and 4: the stall-budget floor (with ``risk.enabled``), then the policy's bounds."""
    return _bounded(
        interval,
        rule,
        spec,
        model,
        model.costs[Tier.PULSE].stall,
        (pulse.min_interval, pulse.max_interval),
    )


def _young_daly(
    spec: SchedulerSpec, model: CostModel, delta: float | None, hazard: float, uncovered: float
) -> tuple[int, str] | None:
    """Young/Daly's ``√(2·δ·M/(h·u))`` in steps and its rule (``warning`` while the hazard is
    raised); None without ``risk.enabled`` or before δ and the step time are measured."""
    st = model.step_time
    if not (spec.risk.enabled and st is not None and st > 0 and delta is not None and delta > 0):
        return None
    tau = math.sqrt(2.0 * delta * model.mtbf / (max(hazard, 1e-12) * uncovered))
    return max(1, math.floor(min(tau / st, 1e12))), "warning" if hazard > 1.0 else "young_daly"


def _bounded(
    interval: int,
    rule: str,
    spec: SchedulerSpec,
    model: CostModel,
    stall: float | None,
    bounds: tuple[int, int],
) -> tuple[int, str]:
    """The stall-budget floor for ``stall`` per snapshot (with ``risk.enabled``), then the
    clamp to ``bounds`` (min, max)."""
    st = model.step_time
    if spec.risk.enabled and st is not None and st > 0 and stall is not None and stall > 0:
        floor = math.ceil(stall / (spec.risk.stall_budget * st) - 1e-9)
        if floor > interval:
            interval, rule = floor, "stall_budget"
    lo, hi = bounds
    if interval < lo:
        interval, rule = lo, "min"
    elif interval > hi:
        interval, rule = hi, "max"
    return interval, rule


def memory_interval(
    memory: MemoryTierSpec, spec: SchedulerSpec, model: CostModel, hazard: float = 1.0
) -> tuple[int, str]:
    """The memory tier's interval in steps and its rule (module doc); call it only with
    ``memory.enabled``."""
    if memory.every_steps is not None:
        return memory.every_steps, "fixed"
    stall = model.memory.stall
    interval, rule = _young_daly(spec, model, stall, hazard, 1.0) or (memory.base_interval, "base")
    return _bounded(interval, rule, spec, model, stall, (memory.min_interval, memory.max_interval))
