"""The failure hazard the pulse interval is sized for (pure, no I/O).

Failures arrive at a baseline rate ``1/M`` (``risk.mtbfSeconds``, refined by
:meth:`~ckpt_agent.decide.scheduler.AdaptiveScheduler.set_mtbf`). A share
``w`` of them is announced by a *warning*: the system layer firing (new GPU
errors, sustained storage latency, a node warning from the operator). So:

* while **calm**, only unannounced failures threaten work: the rate is
  ``(1 − w)/M`` (hazard multiplier ``1 − w``, at most 1);
* while a **warning holds** (the system layer fired, or a request came
  through ``request_emergency(..., warning=True)``, within the last
  ``risk.warningHoldSeconds``) a failure is expected within
  ``risk.warningMtbfSeconds``: the rate is ``1/warning_mtbf`` (multiplier
  ``M / warning_mtbf``, at least 1).

A warning that holds longer than ``warning_mtbf`` without a failure is less
and less likely to announce one (a node cordoned for maintenance for hours): past
that age the warned multiplier decays as ``exp(−(age − warning_mtbf)/warning_mtbf)``
and the warning *ends* (calm hazard, no warning recorded) once it falls to the
calm multiplier ``c`` — ``warning_mtbf · (1 + ln(M/(warning_mtbf·c)))`` after it
began (9–10 min for M one hour, warning_mtbf 120 s, c 1 or 0.5). The age counts
from the episode's start: the warning rising after it lapsed, a new alarm (another
node warning, new GPU errors, the latency becoming sustained) or a new warning
request.

The pulse interval is the Young/Daly optimum ``√(2·δ·M/hazard)``
(:func:`~ckpt_agent.decide.intervals.pulse_interval`): it shrinks while a
warning holds and relaxes after. ``w`` is ``risk.warnedFraction`` when set,
else learned: warning episodes seen per expected failure in the observed
time, ``episodes / (observed/M + 1)`` (the +1 keeps it low until there is
evidence), at most ``risk.maxWarnedFraction``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_agent.policy.scheduler_models import RiskSpec

__all__ = ["Hazard", "HazardModel"]

_WARNING_CHARS = 200
"""A warning's text is cut to this many characters (it travels in every decision)."""


@dataclass(frozen=True)
class Hazard:
    """The hazard at one step."""

    multiplier: float
    """Failure rate relative to ``1/mtbf``: ``1 − w`` calm, ``mtbf/warning_mtbf`` warned."""
    warning: str | None = None
    """The warning that holds (None: calm)."""


class HazardModel:
    """Warning state and the learned share of announced failures."""

    def __init__(self, spec: RiskSpec) -> None:
        self.spec = spec
        self.warning: str | None = None
        """Why the last warning fired (kept while it holds)."""
        self.warning_until: float | None = None
        """Wall time until which the last warning holds."""
        self.since: float | None = None
        """Wall time the current warning episode began (its age decays the hazard)."""
        self.episodes = 0
        """Warnings seen (a warning that holds again after it lapsed is a new one)."""
        self.observed_seconds = 0.0
        """Wall seconds of training observed (the exposure the episodes are counted in)."""

    def holds(self, now: float) -> bool:
        until = self.warning_until
        return until is not None and now < until

    def update(self, fired: bool, why: str, now: float, *, fresh: bool = False) -> None:
        """Fold the system layer's verdict at ``now`` in (``fresh``: a new alarm or
        request: the warning's age starts again)."""
        if not fired:
            return
        if not self.holds(now):
            self.episodes += 1
            self.since = now
        elif fresh or self.since is None:
            self.since = now
        self.warning = (why or "system alarm")[:_WARNING_CHARS]
        self.warning_until = now + max(self.spec.warning_hold_seconds, 1e-9)

    def observe_seconds(self, seconds: float) -> None:
        """``seconds`` of training went by (non-finite and negative values are ignored)."""
        if math.isfinite(seconds) and seconds > 0:
            self.observed_seconds += seconds

    def warned_fraction(self, mtbf: float) -> float:
        """Share of failures a warning announces (set, or learned)."""
        spec = self.spec
        if spec.warned_fraction is not None:
            return spec.warned_fraction
        expected = self.observed_seconds / mtbf + 1.0
        return min(spec.max_warned_fraction, self.episodes / expected)

    def at(self, now: float, mtbf: float) -> Hazard:
        """The hazard at ``now`` for a baseline MTBF ``mtbf``."""
        return Hazard(*self.level(now, mtbf))

    def level(self, now: float, mtbf: float) -> tuple[float, str | None]:
        """:meth:`at` as ``(multiplier, warning)`` (the scheduler's every step: no object)."""
        spec = self.spec
        if spec.warned_fraction is not None:  # warned_fraction(), inlined
            share = spec.warned_fraction
        else:
            share = min(
                spec.max_warned_fraction, self.episodes / (self.observed_seconds / mtbf + 1.0)
            )
        calm = max(1.0 - share, 1e-6)
        until = self.warning_until
        if until is None or not now < until:  # not holds(now)
            return calm, None
        scale = spec.warning_mtbf_seconds
        warned = max(1.0, mtbf / scale)
        age = now - (now if self.since is None else self.since)
        if age <= scale:
            return warned, self.warning
        decayed = warned * math.exp(-(age - scale) / scale)
        return (decayed, self.warning) if decayed > calm else (calm, None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "warning": self.warning,
            "warning_until": self.warning_until,
            "warning_since": self.since,
            "warning_episodes": self.episodes,
            "observed_seconds": self.observed_seconds,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.warning = state.get("warning")
        until = state.get("warning_until")
        self.warning_until = None if until is None else float(until)
        since = state.get("warning_since")
        self.since = None if since is None else float(since)
        self.episodes = int(state.get("warning_episodes", 0))
        self.observed_seconds = float(state.get("observed_seconds", 0.0))
