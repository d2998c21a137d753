"""The dynamic pulse interval and the measured costs it depends on (pure, no I/O).

Pulse interval (steps), applied in this order; the last rule that changed it
is :attr:`~ckpt_agent.decide.decision.Decision.interval_rule` (one of
:data:`INTERVAL_RULES`):

1. ``base · (1 − min(score, max_interval_score))`` (rule ``base`` when the
   score is 0, else ``score``);
2. Young/Daly cap: ``τ = √(2·δ·M)`` seconds with δ the measured pulse cost
   (stall + persist) and M the MTBF, converted to steps with the measured
   step time; applied when lower (rule ``young_daly``);
3. stall-budget floor: ``⌈stall / (budget · step_time)⌉`` so that pulses
   stall at most ``budget`` of training time; applied when higher (rule
   ``stall_budget``);
4. hard clamp to ``[min_interval, max_interval]`` (rules ``min`` / ``max``):
   the policy's bounds always win, so a pulse is taken at least every
   ``max_interval`` steps.

Rules 2 and 3 apply only when ``risk.enabled`` and the step time is known.
:class:`CostModel` keeps the inputs: the MTBF, the step time (an EWMA of wall
time per step minus save stalls) and per-tier EWMAs of stall and persist seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_agent.decide.signals import ewma, finite
from ckpt_agent.policy.models import PulseTierSpec, SchedulerSpec, Tier

__all__ = ["INTERVAL_RULES", "CostModel", "SaveCost", "pulse_interval"]

INTERVAL_RULES = ("base", "score", "young_daly", "stall_budget", "min", "max")
"""Values of :attr:`~ckpt_agent.decide.decision.Decision.interval_rule`."""

_COST_ALPHA = 0.3
"""EWMA factor for measured save costs."""
_STEP_TIME_ALPHA = 0.2
"""EWMA factor for the measured step time."""


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
        self.stall_since_step = 0.0
        """Save stalls since the last measured step (not training time)."""

    def record_step_time(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            self.step_time = (
                seconds
                if self.step_time is None
                else ewma(self.step_time, seconds, _STEP_TIME_ALPHA)
            )

    def measure_steps(self, wall_seconds: float, steps: int) -> None:
        """``steps`` steps took ``wall_seconds``; save stalls since the last call are excluded."""
        dt = (wall_seconds - self.stall_since_step) / steps
        if dt > 0 and math.isfinite(dt):
            self.record_step_time(dt)

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
        }

    def load_state_dict(self, state: Mapping[str, Any], *, default_mtbf: float) -> None:
        self.mtbf = float(state.get("mtbf", default_mtbf))
        self.step_time = state.get("step_time")
        self.costs = {t: SaveCost() for t in Tier}
        self.stall_since_step = 0.0
        for name, c in dict(state.get("costs", {})).items():
            self.costs[Tier(name)] = SaveCost(stall=c.get("stall"), persist=c.get("persist"))


def pulse_interval(
    score: float, spec: SchedulerSpec, pulse: PulseTierSpec, model: CostModel
) -> tuple[int, str]:
    """The dynamic pulse interval for ``score`` and the rule that set it."""
    capped = min(max(score, 0.0), spec.max_interval_score)
    interval = max(1, int(pulse.base_interval * (1.0 - capped) + 0.5))
    rule = "base" if score <= 0 else "score"
    risk = spec.risk
    st = model.step_time
    cost = model.costs[Tier.PULSE]
    if risk.enabled and st is not None and st > 0:
        delta = cost.total
        if delta is not None and delta > 0:
            tau = math.sqrt(2.0 * delta * model.mtbf)
            yd = max(1, math.floor(tau / st))
            if yd < interval:
                interval, rule = yd, "young_daly"
        if cost.stall is not None and cost.stall > 0:
            floor = math.ceil(cost.stall / (risk.stall_budget * st) - 1e-9)
            if floor > interval:
                interval, rule = floor, "stall_budget"
    if interval < pulse.min_interval:
        interval, rule = pulse.min_interval, "min"
    elif interval > pulse.max_interval:
        interval, rule = pulse.max_interval, "max"
    return interval, rule
