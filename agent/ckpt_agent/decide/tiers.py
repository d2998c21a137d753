"""Tier counters: which tier is due at a step (pure, no I/O).

* Heartbeat every ``heartbeat.every_steps``; pulse when the steps since the
  last pulse reach the dynamic interval (:mod:`ckpt_agent.decide.intervals`),
  or now when the score *rises* to ``pulse_now_score`` or above; full every
  ``full.every_steps`` steps since the last full, ``full.long_run_every_steps``
  once the run is older than ``full.long_run_after_hours`` of wall time. A
  pulse due when the full comes due within a quarter of the pulse interval
  is taken as the full (one save instead of two a few steps apart).
* A higher tier subsumes the lower ones (full ⊇ pulse ⊇ heartbeat), so the
  decision carries the highest tier due and saving it resets the counters of
  every tier at or below it. A lightweight pulse lacks optimizer state and
  does not reset the pulse counter.
* Pending requests: a failed save's tier (retried at the next step), an
  emergency (system alarm or an explicit request) and a lightweight pulse
  (gradient anomaly).
* On a non-finite *loss* the state may already be poisoned, so weights-bearing
  saves (pulse, full, emergency) are deferred to the next finite step; the
  heartbeat is still written.
* The memory tier (``tiers.memory``, off by default) is apart from the durable ones: a
  memory-tier snapshot is due when the steps since the last snapshot in memory (a memory
  one, or a pulse or full: in flash mode they land in memory too) reach its interval, or
  at the step after one that found no free slot. It resets nothing but its own counter and
  is never due when a pulse or full is (that save covers it) nor on a non-finite loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.policy.models import FullTierSpec, Tier, TiersSpec

__all__ = ["NOTHING_DUE", "Due", "TierCounters", "tier_rank"]

NOTHING_DUE = "nothing due"
"""The reason of a decision that saves nothing (and has no other remark)."""

_TIER_ORDER = {Tier.HEARTBEAT: 0, Tier.PULSE: 1, Tier.FULL: 2}


def tier_rank(tier: Tier | None) -> int:
    """Order of tiers: None < heartbeat < pulse < full."""
    return -1 if tier is None else _TIER_ORDER[tier]  # a StrEnum: its value finds it too


def _full_period(full: FullTierSpec, run_seconds: float) -> tuple[int, str]:
    if run_seconds > full.long_run_after_hours * 3600.0:
        return full.long_run_every_steps, f" (run older than {full.long_run_after_hours:g} h)"
    return full.every_steps, ""


@dataclass
class Due:
    """What :meth:`TierCounters.due` found due at one step."""

    tier: Tier | None = None
    """Highest tier due; None when nothing is due."""
    memory: bool = False
    """A memory-tier snapshot is due (only when the tier is neither pulse nor full)."""
    lightweight: bool = False
    emergency: bool = False
    high_risk: bool = False
    reasons: list[str] = field(default_factory=list)

    def add(self, tier: Tier, why: str) -> None:
        self.reasons.append(f"{tier.value}: {why}")
        if tier_rank(tier) > tier_rank(self.tier):
            self.tier = tier

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons) or NOTHING_DUE


class TierCounters:
    """Last save step of every tier and the pending save requests."""

    def __init__(self) -> None:
        self.last_heartbeat: int | None = None
        self.last_pulse: int | None = None
        self.last_full: int | None = None
        self.last_memory: int | None = None
        """The last snapshot in memory: a memory-tier one, a pulse or a full."""
        self.memory_retry = False
        """A memory-tier snapshot found no free slot: due again at the next step."""
        self.last_emergency: int | None = None
        self.prev_score = 0.0
        """Score at the last finite-loss step (for the pulse-now rising edge)."""
        self.first_step: int | None = None
        """Reference for 'steps since' before any save (reset when the run rewinds)."""
        self.pending_emergency: str | None = None
        self.pending_high_risk = False
        self.pending_emergency_tier = Tier.FULL
        self.pending_lightweight = False
        self.retry_tier: Tier | None = None
        self._heartbeat_reason: tuple[int, str] = (0, "")
        """The heartbeat's reason for its ``every_steps`` (built by :meth:`quiet` once)."""

    # ------------------------------------------------------------------ requests

    def add_emergency(self, reason: str, tier: Tier, *, high_risk: bool = False) -> None:
        pending = self.pending_emergency
        self.pending_emergency = reason if pending is None else f"{pending}; {reason}"
        if pending is None or tier_rank(tier) > tier_rank(self.pending_emergency_tier):
            self.pending_emergency_tier = tier
        if high_risk:
            self.pending_high_risk = True

    def emergency_cooled_down(self, step: int, cooldown_steps: int) -> bool:
        last = self.last_emergency
        return last is None or step - last >= cooldown_steps

    def retry(self, tier: Tier) -> None:
        """A ``tier`` save was not taken or failed: due again (the highest pending wins)."""
        if tier_rank(tier) > tier_rank(self.retry_tier):
            self.retry_tier = tier

    # ------------------------------------------------------------------ saves

    def saved(self, tier: Tier, step: int, *, lightweight: bool, emergency: bool = False) -> None:
        """A ``tier`` save happened at ``step``: reset it and every lower tier."""

        def bump(last: int | None) -> int:
            return step if last is None else max(last, step)

        self.last_heartbeat = bump(self.last_heartbeat)
        if lightweight or tier_rank(tier) >= tier_rank(Tier.PULSE):
            self.pending_lightweight = False
        if not lightweight:
            if tier_rank(tier) >= tier_rank(Tier.PULSE):
                self.last_pulse = bump(self.last_pulse)
                self.last_memory = bump(self.last_memory)
                self.memory_retry = False
            if tier == Tier.FULL:
                self.last_full = bump(self.last_full)
        if self.retry_tier is not None and tier_rank(tier) >= tier_rank(self.retry_tier):
            self.retry_tier = None
        if emergency:
            self.last_emergency = step
            self.pending_emergency = None
            self.pending_high_risk = False

    def saved_memory(self, step: int) -> None:
        """A memory-tier snapshot was taken at ``step``: only its own counter."""
        last = self.last_memory
        self.last_memory = step if last is None else max(last, step)
        self.memory_retry = False

    def rewind(self, step: int) -> None:
        """The run went back to ``step``: no counter stays in the future."""
        self.first_step = step
        if self.last_heartbeat is not None and self.last_heartbeat > step:
            self.last_heartbeat = step
        if self.last_pulse is not None and self.last_pulse > step:
            self.last_pulse = step
        if self.last_full is not None and self.last_full > step:
            self.last_full = step
        if self.last_memory is not None and self.last_memory > step:
            self.last_memory = step
        if self.last_emergency is not None and self.last_emergency > step:
            self.last_emergency = step

    # ------------------------------------------------------------------ what is due

    def _since(self, step: int, last: int | None) -> int:
        """Steps since the last save, else since the first observed step."""
        if last is not None:
            return step - last
        return step - (self.first_step if self.first_step is not None else 0)

    def due(
        self,
        step: int,
        tiers: TiersSpec,
        *,
        interval: int,
        score: float,
        pulse_now_score: float,
        run_seconds: float,
        weights_ok: bool,
        memory_interval: int = 0,
    ) -> Due:
        """The tiers due at ``step`` (``weights_ok``: the loss is finite; ``memory_interval``
        0: the memory tier is off).

        With ``weights_ok`` the score is remembered for the next rising edge.
        """
        due = Due()
        hb = tiers.heartbeat
        if hb.enabled and (
            self.last_heartbeat is None or step - self.last_heartbeat >= hb.every_steps
        ):
            due.add(Tier.HEARTBEAT, f"every {hb.every_steps} step(s)")
        if not weights_ok:
            pending = [
                name
                for name, flag in (
                    ("emergency", self.pending_emergency is not None),
                    ("lightweight pulse", self.pending_lightweight),
                )
                if flag
            ]
            due.reasons.append(
                "non-finite loss: weights-bearing saves deferred"
                + (f" (pending: {', '.join(pending)})" if pending else "")
            )
            return due
        since_pulse = self._since(step, self.last_pulse)
        full_every, long_run = _full_period(tiers.full, run_seconds)
        since_full = self._since(step, self.last_full)
        if since_full >= full_every:
            due.add(Tier.FULL, f"{since_full} steps since last full >= {full_every}" + long_run)
        if since_pulse >= interval:
            due.add(Tier.PULSE, f"{since_pulse} steps since last pulse >= interval {interval}")
            if due.tier == Tier.PULSE and 4 * (full_every - since_full) <= interval:
                due.add(Tier.FULL, f"full due in {full_every - since_full} steps: taken now")
        if score >= pulse_now_score > self.prev_score and since_pulse > 0:
            due.add(Tier.PULSE, f"score {score:.2f} reached {pulse_now_score:.2f}: pulse now")
        if self.retry_tier is not None:
            due.add(self.retry_tier, "retry after a failed save")
        if self.pending_emergency is not None:
            due.high_risk = self.pending_high_risk
            due.add(self.pending_emergency_tier, f"emergency: {self.pending_emergency}")
            due.emergency = True
        if self.pending_lightweight:
            if tier_rank(due.tier) >= tier_rank(Tier.PULSE):
                due.reasons.append("gradient anomaly: covered by this save")
            else:
                due.add(Tier.PULSE, "gradient anomaly: lightweight pulse now")
                due.lightweight = True
        due.lightweight = due.lightweight and due.tier == Tier.PULSE
        if memory_interval > 0 and tier_rank(due.tier) < tier_rank(Tier.PULSE):
            why = self._memory_due(step, memory_interval)
            if why:
                due.memory = True
                due.reasons.append(f"memory: {why}")
        self.prev_score = score
        return due

    def _memory_due(self, step: int, interval: int) -> str:
        """Why a memory-tier snapshot is due at ``step`` ("": it is not)."""
        if self.memory_retry:
            return "retry after no free slot"
        since = self._since(step, self.last_memory)
        if since < interval:
            return ""
        return f"{since} steps since last snapshot >= interval {interval}"

    def quiet(
        self,
        step: int,
        tiers: TiersSpec,
        *,
        interval: int,
        score: float,
        pulse_now_score: float,
        run_seconds: float,
        memory_interval: int = 0,
    ) -> str | None:
        """:meth:`due` for a step with a finite loss, when at most the heartbeat is due.

        Returns the reason :meth:`due` would give — :data:`NOTHING_DUE`, or the
        heartbeat's (one string per ``every_steps``, built once) — and remembers the
        score as :meth:`due` does; None (and nothing changed) when something else may be
        due: ask :meth:`due`. The scheduler's every step without building a :class:`Due`.
        """
        if (
            self.retry_tier is not None
            or self.pending_emergency is not None
            or self.pending_lightweight
        ):
            return None
        if memory_interval > 0 and (
            self.memory_retry or self._since(step, self.last_memory) >= memory_interval
        ):
            return None
        full = tiers.full
        full_every = (
            full.long_run_every_steps
            if run_seconds > full.long_run_after_hours * 3600.0
            else full.every_steps
        )
        last = self.last_full
        since_full = step - last if last is not None else step - (self.first_step or 0)
        if since_full >= full_every:
            return None
        last = self.last_pulse
        since_pulse = step - last if last is not None else step - (self.first_step or 0)
        if since_pulse >= interval or (
            score >= pulse_now_score > self.prev_score and since_pulse > 0
        ):
            return None
        self.prev_score = score
        hb = tiers.heartbeat
        last = self.last_heartbeat
        if not hb.enabled or (last is not None and step - last < hb.every_steps):
            return NOTHING_DUE
        every = hb.every_steps
        cached = self._heartbeat_reason
        if cached[0] != every:
            cached = self._heartbeat_reason = (
                every,
                f"{Tier.HEARTBEAT.value}: every {every} step(s)",
            )
        return cached[1]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_heartbeat": self.last_heartbeat,
            "last_pulse": self.last_pulse,
            "last_full": self.last_full,
            "last_memory": self.last_memory,
            "memory_retry": self.memory_retry,
            "last_emergency": self.last_emergency,
            "prev_score": self.prev_score,
            "first_step": self.first_step,
            "pending_emergency": self.pending_emergency,
            "pending_high_risk": self.pending_high_risk,
            "pending_emergency_tier": self.pending_emergency_tier.value,
            "pending_lightweight": self.pending_lightweight,
            "retry_tier": None if self.retry_tier is None else self.retry_tier.value,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.last_heartbeat = state.get("last_heartbeat")
        self.last_pulse = state.get("last_pulse")
        self.last_full = state.get("last_full")
        self.last_memory = state.get("last_memory")
        self.memory_retry = bool(state.get("memory_retry", False))
        self.last_emergency = state.get("last_emergency")
        self.prev_score = float(state.get("prev_score", 0.0))
        self.first_step = state.get("first_step")
        self.pending_emergency = state.get("pending_emergency")
        self.pending_high_risk = bool(state.get("pending_high_risk", False))
        self.pending_emergency_tier = Tier(state.get("pending_emergency_tier", "full"))
        self.pending_lightweight = bool(state.get("pending_lightweight", False))
        retry = state.get("retry_tier")
        self.retry_tier = None if retry is None else Tier(retry)
