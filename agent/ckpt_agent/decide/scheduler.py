"""Adaptive checkpoint scheduler: *when* to save and *which tier* (pure, no I/O).

The engine calls :meth:`AdaptiveScheduler.observe` once per optimizer step and
gets a :class:`Decision` back; it reports what it actually saved with
:meth:`AdaptiveScheduler.record_save` (which feeds the measured cost into the
Young/Daly cap). No torch, no numpy, no files: only ``math`` and
``statistics``, so the same code runs in the trainer, in the operator and in
table tests.

Rules (every number is a field of :class:`~ckpt_agent.policy.models.SchedulerSpec`
or :class:`~ckpt_agent.policy.models.TiersSpec`):

* **Loss layer** (weight 0.4): the loss is mapped to ``log10(max(loss, 0) + eps)``,
  smoothed by an EWMA (alpha 0.2); the least-squares slope of the last 20
  smoothed points, expressed in decades per window (per-step slope × window),
  must exceed 0.05 in absolute value for 3 consecutive steps. A loss more than
  ``spike_decades`` above the smoothed value is reported as a ``loss_spike``.
* **Gradient layer** (weight 0.35): the global gradient norm is sampled at most
  once every 10 steps (:meth:`AdaptiveScheduler.wants_grad_norm` tells the engine
  when); the last 50 samples are kept; a sample outside mean ± 1 std of the
  previous samples is anomalous; 2 anomalous samples in a row fire the layer
  and request a *lightweight* pulse (weights + RNG) right now.
* **System layer** (weight 0.25): new GPU errors, or a storage write latency
  above 15 ms sustained for 5 s, fire the layer and request an emergency
  checkpoint (tier ``system.emergency_tier``, default full) flagged
  ``high_risk``, at most once per ``emergency_cooldown_steps``. Missing
  metrics are healthy.
* **Score** = sum of the weights of the fired layers. Pulse interval (steps),
  applied in this order, the last rule that changed it is
  :attr:`Decision.interval_rule`:

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

  A pulse is due when the steps since the last pulse reach the interval. When
  the score *rises* to ``pulse_now_score`` or above, a pulse is taken now.
* **Tiers**: heartbeat every ``heartbeat.every_steps``; full every
  ``full.every_steps`` steps since the last full, ``full.long_run_every_steps``
  once the run is older than ``full.long_run_after_hours`` of wall time. A
  higher tier subsumes the lower ones (full ⊇ pulse ⊇ heartbeat), so the
  decision carries the highest tier due and saving it resets the counters of
  every tier at or below it. A lightweight pulse lacks optimizer state and
  does not reset the pulse counter.
* **NaN/inf**: a non-finite loss or gradient norm is reported as anomaly
  ``nan`` and never folded into any average. On a non-finite *loss* the state
  may already be poisoned, so weights-bearing saves (pulse, full, emergency)
  are deferred to the next finite step; the heartbeat is still written.

Decisions are applied optimistically: a decision that says "save pulse" marks
the pulse as taken. The engine reports the actual cost with
:meth:`~AdaptiveScheduler.record_save` and a failed save with
:meth:`~AdaptiveScheduler.record_failed` (the tier is then due again).

Distributed agreement
---------------------
Two supported patterns, both exact:

* **Decide on rank 0 and broadcast** (default): only rank 0 calls ``observe``
  (with the all-reduced loss); it broadcasts ``decision.to_dict()`` and every
  rank acts on ``Decision.from_dict``. Other ranks need no scheduler.
* **Reduce**: every rank observes its *local* signals (its GPU's errors, its
  storage latency), the decisions are all-gathered, every rank computes
  ``merge_decisions(all)`` (deterministic and order-independent: any save,
  highest tier, max score and components, min interval) and calls
  :meth:`AdaptiveScheduler.adopt` with the merged decision so that all
  schedulers' counters agree again.

:meth:`~AdaptiveScheduler.state_dict` is a small JSON-able dict (≤ a few
hundred numbers) that the engine stores in every checkpoint, so the
scheduler survives restarts.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.policy.models import SchedulerSpec, Tier, TiersSpec

__all__ = [
    "ANOMALY_KINDS",
    "INTERVAL_RULES",
    "AdaptiveScheduler",
    "Decision",
    "SystemSignals",
    "merge_decisions",
    "tier_rank",
]

STATE_VERSION = 1
ANOMALY_KINDS = ("nan", "loss_spike", "grad_anomaly")
"""Anomaly kinds, most severe first."""
INTERVAL_RULES = ("base", "score", "young_daly", "stall_budget", "min", "max")
"""Values of :attr:`Decision.interval_rule`."""

_TIER_ORDER = {Tier.HEARTBEAT: 0, Tier.PULSE: 1, Tier.FULL: 2}
_COST_ALPHA = 0.3
"""EWMA factor for measured save costs."""
_STEP_TIME_ALPHA = 0.2
"""EWMA factor for the measured step time."""
_COMPONENTS = ("loss", "gradient", "system")


def tier_rank(tier: Tier | None) -> int:
    """Order of tiers: None < heartbeat < pulse < full."""
    return -1 if tier is None else _TIER_ORDER[Tier(tier)]


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True)
class SystemSignals:
    """Health metrics sampled by the engine at one step (``None``: not measured = healthy).

    Time comes from the ``now`` argument of :meth:`AdaptiveScheduler.observe`.
    """

    gpu_errors: int | None = None
    """GPU errors (XID/ECC) observed *since the previous sample* (a delta, not a total)."""
    write_latency_ms: float | None = None
    """Latest storage write latency in milliseconds."""


@dataclass(frozen=True)
class Decision:
    """What to do at one step. Pure data: broadcastable via :meth:`to_dict`."""

    step: int
    """Global step the decision is for."""
    save: bool
    """Save something at this step."""
    tier: Tier | None
    """Highest tier due (full > pulse > heartbeat); None when nothing is due."""
    lightweight: bool = False
    """A pulse with weights + RNG only (gradient anomaly); never set for other tiers."""
    emergency: bool = False
    """Requested by a system alarm or by :meth:`AdaptiveScheduler.request_emergency`."""
    high_risk: bool = False
    """Taken in a high-risk environment (system layer alarm)."""
    score: float = 0.0
    """Sum of the weights of the fired layers."""
    components: dict[str, float] = field(default_factory=dict)
    """Per-layer contribution: ``loss``, ``gradient``, ``system``."""
    interval: int = 0
    """Current dynamic pulse interval in steps."""
    interval_rule: str = "base"
    """Which rule set the interval (see :data:`INTERVAL_RULES`)."""
    reason: str = ""
    """Human-readable why (``;``-separated when several rules agree)."""
    anomaly: str | None = None
    """Anomaly detected at this step (``nan``, ``loss_spike``, ``grad_anomaly``)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (tier as its string value)."""
        return {
            "step": self.step,
            "save": self.save,
            "tier": None if self.tier is None else self.tier.value,
            "lightweight": self.lightweight,
            "emergency": self.emergency,
            "high_risk": self.high_risk,
            "score": self.score,
            "components": dict(self.components),
            "interval": self.interval,
            "interval_rule": self.interval_rule,
            "reason": self.reason,
            "anomaly": self.anomaly,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """Inverse of :meth:`to_dict` (unknown keys are an error)."""
        known = {
            "step",
            "save",
            "tier",
            "lightweight",
            "emergency",
            "high_risk",
            "score",
            "components",
            "interval",
            "interval_rule",
            "reason",
            "anomaly",
        }
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Decision keys: {sorted(unknown)}")
        tier = data.get("tier")
        return cls(
            step=int(data["step"]),
            save=bool(data["save"]),
            tier=None if tier is None else Tier(tier),
            lightweight=bool(data.get("lightweight", False)),
            emergency=bool(data.get("emergency", False)),
            high_risk=bool(data.get("high_risk", False)),
            score=float(data.get("score", 0.0)),
            components={str(k): float(v) for k, v in dict(data.get("components", {})).items()},
            interval=int(data.get("interval", 0)),
            interval_rule=str(data.get("interval_rule", "base")),
            reason=str(data.get("reason", "")),
            anomaly=None if data.get("anomaly") is None else str(data["anomaly"]),
        )

    def to_json_line(self) -> str:
        """One line of JSON (no trailing newline), keys sorted."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)


def merge_decisions(decisions: Iterable[Decision]) -> Decision:
    """Combine per-rank decisions for the same step into the one all ranks act on.

    Order-independent: ``save`` if any rank saves; the highest tier; max score
    and per-component max; the smallest interval (and its rule); emergency /
    high-risk if any; lightweight only when every rank that chose the merged
    tier chose a lightweight pulse; the most severe anomaly; reasons joined
    (unique, sorted).
    """
    ds = list(decisions)
    if not ds:
        raise ValueError("merge_decisions needs at least one decision")
    steps = {d.step for d in ds}
    if len(steps) != 1:
        raise ValueError(f"cannot merge decisions for different steps: {sorted(steps)}")
    tier = max((d.tier for d in ds), key=tier_rank)
    at_tier = [d for d in ds if d.tier == tier]
    lightweight = tier == Tier.PULSE and all(d.lightweight for d in at_tier)
    components: dict[str, float] = {}
    for d in ds:
        for k, v in d.components.items():
            components[k] = max(components.get(k, 0.0), v)
    smallest = min(ds, key=lambda d: (d.interval, d.interval_rule))
    anomalies = [d.anomaly for d in ds if d.anomaly is not None]
    anomaly = (
        min(anomalies, key=lambda a: ANOMALY_KINDS.index(a) if a in ANOMALY_KINDS else 99)
        if anomalies
        else None
    )
    reasons = sorted({d.reason for d in ds if d.reason})
    return Decision(
        step=ds[0].step,
        save=any(d.save for d in ds),
        tier=tier,
        lightweight=lightweight,
        emergency=any(d.emergency for d in ds),
        high_risk=any(d.high_risk for d in ds),
        score=max(d.score for d in ds),
        components=components,
        interval=smallest.interval,
        interval_rule=smallest.interval_rule,
        reason=" | ".join(reasons),
        anomaly=anomaly,
    )


# --------------------------------------------------------------------------- helpers


def _ls_slope(points: Sequence[tuple[int, float]]) -> float:
    """Least-squares slope of y over x (0 when x is constant)."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx == 0:
        return 0.0
    sxy = sum((p[0] - mx) * (p[1] - my) for p in points)
    return sxy / sxx


@dataclass
class _Cost:
    """EWMA of the measured stall and persist seconds of one tier."""

    stall: float | None = None
    persist: float | None = None

    def add(self, stall: float | None, persist: float | None) -> None:
        if _finite(stall) and stall is not None and stall >= 0:
            self.stall = stall if self.stall is None else _ewma(self.stall, stall, _COST_ALPHA)
        if _finite(persist) and persist is not None and persist >= 0:
            self.persist = (
                persist if self.persist is None else _ewma(self.persist, persist, _COST_ALPHA)
            )

    @property
    def total(self) -> float | None:
        if self.stall is None and self.persist is None:
            return None
        return (self.stall or 0.0) + (self.persist or 0.0)


def _ewma(prev: float, x: float, alpha: float) -> float:
    return alpha * x + (1.0 - alpha) * prev


# --------------------------------------------------------------------------- scheduler


class AdaptiveScheduler:
    """Three-layer adaptive scheduler (see the module docstring for the rules).

    ``start_time`` is the run's wall-clock start (Unix seconds; the operator
    passes the job's creation time so the 15-day rule survives restarts);
    default: the first ``now`` seen. ``clock`` supplies ``now`` when a call
    omits it (default :func:`time.time`); tests pass ``now`` explicitly.
    """

    def __init__(
        self,
        scheduler: SchedulerSpec | None = None,
        tiers: TiersSpec | None = None,
        *,
        start_time: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.spec = scheduler if scheduler is not None else SchedulerSpec()
        self.tiers = tiers if tiers is not None else TiersSpec()
        self._clock = clock
        self._mtbf = self.spec.risk.mtbf_seconds
        self.start_time = start_time
        self._reset_state()

    # ------------------------------------------------------------------ state

    def _reset_state(self) -> None:
        loss, grad = self.spec.loss, self.spec.gradient
        self._last_step: int | None = None
        self._last_now: float | None = None
        self._ewma: float | None = None
        self._loss_window: deque[tuple[int, float]] = deque(maxlen=loss.window)
        self._loss_streak = 0
        self._grad_samples: deque[float] = deque(maxlen=grad.history)
        self._grad_streak = 0
        self._last_grad_sample_step: int | None = None
        self._latency_high_since: float | None = None
        self._last_heartbeat: int | None = None
        self._last_pulse: int | None = None
        self._last_full: int | None = None
        self._last_emergency: int | None = None
        self._prev_score = 0.0
        self._first_step: int | None = None
        self._pending_emergency: str | None = None
        self._pending_high_risk = False
        self._pending_emergency_tier = Tier.FULL
        self._pending_lightweight = False
        self._retry_tier: Tier | None = None
        self._step_time: float | None = None
        self._stall_since_observe = 0.0
        self._costs: dict[Tier, _Cost] = {t: _Cost() for t in Tier}

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able snapshot of everything :meth:`observe` depends on."""
        return {
            "version": STATE_VERSION,
            "start_time": self.start_time,
            "mtbf": self._mtbf,
            "last_step": self._last_step,
            "last_now": self._last_now,
            "ewma": self._ewma,
            "loss_window": [[s, v] for s, v in self._loss_window],
            "loss_streak": self._loss_streak,
            "grad_samples": list(self._grad_samples),
            "grad_streak": self._grad_streak,
            "last_grad_sample_step": self._last_grad_sample_step,
            "latency_high_since": self._latency_high_since,
            "last_heartbeat": self._last_heartbeat,
            "last_pulse": self._last_pulse,
            "last_full": self._last_full,
            "last_emergency": self._last_emergency,
            "prev_score": self._prev_score,
            "first_step": self._first_step,
            "pending_emergency": self._pending_emergency,
            "pending_high_risk": self._pending_high_risk,
            "pending_emergency_tier": self._pending_emergency_tier.value,
            "pending_lightweight": self._pending_lightweight,
            "retry_tier": None if self._retry_tier is None else self._retry_tier.value,
            "step_time": self._step_time,
            "costs": {
                t.value: {"stall": c.stall, "persist": c.persist} for t, c in self._costs.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (also after a JSON round trip)."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"unsupported scheduler state version {version!r}")
        self._reset_state()
        self.start_time = state.get("start_time")
        self._mtbf = float(state.get("mtbf", self.spec.risk.mtbf_seconds))
        self._last_step = state.get("last_step")
        self._last_now = state.get("last_now")
        self._ewma = state.get("ewma")
        self._loss_window.extend((int(s), float(v)) for s, v in state.get("loss_window", []))
        self._loss_streak = int(state.get("loss_streak", 0))
        self._grad_samples.extend(float(x) for x in state.get("grad_samples", []))
        self._grad_streak = int(state.get("grad_streak", 0))
        self._last_grad_sample_step = state.get("last_grad_sample_step")
        self._latency_high_since = state.get("latency_high_since")
        self._last_heartbeat = state.get("last_heartbeat")
        self._last_pulse = state.get("last_pulse")
        self._last_full = state.get("last_full")
        self._last_emergency = state.get("last_emergency")
        self._prev_score = float(state.get("prev_score", 0.0))
        self._first_step = state.get("first_step")
        self._pending_emergency = state.get("pending_emergency")
        self._pending_high_risk = bool(state.get("pending_high_risk", False))
        self._pending_emergency_tier = Tier(state.get("pending_emergency_tier", "full"))
        self._pending_lightweight = bool(state.get("pending_lightweight", False))
        retry = state.get("retry_tier")
        self._retry_tier = None if retry is None else Tier(retry)
        self._step_time = state.get("step_time")
        for name, c in dict(state.get("costs", {})).items():
            self._costs[Tier(name)] = _Cost(stall=c.get("stall"), persist=c.get("persist"))

    # ------------------------------------------------------------------ inputs from the engine

    @property
    def step_time(self) -> float | None:
        """Measured seconds per training step (EWMA), excluding save stalls."""
        return self._step_time

    @property
    def mtbf_seconds(self) -> float:
        return self._mtbf

    def set_mtbf(self, seconds: float) -> None:
        """Update the MTBF estimate (the operator refines it from observed failures)."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"mtbf must be a positive number, got {seconds!r}")
        self._mtbf = seconds

    def record_step_time(self, seconds: float) -> None:
        """Feed a measured step time directly (instead of deriving it from ``now``)."""
        if math.isfinite(seconds) and seconds > 0:
            self._step_time = (
                seconds
                if self._step_time is None
                else _ewma(self._step_time, seconds, _STEP_TIME_ALPHA)
            )

    def wants_grad_norm(self, step: int) -> bool:
        """True when ``observe(step, ...)`` would sample a gradient norm (saves an all-reduce)."""
        last = self._last_grad_sample_step
        return last is None or step - last >= self.spec.gradient.sample_every or step < last

    def request_emergency(self, reason: str) -> None:
        """Make the next :meth:`observe` with a finite loss return an emergency full save.

        For the operator's save-now signal and SIGTERM. Not flagged high-risk
        (that flag is for system-layer alarms).
        """
        self._add_emergency(reason or "emergency requested", Tier.FULL)

    def _add_emergency(self, reason: str, tier: Tier) -> None:
        pending = self._pending_emergency
        self._pending_emergency = reason if pending is None else f"{pending}; {reason}"
        if pending is None or tier_rank(tier) > tier_rank(self._pending_emergency_tier):
            self._pending_emergency_tier = tier

    def record_save(
        self,
        decision_or_tier: Decision | Tier | str,
        step: int,
        stall_seconds: float | None = None,
        persist_seconds: float | None = None,
        now: float | None = None,
    ) -> None:
        """Report a save the engine actually performed.

        Resets the counters of that tier and every lower one (a lightweight
        pulse resets only the heartbeat) and feeds the measured cost: the
        stall (blocking seconds) and, when already known, the persist seconds
        (for async persists call :meth:`record_persist` later). ``now`` is
        accepted for symmetry with :meth:`observe` and unused by the rules.
        """
        del now
        tier, lightweight = self._tier_of(decision_or_tier)
        self._mark_saved(tier, step, lightweight=lightweight)
        if not lightweight:
            self._costs[tier].add(stall_seconds, persist_seconds)
        if _finite(stall_seconds) and stall_seconds is not None and stall_seconds > 0:
            self._stall_since_observe += stall_seconds
        if self._retry_tier is not None and tier_rank(tier) >= tier_rank(self._retry_tier):
            self._retry_tier = None

    def record_persist(self, tier: Tier | str, persist_seconds: float) -> None:
        """Report the persist time of an asynchronous save once it finished."""
        self._costs[Tier(tier)].add(None, persist_seconds)

    def record_failed(self, decision_or_tier: Decision | Tier | str) -> None:
        """A save did not happen or failed: that tier is due again at the next observe."""
        tier, _ = self._tier_of(decision_or_tier)
        if tier_rank(tier) > tier_rank(self._retry_tier):
            self._retry_tier = tier

    def adopt(self, decision: Decision) -> None:
        """Apply an agreed (merged or broadcast) decision to this scheduler's counters."""
        if decision.tier is not None and decision.save:
            self._mark_saved(decision.tier, decision.step, lightweight=decision.lightweight)
            if tier_rank(decision.tier) >= tier_rank(Tier.PULSE) and not decision.lightweight:
                self._pending_lightweight = False
            if self._retry_tier is not None and tier_rank(decision.tier) >= tier_rank(
                self._retry_tier
            ):
                self._retry_tier = None
            if decision.emergency:
                self._last_emergency = decision.step
                self._pending_emergency = None
                self._pending_high_risk = False

    # ------------------------------------------------------------------ observe

    def observe(
        self,
        step: int,
        loss: float,
        grad_norm: float | None = None,
        system: SystemSignals | None = None,
        now: float | None = None,
    ) -> Decision:
        """Fold one step's signals in and decide what to save at this step."""
        if now is None:
            now = self._clock()
        if self.start_time is None:
            self.start_time = now
        self._track_time(step, now)

        anomalies: list[str] = []
        loss_ok = _finite(loss)
        if loss_ok:
            if self._fold_loss(step, loss):
                anomalies.append("loss_spike")
        else:
            anomalies.append("nan")
        grad_fired_now = False
        if grad_norm is not None and self.wants_grad_norm(step):
            if _finite(grad_norm):
                grad_fired_now = self._fold_grad(step, grad_norm)
                if grad_fired_now:
                    anomalies.append("grad_anomaly")
            elif "nan" not in anomalies:
                anomalies.append("nan")
        sys_fired, sys_why = self._system(system, now)

        sp = self.spec
        components = {
            "loss": sp.loss.weight if self._loss_streak >= sp.loss.consecutive_steps else 0.0,
            "gradient": (
                sp.gradient.weight
                if self._grad_streak >= sp.gradient.consecutive_anomalies
                else 0.0
            ),
            "system": sp.system.weight if sys_fired else 0.0,
        }
        score = round(sum(components.values()), 12)
        interval, rule = self.interval_for(score)

        if grad_fired_now:
            self._pending_lightweight = True
        if sys_fired and (
            self._last_emergency is None
            or step - self._last_emergency >= sp.system.emergency_cooldown_steps
        ):
            self._add_emergency(f"system alarm ({sys_why})", Tier(sp.system.emergency_tier))
            self._pending_high_risk = True

        # ---- what is due
        reasons: list[str] = []
        tier: Tier | None = None
        lightweight = False
        emergency = False
        high_risk = False

        def due(t: Tier, why: str) -> None:
            nonlocal tier
            reasons.append(f"{t.value}: {why}")
            if tier_rank(t) > tier_rank(tier):
                tier = t

        hb = self.tiers.heartbeat
        if hb.enabled and (
            self._last_heartbeat is None or step - self._last_heartbeat >= hb.every_steps
        ):
            due(Tier.HEARTBEAT, f"every {hb.every_steps} step(s)")

        weights_reasons: list[str] = []
        if loss_ok:
            since_pulse = step - self._ref(self._last_pulse)
            full_every, long_run = self._full_period(now)
            since_full = step - self._ref(self._last_full)
            if since_full >= full_every:
                due(Tier.FULL, f"{since_full} steps since last full >= {full_every}" + long_run)
            if since_pulse >= interval:
                due(Tier.PULSE, f"{since_pulse} steps since last pulse >= interval {interval}")
            if score >= sp.pulse_now_score > self._prev_score and since_pulse > 0:
                due(Tier.PULSE, f"score {score:.2f} reached {sp.pulse_now_score:.2f}: pulse now")
            if self._retry_tier is not None:
                due(self._retry_tier, "retry after a failed save")
            if self._pending_emergency is not None:
                high_risk = self._pending_high_risk
                due(self._pending_emergency_tier, f"emergency: {self._pending_emergency}")
                emergency = True
            if self._pending_lightweight:
                if tier_rank(tier) >= tier_rank(Tier.PULSE):
                    reasons.append("gradient anomaly: covered by this save")
                else:
                    due(Tier.PULSE, "gradient anomaly: lightweight pulse now")
                    lightweight = True
        else:
            pending = [
                name
                for name, flag in (
                    ("emergency", self._pending_emergency is not None),
                    ("lightweight pulse", self._pending_lightweight),
                )
                if flag
            ]
            weights_reasons.append(
                "non-finite loss: weights-bearing saves deferred"
                + (f" (pending: {', '.join(pending)})" if pending else "")
            )

        anomaly = min(anomalies, key=ANOMALY_KINDS.index) if anomalies else None
        decision = Decision(
            step=step,
            save=tier is not None,
            tier=tier,
            lightweight=lightweight and tier == Tier.PULSE,
            emergency=emergency,
            high_risk=high_risk,
            score=score,
            components=components,
            interval=interval,
            interval_rule=rule,
            reason="; ".join(reasons + weights_reasons) or "nothing due",
            anomaly=anomaly,
        )
        if loss_ok:
            self._prev_score = score
        self.adopt(decision)
        return decision

    # ------------------------------------------------------------------ rules

    def interval_for(self, score: float) -> tuple[int, str]:
        """The dynamic pulse interval for ``score`` and the rule that set it."""
        p = self.tiers.pulse
        capped = min(max(score, 0.0), self.spec.max_interval_score)
        interval = max(1, int(p.base_interval * (1.0 - capped) + 0.5))
        rule = "base" if score <= 0 else "score"
        risk = self.spec.risk
        st = self._step_time
        cost = self._costs[Tier.PULSE]
        if risk.enabled and st is not None and st > 0:
            delta = cost.total
            if delta is not None and delta > 0:
                tau = math.sqrt(2.0 * delta * self._mtbf)
                yd = max(1, math.floor(tau / st))
                if yd < interval:
                    interval, rule = yd, "young_daly"
            if cost.stall is not None and cost.stall > 0:
                floor = math.ceil(cost.stall / (risk.stall_budget * st) - 1e-9)
                if floor > interval:
                    interval, rule = floor, "stall_budget"
        if interval < p.min_interval:
            interval, rule = p.min_interval, "min"
        elif interval > p.max_interval:
            interval, rule = p.max_interval, "max"
        return interval, rule

    def young_daly_steps(self) -> int | None:
        """The uncapped Young/Daly interval in steps, when cost and step time are known."""
        st, delta = self._step_time, self._costs[Tier.PULSE].total
        if st is None or st <= 0 or delta is None or delta <= 0:
            return None
        return max(1, math.floor(math.sqrt(2.0 * delta * self._mtbf) / st))

    def _full_period(self, now: float) -> tuple[int, str]:
        f = self.tiers.full
        start = self.start_time if self.start_time is not None else now
        if now - start > f.long_run_after_hours * 3600.0:
            return f.long_run_every_steps, f" (run older than {f.long_run_after_hours:g} h)"
        return f.every_steps, ""

    def _ref(self, last: int | None) -> int:
        """Reference step for 'steps since': the last save, else the first observed step."""
        if last is not None:
            return last
        return self._first_step if self._first_step is not None else 0

    def _track_time(self, step: int, now: float) -> None:
        prev_step, prev_now = self._last_step, self._last_now
        if prev_step is None:
            self._first_step = step
        elif step <= prev_step:
            self._rewind(step)
        elif prev_now is not None:
            dt = (now - prev_now - self._stall_since_observe) / (step - prev_step)
            if dt > 0 and math.isfinite(dt):
                self.record_step_time(dt)
        self._last_step = step
        self._last_now = now
        self._stall_since_observe = 0.0

    def _rewind(self, step: int) -> None:
        """The run went back (resumed from an older checkpoint): trends restart."""
        self._ewma = None
        self._loss_window.clear()
        self._loss_streak = 0
        self._grad_streak = 0
        self._last_grad_sample_step = None
        self._first_step = step
        for name in ("_last_heartbeat", "_last_pulse", "_last_full", "_last_emergency"):
            last = getattr(self, name)
            if last is not None and last > step:
                setattr(self, name, step)

    def _fold_loss(self, step: int, loss: float) -> bool:
        """Update the loss layer; return True when the loss is a spike."""
        spec = self.spec.loss
        x = math.log10(max(loss, 0.0) + spec.epsilon)
        spike = (
            self._ewma is not None
            and len(self._loss_window) >= spec.window
            and x - self._ewma > spec.spike_decades
        )
        self._ewma = x if self._ewma is None else _ewma(self._ewma, x, spec.ewma_alpha)
        self._loss_window.append((step, self._ewma))
        if len(self._loss_window) >= spec.window:
            slope = _ls_slope(self._loss_window) * spec.window
            self._loss_streak = self._loss_streak + 1 if abs(slope) > spec.slope_threshold else 0
        return spike

    def loss_slope(self) -> float | None:
        """Current smoothed slope in decades per window (None until the window is full)."""
        if len(self._loss_window) < self.spec.loss.window:
            return None
        return _ls_slope(self._loss_window) * self.spec.loss.window

    def _fold_grad(self, step: int, grad_norm: float) -> bool:
        """Sample a finite gradient norm; return True when the layer fires at this sample."""
        g = self.spec.gradient
        self._last_grad_sample_step = step
        anomalous = False
        if len(self._grad_samples) >= g.min_samples:
            mean = statistics.fmean(self._grad_samples)
            std = statistics.pstdev(self._grad_samples, mu=mean)
            dev = abs(grad_norm - mean)
            anomalous = dev > g.std_multiplier * std and not math.isclose(
                grad_norm, mean, rel_tol=1e-9, abs_tol=1e-12
            )
        self._grad_samples.append(grad_norm)
        self._grad_streak = self._grad_streak + 1 if anomalous else 0
        return self._grad_streak == g.consecutive_anomalies

    def _system(self, signals: SystemSignals | None, now: float) -> tuple[bool, str]:
        s = self.spec.system
        if signals is None:
            self._latency_high_since = None
            return False, ""
        why: list[str] = []
        if signals.gpu_errors is not None and signals.gpu_errors > s.gpu_error_threshold:
            why.append(f"gpu_errors={signals.gpu_errors}")
        lat = signals.write_latency_ms
        if lat is not None and math.isfinite(lat) and lat > s.write_latency_ms:
            if self._latency_high_since is None:
                self._latency_high_since = now
            held = now - self._latency_high_since
            if held >= s.sustained_seconds:
                why.append(
                    f"write latency {lat:.1f} ms > {s.write_latency_ms:g} ms for {held:.1f} s"
                )
        else:
            self._latency_high_since = None
        return bool(why), ", ".join(why)

    # ------------------------------------------------------------------ bookkeeping

    @staticmethod
    def _tier_of(decision_or_tier: Decision | Tier | str) -> tuple[Tier, bool]:
        if isinstance(decision_or_tier, Decision):
            if decision_or_tier.tier is None:
                raise ValueError("decision has no tier")
            return decision_or_tier.tier, decision_or_tier.lightweight
        return Tier(decision_or_tier), False

    def _mark_saved(self, tier: Tier, step: int, *, lightweight: bool) -> None:
        def bump(name: str) -> None:
            last = getattr(self, name)
            setattr(self, name, step if last is None else max(last, step))

        bump("_last_heartbeat")
        if lightweight:
            self._pending_lightweight = False
            return
        if tier_rank(tier) >= tier_rank(Tier.PULSE):
            bump("_last_pulse")
            self._pending_lightweight = False
        if tier == Tier.FULL:
            bump("_last_full")
