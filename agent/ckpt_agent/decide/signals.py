"""The scheduler's three signal layers (pure, no I/O): loss, gradient, system.

Each layer folds one step's signal into a small state and says whether it
*fires*; :class:`~ckpt_agent.decide.scheduler.AdaptiveScheduler` sums the
weights of the fired layers into the score. Every number is a field of
:class:`~ckpt_agent.policy.scheduler_models.SchedulerSpec`.

* **Loss layer** (weight 0.4): the loss is mapped to ``x = log10(max(loss, 0) + eps)``;
  the slope is a recursive EWMA of its per-step differences,
  ``slope_t = α·(x_t − x_(t−1)) + (1 − α)·slope_(t−1)`` (α 0.2, decades per step),
  and must exceed 0.05 in absolute value for 3 consecutive steps, after a
  warm-up of 3 differences. A loss ×0.8 per step crosses 0.05 at the 4th
  difference and fires at the 6th (step 7); ±10 % noise on a plateau gives a
  slope of about 0.005 rms and never fires. Once 20 losses are in
  (``window``), a loss more than ``spike_decades`` above the smoothed
  log-loss (an EWMA with the same α) is reported as a ``loss_spike``.
* **Gradient layer** (weight 0.35): the global gradient norm is sampled at most
  once every 10 steps (:meth:`GradientLayer.wants` tells the engine when); the
  last 50 samples are kept; a sample outside mean ± 3 std of the previous
  samples is anomalous (``std_multiplier``; 1 std fires on stationary noise
  about once every 10–18 samples); 2 anomalous samples in a row fire the layer
  and request a *lightweight* pulse (weights + RNG) right now.
* **System layer** (weight 0.25): new GPU errors, a storage write latency
  above 15 ms sustained for 5 s, or a node warning (NotReady, pressure, cordon,
  an impending-termination taint, DisruptionTarget) fire the layer and request
  an emergency checkpoint, once per alarm episode (:attr:`SystemLayer.owed`:
  a warning that holds for hours saves once, not every cooldown). Missing
  metrics are healthy (the engine reports a write latency only while its sample
  is recent, so a pause between saves ends a latency episode). While it fires, a
  *warning* holds (:mod:`ckpt_agent.decide.hazard`).

Non-finite values are never folded (the caller checks with :func:`finite`).
Each layer's ``state_dict`` is a flat slice of the scheduler's state dict.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_agent.policy.scheduler_models import GradientLayerSpec, LossLayerSpec, SystemLayerSpec

__all__ = ["GradientLayer", "LossLayer", "SystemLayer", "SystemSignals", "ewma", "finite"]


def finite(x: float | None) -> bool:
    """``x`` is a number, not NaN or ±inf."""
    return x is not None and math.isfinite(x)


def ewma(prev: float, x: float, alpha: float) -> float:
    """One step of an exponentially weighted moving average."""
    return alpha * x + (1.0 - alpha) * prev


@dataclass(frozen=True)
class SystemSignals:
    """Health metrics sampled by the engine at one step (``None``: not measured = healthy).

    Time comes from the ``now`` argument of
    :meth:`~ckpt_agent.decide.scheduler.AdaptiveScheduler.observe`.
    """

    gpu_errors: int | None = None
    """GPU errors (XID/ECC) observed *since the previous sample* (a delta, not a total)."""
    write_latency_ms: float | None = None
    """Latest storage write latency in milliseconds."""
    node_warning: str | None = None
    """A warning about this pod's node, while it holds (NotReady, memory/disk pressure,
    cordon, an impending-termination taint, DisruptionTarget): what it is, in words."""


class LossLayer:
    """Trend of the log-loss: fires while its recursive slope is steep."""

    def __init__(self, spec: LossLayerSpec) -> None:
        self.spec = spec
        self.ewma: float | None = None
        """Smoothed log-loss (spikes are measured against it)."""
        self.last: float | None = None
        """The previous log-loss."""
        self.trend = 0.0
        """Recursive EWMA of the log-loss differences (decades per step)."""
        self.folded = 0
        """Differences folded in since the start or the last rewind."""
        self.streak = 0

    @property
    def fired(self) -> bool:
        return self.streak >= self.spec.consecutive_steps

    def fold(self, step: int, loss: float) -> bool:
        """Fold a finite loss in; return True when it is a spike."""
        del step
        spec = self.spec
        x = math.log10(max(loss, 0.0) + spec.epsilon)
        seen = self.folded + 1 if self.last is not None else 0
        spike = self.ewma is not None and seen >= spec.window and x - self.ewma > spec.spike_decades
        alpha = spec.ewma_alpha  # ewma() inlined below: this runs every step
        if self.last is not None:
            self.trend = trend = alpha * (x - self.last) + (1.0 - alpha) * self.trend
            self.folded += 1
            steep = self.folded >= spec.warmup_steps and abs(trend) > spec.slope_threshold
            self.streak = self.streak + 1 if steep else 0
        self.last = x
        self.ewma = x if self.ewma is None else alpha * x + (1.0 - alpha) * self.ewma
        return spike

    def slope(self) -> float | None:
        """Current slope in decades per step (None before any difference)."""
        return None if self.folded == 0 else self.trend

    def rewind(self) -> None:
        """The run went back: the trend restarts."""
        self.ewma = None
        self.last = None
        self.trend = 0.0
        self.folded = 0
        self.streak = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "ewma": self.ewma,
            "loss_last": self.last,
            "loss_trend": self.trend,
            "loss_folded": self.folded,
            "loss_streak": self.streak,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ewma = state.get("ewma")
        self.last = state.get("loss_last")
        self.trend = float(state.get("loss_trend", 0.0))
        self.folded = int(state.get("loss_folded", 0))
        self.streak = int(state.get("loss_streak", 0))


class GradientLayer:
    """Outliers of the sampled gradient norm: fires on consecutive anomalous samples."""

    def __init__(self, spec: GradientLayerSpec) -> None:
        self.spec = spec
        self.samples: deque[float] = deque(maxlen=spec.history)
        self.streak = 0
        self.last_sample_step: int | None = None

    @property
    def fired(self) -> bool:
        return self.streak >= self.spec.consecutive_anomalies

    def wants(self, step: int) -> bool:
        """True when a gradient norm at ``step`` would be sampled."""
        last = self.last_sample_step
        return last is None or step - last >= self.spec.sample_every or step < last

    def fold(self, step: int, grad_norm: float) -> bool:
        """Sample a finite gradient norm; return True when the layer fires at this sample."""
        g = self.spec
        self.last_sample_step = step
        anomalous = False
        if len(self.samples) >= g.min_samples:
            n = len(self.samples)
            mean = math.fsum(self.samples) / n
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.samples) / n)
            dev = abs(grad_norm - mean)
            anomalous = dev > g.std_multiplier * std and not math.isclose(
                grad_norm, mean, rel_tol=1e-9, abs_tol=1e-12
            )
        self.samples.append(grad_norm)
        self.streak = self.streak + 1 if anomalous else 0
        return self.streak == g.consecutive_anomalies

    def rewind(self) -> None:
        """The run went back: the streak restarts and the next step is sampled."""
        self.streak = 0
        self.last_sample_step = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "grad_samples": list(self.samples),
            "grad_streak": self.streak,
            "last_grad_sample_step": self.last_sample_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.samples.clear()
        self.samples.extend(float(x) for x in state.get("grad_samples", []))
        self.streak = int(state.get("grad_streak", 0))
        self.last_sample_step = state.get("last_grad_sample_step")


_QUIET = (False, "")
""":meth:`SystemLayer.check`'s answer when nothing fires."""


class SystemLayer:
    """GPU errors, sustained storage latency, node warnings: fires while it is risky.

    It also tells *episodes* apart, so that a long warning (a cordon of hours) gets one
    emergency save, not one per cooldown: :attr:`owed` is set when an alarm is new — new
    GPU errors (always new evidence: the count is a delta), the latency becoming
    sustained, a node warning appearing or changing its text — and cleared by the
    scheduler when it takes the save, or when the layer stops firing (the episode ended).
    """

    def __init__(self, spec: SystemLayerSpec) -> None:
        self.spec = spec
        self.latency_high_since: float | None = None
        self.alarms: tuple[str, ...] = ()
        """The level alarms of the last check (``latency``, ``node:<text>``)."""
        self.owed = False
        """A new alarm episode has not had its emergency save yet."""
        self.fresh = False
        """The last check raised a new alarm (a new episode starts)."""

    def check(self, signals: SystemSignals | None, now: float) -> tuple[bool, str]:
        """Fold one sample in; return (fired, why)."""
        if signals is None:  # no metrics: healthy, and any episode is over
            self.latency_high_since = None
            self.alarms, self.fresh, self.owed = (), False, False
            return _QUIET
        s = self.spec
        gpu_n, lat = signals.gpu_errors, signals.write_latency_ms
        if (
            (gpu_n is None or not gpu_n > s.gpu_error_threshold)
            and not signals.node_warning
            and (lat is None or not lat > s.write_latency_ms or not math.isfinite(lat))
        ):  # nothing fires (the common case): what the full check below would leave
            self.latency_high_since = None
            self.alarms, self.fresh, self.owed = (), False, False
            return _QUIET
        why: list[str] = []
        alarms: list[str] = []
        gpu = signals.gpu_errors is not None and signals.gpu_errors > s.gpu_error_threshold
        if gpu:
            why.append(f"gpu_errors={signals.gpu_errors}")
        if signals.node_warning:
            why.append(f"node warning: {signals.node_warning}")
            alarms.append(f"node:{signals.node_warning}")
        lat = signals.write_latency_ms
        if lat is not None and math.isfinite(lat) and lat > s.write_latency_ms:
            if self.latency_high_since is None:
                self.latency_high_since = now
            held = now - self.latency_high_since
            if held >= s.sustained_seconds:
                why.append(
                    f"write latency {lat:.1f} ms > {s.write_latency_ms:g} ms for {held:.1f} s"
                )
                alarms.append("latency")
        else:
            self.latency_high_since = None
        self.fresh = gpu or any(a not in self.alarms for a in alarms)
        self.alarms = tuple(alarms)
        fired = bool(why)
        self.owed = fired and (self.owed or self.fresh)
        return fired, ", ".join(why)

    def state_dict(self) -> dict[str, Any]:
        return {
            "latency_high_since": self.latency_high_since,
            "system_alarms": list(self.alarms),
            "system_owed": self.owed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.latency_high_since = state.get("latency_high_since")
        self.alarms = tuple(str(a) for a in state.get("system_alarms", ()))
        self.owed = bool(state.get("system_owed", False))
