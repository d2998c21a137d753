"""The checkpoint policies the simulator replays (pure): fixed intervals, the oracle, the scheduler.

:class:`Policy` is what :func:`ckpt_agent.decide.simulate.replay` drives: at each
step it answers :data:`SAVE`, :data:`LIGHT` (a lightweight pulse) or None, is
told what a save cost, and stores and restores its state with a save.
:class:`FixedPolicy` (with the scheduler's full-tier cadence, :func:`full_now`)
and :class:`OraclePolicy` are the baselines; :class:`SchedulerPolicy` wraps the
real :class:`~ckpt_agent.decide.scheduler.AdaptiveScheduler`,
:class:`RefinedPolicy` refines its MTBF at each restart as the operator does, and
:class:`SeedScheduler` is the seed's interval rules. Which rows
:func:`~ckpt_agent.decide.simulate.compare` builds from them is said there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ckpt_agent.decide.decision import Decision, SaveOutcome
from ckpt_agent.decide.intervals import bound_interval
from ckpt_agent.decide.mtbf import estimate_mtbf
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.decide.traces import Alert
from ckpt_agent.policy.models import Tier

__all__ = [
    "LIGHT",
    "REFINED",
    "SAVE",
    "FixedPolicy",
    "OraclePolicy",
    "Policy",
    "RefinedPolicy",
    "SchedulerPolicy",
    "SeedScheduler",
    "full_now",
]

SAVE, LIGHT = "save", "light"
"""What a policy asks for at a step (or None)."""


class Policy(Protocol):
    """A checkpoint policy as the simulator drives it."""

    name: str

    def decide(
        self, step: int, now: float, loss: float, grad: float, alert: Alert | None
    ) -> str | None:
        """:data:`SAVE`, :data:`LIGHT` or None after ``step`` finished at ``now``."""
        ...

    def taken(self, stall: float, persist: float) -> None:
        """The save just asked for stalled ``stall`` s and persists in ``persist`` s."""
        ...

    def snapshot(self) -> Any:
        """What the policy stores with a save."""
        ...

    def restore(self, snap: Any) -> None:
        """Resume from a save's snapshot (None: from the start)."""
        ...


def full_now(since_save: int, since_full: int, every: int, full_every: int | None) -> bool:
    """The scheduler's full-tier rule (:mod:`ckpt_agent.decide.tiers`) for a save due now:
    a full every ``full_every`` steps, and a pulse due when the full comes due within a
    quarter of the pulse interval is taken as the full."""
    if full_every is None:
        return False
    return since_full >= full_every or (
        since_save >= every and 4 * (full_every - since_full) <= every
    )


class FixedPolicy:
    """A save every ``every`` steps (``full_every``: and the full tier's cadence besides,
    by the scheduler's rules: a full resets the pulse count)."""

    def __init__(self, name: str, every: int, full_every: int | None = None) -> None:
        self.name = name
        self.every = max(1, every)
        self.full_every = full_every
        self.last = 0
        self.last_full = 0

    def decide(
        self, step: int, now: float, loss: float, grad: float, alert: Alert | None
    ) -> str | None:
        del now, loss, grad, alert
        full = full_now(step - self.last, step - self.last_full, self.every, self.full_every)
        if full or step - self.last >= self.every:
            self.last = step
            self.last_full = step if full else self.last_full
            return SAVE
        return None

    def taken(self, stall: float, persist: float) -> None:
        del stall, persist

    def snapshot(self) -> Any:
        return (self.last, self.last_full)

    def restore(self, snap: Any) -> None:
        self.last, self.last_full = (0, 0) if snap is None else snap


class OraclePolicy(FixedPolicy):
    """``calm`` steps apart while calm; a save at a warning's onset, then every ``alarm`` steps."""

    def __init__(self, name: str, calm: int, alarm: int) -> None:
        super().__init__(name, calm)
        self.alarm = max(1, alarm)
        self.in_alarm = False

    def decide(
        self, step: int, now: float, loss: float, grad: float, alert: Alert | None
    ) -> str | None:
        del now, loss, grad
        onset = alert is not None and not self.in_alarm
        self.in_alarm = alert is not None
        every = self.alarm if self.in_alarm else self.every
        if onset or step - self.last >= every:
            self.last = step
            return SAVE
        return None


_CALM = SystemSignals(gpu_errors=0, write_latency_ms=5.0)
_SIGNALS = {
    "latency": SystemSignals(gpu_errors=0, write_latency_ms=50.0),
    "node": SystemSignals(gpu_errors=0, write_latency_ms=5.0, node_warning="NotReady"),
    "gpu": SystemSignals(gpu_errors=1, write_latency_ms=5.0),
}


class SchedulerPolicy:
    """The real scheduler: ``make()`` builds a fresh one (also after a restart)."""

    def __init__(self, name: str, make: Callable[[], AdaptiveScheduler]) -> None:
        self.name = name
        self.make = make
        self.scheduler = make()
        self.last: Decision | None = None
        self.gpu_seen: Alert | None = None

    def decide(
        self, step: int, now: float, loss: float, grad: float, alert: Alert | None
    ) -> str | None:
        s = self.scheduler
        signals = _CALM
        if alert is not None:
            # GPU errors are a delta: reported once per alert
            signals = (
                _SIGNALS[alert.kind] if alert.kind != "gpu" or self.gpu_seen != alert else _CALM
            )
            self.gpu_seen = alert if alert.kind == "gpu" else self.gpu_seen
        g = grad if s.wants_grad_norm(step) else None
        d = s.observe(step, loss, g, system=signals, now=now)
        self.last = d
        if d.tier in (Tier.PULSE, Tier.FULL):
            return LIGHT if d.lightweight else SAVE
        return None

    def taken(self, stall: float, persist: float) -> None:
        d = self.last
        assert d is not None and d.tier is not None
        self.scheduler.settle(SaveOutcome.taken(d, stall_seconds=stall))
        if not d.lightweight:
            self.scheduler.settle(SaveOutcome.persisted(d.tier, persist, step=d.step))

    def snapshot(self) -> Any:
        return self.scheduler.state_dict()

    def restore(self, snap: Any) -> None:
        self.scheduler = self.make()
        if snap is not None:
            self.scheduler.load_state_dict(snap)


class RefinedPolicy(SchedulerPolicy):
    """The scheduler whose MTBF starts at the policy's prior and is refined at every
    restart as the operator does: ``failures`` so far over the time since the start
    (the run starts at 0; the failure is taken at the last step's time)."""

    def __init__(self, name: str, make: Callable[[], AdaptiveScheduler]) -> None:
        super().__init__(name, make)
        self.prior = self.scheduler.mtbf_seconds
        self.failures = 0
        self.now = 0.0

    def decide(
        self, step: int, now: float, loss: float, grad: float, alert: Alert | None
    ) -> str | None:
        self.now = now
        return super().decide(step, now, loss, grad, alert)

    def restore(self, snap: Any) -> None:
        super().restore(snap)
        self.failures += 1
        self.scheduler.set_mtbf(estimate_mtbf(self.prior, self.failures, self.now))


REFINED = "adaptive (prior→refined)"
"""The :class:`RefinedPolicy` row of :func:`compare`."""


class SeedScheduler(AdaptiveScheduler):
    """The seed's interval rules, literally: ``base · (1 − score)``, capped by Young/Daly
    with the baseline MTBF, then the stall-budget floor and the policy's bounds; no hazard."""

    def interval_for(self, score: float, hazard: float = 1.0) -> tuple[int, str]:
        del hazard
        spec, pulse = self.spec, self.tiers.pulse
        capped = min(max(score, 0.0), spec.max_interval_score)
        interval = max(1, int(pulse.base_interval * (1.0 - capped) + 0.5))
        rule = "base" if score <= 0 else "score"
        yd = self._costs.young_daly_steps() if spec.risk.enabled else None
        if yd is not None and yd < interval:
            interval, rule = yd, "young_daly"
        return bound_interval(interval, rule, spec, pulse, self._costs)
