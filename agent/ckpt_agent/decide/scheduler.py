"""Adaptive checkpoint scheduler: *when* to save and *which tier* (pure, no I/O).

The engine calls :meth:`AdaptiveScheduler.observe` once per optimizer step and
gets a :class:`~ckpt_agent.decide.decision.Decision` back; it reports what
became of each save with :meth:`AdaptiveScheduler.settle` and a
:class:`~ckpt_agent.decide.decision.SaveOutcome` (which feeds the measured
cost into the Young/Daly cap). No torch, no numpy, no files: only ``math``
and ``statistics``, so the same code runs in the trainer, in the operator and
in table tests.

:class:`AdaptiveScheduler` composes the parts, each with its own rules
(every number is a field of :class:`~ckpt_agent.policy.scheduler_models.SchedulerSpec`
or :class:`~ckpt_agent.policy.models.TiersSpec`):

* :mod:`ckpt_agent.decide.signals`: the loss (weight 0.4), gradient (0.35) and
  system (0.25) layers. **Score** = sum of the weights of the fired layers.
  A gradient anomaly requests a lightweight pulse now; a system alarm an
  emergency checkpoint (tier ``system.emergency_tier``, default full) flagged
  ``high_risk``: once per alarm episode (a warning that holds for hours saves
  once; a new episode — the alarm cleared and raised again, another node
  warning, new GPU errors — saves again), at most once per
  ``emergency_cooldown_steps``.
* :mod:`ckpt_agent.decide.hazard`: the failure hazard: lower while calm when
  warnings announce a share of the failures, higher while a warning (system
  alarm, node warning) holds. Every decision records it (``hazard``, ``warning``).
* :mod:`ckpt_agent.decide.intervals`: the dynamic pulse interval from the
  Young/Daly optimum for that hazard, the score, the stall budget and the
  policy's bounds.
* :mod:`ckpt_agent.decide.tiers`: the counters that say which tier is due
  (heartbeat, pulse, full, retries, emergencies; full ⊇ pulse ⊇ heartbeat), and
  the memory tier's apart (``tiers.memory``: :attr:`Decision.memory`, its interval
  from :func:`~ckpt_agent.decide.intervals.memory_interval`).
* :mod:`ckpt_agent.decide.decision`: the data exchanged with the engine.

**NaN/inf**: a non-finite loss or gradient norm is reported as anomaly ``nan``
and never folded into any average; on a non-finite loss weights-bearing saves
are deferred to the next finite step (the heartbeat is still written).

Decisions are applied optimistically: a decision that says "save pulse" marks
the pulse as taken. The engine reports the actual cost with
``settle(SaveOutcome.taken(...))`` / ``SaveOutcome.persisted(...)``, and a
save that was not taken or failed with ``SaveOutcome.deferred(...)`` /
``SaveOutcome.failed(...)`` (the tier is then due again).

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

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from ckpt_agent.decide.decision import (
    Decision,
    SaveOutcome,
    SaveResult,
)
from ckpt_agent.decide.hazard import Hazard, HazardModel
from ckpt_agent.decide.intervals import CostModel, memory_interval, pulse_interval
from ckpt_agent.decide.signals import (
    GradientLayer,
    LossLayer,
    SystemLayer,
    SystemSignals,
)
from ckpt_agent.decide.tiers import NOTHING_DUE, TierCounters
from ckpt_agent.policy.models import Tier, TiersSpec
from ckpt_agent.policy.scheduler_models import SchedulerSpec

__all__ = ["AdaptiveScheduler"]

STATE_VERSION = 1


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
        self.start_time = start_time
        self._last_step: int | None = None
        self._last_now: float | None = None
        self._loss = LossLayer(self.spec.loss)
        self._grad = GradientLayer(self.spec.gradient)
        self._system = SystemLayer(self.spec.system)
        self._counters = TierCounters()
        self._costs = CostModel(self.spec.risk.mtbf_seconds)
        self._hazard = HazardModel(self.spec.risk)
        self._requested: str | None = None
        """A request_emergency reason not yet folded into the hazard."""
        self._scores: dict[tuple[float, float, float], tuple[dict[str, float], float]] = {}
        """Decision components and score per fired weights (the same dict in every decision
        with those weights: decisions are read, never changed)."""
        self._memory_on = self.tiers.memory.enabled
        """The memory tier is on (the policy asks, and :meth:`memory_off` was not called)."""
        self._quiet_path = True
        """Answer steps where at most the heartbeat is due without building a ``Due``
        (:meth:`observe`); False: always the full path (the replay test compares both)."""

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able snapshot of everything :meth:`observe` depends on."""
        return {
            "version": STATE_VERSION,
            "start_time": self.start_time,
            "mtbf": self._costs.mtbf,
            "last_step": self._last_step,
            "last_now": self._last_now,
            **self._loss.state_dict(),
            **self._grad.state_dict(),
            **self._system.state_dict(),
            **self._counters.state_dict(),
            **self._costs.state_dict(),
            **self._hazard.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (also after a JSON round trip)."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"unsupported scheduler state version {version!r}")
        self.start_time = state.get("start_time")
        self._costs.load_state_dict(state, default_mtbf=self.spec.risk.mtbf_seconds)
        self._last_step = state.get("last_step")
        self._last_now = state.get("last_now")
        self._loss.load_state_dict(state)
        self._grad.load_state_dict(state)
        self._system.load_state_dict(state)
        self._counters.load_state_dict(state)
        self._hazard.load_state_dict(state)

    # ------------------------------------------------------------------ inputs from the engine

    @property
    def step_time(self) -> float | None:
        """Measured seconds per training step (EWMA), excluding save stalls."""
        return self._costs.step_time

    @property
    def mtbf_seconds(self) -> float:
        return self._costs.mtbf

    def set_mtbf(self, seconds: float) -> None:
        """Update the baseline MTBF estimate (from observed failures); the pulse interval
        follows it as Young/Daly says (``∝ √M``)."""
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"mtbf must be a positive number, got {seconds!r}")
        self._costs.mtbf = seconds

    def hazard_at(self, now: float) -> Hazard:
        """The hazard the interval is sized for at ``now``."""
        return self._hazard.at(now, self._costs.mtbf)

    def record_step_time(self, seconds: float) -> None:
        """Feed a measured step time directly (instead of deriving it from ``now``)."""
        self._costs.record_step_time(seconds)

    def wants_grad_norm(self, step: int) -> bool:
        """True when ``observe(step, ...)`` would sample a gradient norm (saves an all-reduce)."""
        return self._grad.wants(step)

    def request_emergency(self, reason: str, *, warning: bool = False) -> None:
        """Make the next :meth:`observe` with a finite loss return an emergency full save.

        For the operator's save-now signal and SIGTERM. Not flagged high-risk
        (that flag is for system-layer alarms). With ``warning`` (a request that
        announces trouble, e.g. the operator relaying a node warning) it is also a
        warning (:mod:`ckpt_agent.decide.hazard`): from the next :meth:`observe` the
        interval is sized for the warned hazard until the warning lapses.
        """
        self._counters.add_emergency(reason or "emergency requested", Tier.FULL)
        if warning:
            self._requested = reason or "emergency requested"

    def memory_off(self) -> None:
        """No memory-tier snapshots from now on (the engine cannot take them: no shared
        memory here)."""
        self._memory_on = False

    def memory_interval(self, hazard: float = 1.0) -> tuple[int, str]:
        """The memory tier's interval and its rule ((0, "off") when the tier is off)."""
        if not self._memory_on:
            return 0, "off"
        return memory_interval(self.tiers.memory, self.spec, self._costs, hazard)

    def settle(self, outcome: SaveOutcome) -> None:
        """Feed back what became of a save (the one feedback call of the engine).

        * ``TAKEN``: the snapshot was taken. Resets the counters of that tier
          and every lower one (a lightweight pulse resets only the heartbeat),
          feeds the measured stall (and persist, when already known) into the
          cost model and clears a pending retry of that tier or a lower one.
        * ``PERSISTED``: an asynchronous persist finished: feeds its seconds.
        * ``DEFERRED`` / ``FAILED``: the save was not taken, or its persist
          failed: the tier is due again at the next :meth:`observe`.

        A memory-tier snapshot's outcome (``outcome.memory``) moves only the memory tier's
        counter and costs.
        """
        tier = outcome.tier
        if outcome.memory:
            if outcome.result is SaveResult.TAKEN:
                assert outcome.step is not None
                self._counters.saved_memory(outcome.step)
                self._costs.memory.add(outcome.stall_seconds, outcome.persist_seconds)
                self._costs.add_stall(outcome.stall_seconds)
            elif outcome.result is SaveResult.PERSISTED:
                self._costs.memory.add(None, outcome.persist_seconds)
            else:
                self._counters.memory_retry = True
            return
        if outcome.result is SaveResult.TAKEN:
            assert outcome.step is not None  # SaveOutcome.__post_init__ checks it
            self._counters.saved(tier, outcome.step, lightweight=outcome.lightweight)
            if not outcome.lightweight:
                self._costs.costs[tier].add(outcome.stall_seconds, outcome.persist_seconds)
            self._costs.add_stall(outcome.stall_seconds)
        elif outcome.result is SaveResult.PERSISTED:
            self._costs.costs[tier].add(None, outcome.persist_seconds)
        else:
            self._counters.retry(tier)

    def adopt(self, decision: Decision) -> None:
        """Apply an agreed (merged or broadcast) decision to this scheduler's counters."""
        if decision.memory_only:
            self._counters.saved_memory(decision.step)
        if decision.tier is not None and decision.save:
            self._counters.saved(
                decision.tier,
                decision.step,
                lightweight=decision.lightweight,
                emergency=decision.emergency,
            )

    # ------------------------------------------------------------------ observe

    def observe(
        self,
        step: int,
        loss: float,
        grad_norm: float | None = None,
        system: SystemSignals | None = None,
        now: float | None = None,
    ) -> Decision:
        """Fold one step's signals in and decide what to save at this step.

        Runs after every optimizer step, so the common case costs no more than it must:
        a quiet system is one check, the hazard no object, and while at most the
        heartbeat is due :meth:`TierCounters.quiet` answers without building a ``Due``
        and the ``Decision`` is built directly (:meth:`Decision.quick`); the state
        every signal keeps is updated on every step all the same (decisions are
        bit-identical to the full path: ``tests/ckpt_agent/decide/test_scheduler_replay.py``).
        """
        if now is None:
            now = self._clock()
        if self.start_time is None:
            self.start_time = now
        self._track_time(step, now)

        anomaly: str | None = None  # the most severe (ANOMALY_KINDS order) seen at this step
        loss_ok = loss is not None and math.isfinite(loss)
        if not loss_ok:
            anomaly = "nan"
        elif self._loss.fold(step, loss):
            anomaly = "loss_spike"
        grad_fired_now = False
        grad = self._grad
        if grad_norm is not None and grad.wants(step):
            if math.isfinite(grad_norm):
                grad_fired_now = grad.fold(step, grad_norm)
                if grad_fired_now and anomaly is None:
                    anomaly = "grad_anomaly"
            else:
                anomaly = "nan"
        sys_layer = self._system
        sys_fired, sys_why = sys_layer.check(system, now)
        hazard_model = self._hazard
        if sys_fired:  # HazardModel.update ignores a layer that did not fire
            hazard_model.update(sys_fired, sys_why, now, fresh=sys_layer.fresh)
        if self._requested is not None:
            hazard_model.update(True, self._requested, now, fresh=True)
            self._requested = None
        multiplier, warning = hazard_model.level(now, self._costs.mtbf)
        # a warning that decayed out (hazard module docstring) no longer raises the score
        sys_live = sys_fired and warning is not None

        sp = self.spec
        weights = (
            sp.loss.weight if self._loss.fired else 0.0,
            sp.gradient.weight if grad.fired else 0.0,
            sp.system.weight if sys_live else 0.0,
        )
        scored = self._scores.get(weights)
        if scored is None:  # a few combinations per policy: each built once, then shared
            if len(self._scores) >= 64:
                self._scores.clear()
            components = {"loss": weights[0], "gradient": weights[1], "system": weights[2]}
            scored = self._scores[weights] = (components, round(sum(components.values()), 12))
        components, score = scored
        if self._memory_on:
            mem = self.tiers.memory
            interval, rule = pulse_interval(
                score, sp, self.tiers.pulse, self._costs, multiplier, mem.uncovered_share
            )
            memory_every = memory_interval(mem, sp, self._costs, multiplier)[0]
        else:
            interval, rule = pulse_interval(score, sp, self.tiers.pulse, self._costs, multiplier)
            memory_every = 0

        counters = self._counters
        if grad_fired_now:
            counters.pending_lightweight = True
        if sys_layer.owed and counters.emergency_cooled_down(
            step, sp.system.emergency_cooldown_steps
        ):
            counters.add_emergency(
                f"system alarm ({sys_why})", Tier(sp.system.emergency_tier), high_risk=True
            )
            sys_layer.owed = False
        run_seconds = now - self.start_time
        quiet = (
            counters.quiet(
                step,
                self.tiers,
                interval=interval,
                score=score,
                pulse_now_score=sp.pulse_now_score,
                run_seconds=run_seconds,
                memory_interval=memory_every,
            )
            if loss_ok and self._quiet_path
            else None
        )
        if quiet is not None:  # nothing due, or the heartbeat alone
            if quiet is NOTHING_DUE:
                tier = None
            else:
                tier = Tier.HEARTBEAT
                last = counters.last_heartbeat  # adopt(): a heartbeat resets only itself
                counters.last_heartbeat = step if last is None else max(last, step)
            return Decision.quick(
                step,
                tier,
                score,
                components,
                interval,
                rule,
                quiet,
                anomaly,
                multiplier,
                warning,
                memory_every,
            )
        due = counters.due(
            step,
            self.tiers,
            interval=interval,
            score=score,
            pulse_now_score=sp.pulse_now_score,
            run_seconds=run_seconds,
            weights_ok=loss_ok,
            memory_interval=memory_every,
        )
        decision = Decision(
            step=step,
            save=due.tier is not None,
            tier=due.tier,
            lightweight=due.lightweight,
            emergency=due.emergency,
            high_risk=due.high_risk,
            score=score,
            components=components,
            interval=interval,
            interval_rule=rule,
            reason=due.reason,
            anomaly=anomaly,
            hazard=multiplier,
            warning=warning,
            memory=due.memory,
            memory_interval=memory_every,
        )
        self.adopt(decision)
        return decision

    # ------------------------------------------------------------------ rules

    def interval_for(self, score: float, hazard: float = 1.0) -> tuple[int, str]:
        """The dynamic pulse interval for ``score`` at hazard multiplier ``hazard``, and the
        rule that set it."""
        uncovered = self.tiers.memory.uncovered_share if self._memory_on else 1.0
        return pulse_interval(score, self.spec, self.tiers.pulse, self._costs, hazard, uncovered)

    def young_daly_steps(self) -> int | None:
        """The uncapped Young/Daly interval in steps, when cost and step time are known."""
        return self._costs.young_daly_steps()

    def loss_slope(self) -> float | None:
        """Current recursive slope of the log-loss in decades per step (None before any)."""
        return self._loss.slope()

    def _track_time(self, step: int, now: float) -> None:
        prev_step, prev_now = self._last_step, self._last_now
        if prev_step is None:
            self._counters.first_step = step
        elif step <= prev_step:  # resumed from an older checkpoint: trends restart
            self._loss.rewind()
            self._grad.rewind()
            self._counters.rewind(step)
        elif prev_now is not None and self._costs.measure_steps(now - prev_now, step - prev_step):
            self._hazard.observe_seconds(now - prev_now)
        self._last_step = step
        self._last_now = now
        self._costs.reset_stall()
