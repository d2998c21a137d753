"""The scheduler's three signal layers (pure, no I/O): loss, gradient, system.

Each layer folds one step's signal into a small state and says whether it
*fires*; :class:`~ckpt_agent.decide.scheduler.AdaptiveScheduler` sums the
weights of the fired layers into the score. Every number is a field of
:class:`~ckpt_agent.policy.models.SchedulerSpec`.

* **Loss layer** (weight 0.4): the loss is mapped to ``log10(max(loss, 0) + eps)``,
  smoothed by an EWMA (alpha 0.2); the least-squares slope of the last 20
  smoothed points, expressed in decades per window (per-step slope × window),
  must exceed 0.05 in absolute value for 3 consecutive steps. A loss more than
  ``spike_decades`` above the smoothed value is reported as a ``loss_spike``.
* **Gradient layer** (weight 0.35): the global gradient norm is sampled at most
  once every 10 steps (:meth:`GradientLayer.wants` tells the engine when); the
  last 50 samples are kept; a sample outside mean ± 1 std of the previous
  samples is anomalous; 2 anomalous samples in a row fire the layer and
  request a *lightweight* pulse (weights + RNG) right now.
* **System layer** (weight 0.25): new GPU errors, or a storage write latency
  above 15 ms sustained for 5 s, fire the layer and request an emergency
  checkpoint. Missing metrics are healthy.

Non-finite values are never folded (the caller checks with :func:`finite`).
Each layer's ``state_dict`` is a flat slice of the scheduler's state dict.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_agent.policy.models import GradientLayerSpec, LossLayerSpec, SystemLayerSpec

__all__ = ["GradientLayer", "LossLayer", "SystemLayer", "SystemSignals", "ewma", "finite"]


def finite(x: float | None) -> bool:
    """``x`` is a number, not NaN or ±inf."""
    return x is not None and math.isfinite(x)


def ewma(prev: float, x: float, alpha: float) -> float:
    """One step of an exponentially weighted moving average."""
    return alpha * x + (1.0 - alpha) * prev


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


class LossLayer:
    """Trend of the log-loss: fires while its smoothed slope is steep."""

    def __init__(self, spec: LossLayerSpec) -> None:
        self.spec = spec
        self.ewma: float | None = None
        self.window: deque[tuple[int, float]] = deque(maxlen=spec.window)
        self.streak = 0

    @property
    def fired(self) -> bool:
        return self.streak >= self.spec.consecutive_steps

    def fold(self, step: int, loss: float) -> bool:
        """Fold a finite loss in; return True when it is a spike."""
        spec = self.spec
        x = math.log10(max(loss, 0.0) + spec.epsilon)
        spike = (
            self.ewma is not None
            and len(self.window) >= spec.window
            and x - self.ewma > spec.spike_decades
        )
        self.ewma = x if self.ewma is None else ewma(self.ewma, x, spec.ewma_alpha)
        self.window.append((step, self.ewma))
        if len(self.window) >= spec.window:
            slope = _ls_slope(self.window) * spec.window
            self.streak = self.streak + 1 if abs(slope) > spec.slope_threshold else 0
        return spike

    def slope(self) -> float | None:
        """Current smoothed slope in decades per window (None until the window is full)."""
        if len(self.window) < self.spec.window:
            return None
        return _ls_slope(self.window) * self.spec.window

    def rewind(self) -> None:
        """The run went back: the trend restarts."""
        self.ewma = None
        self.window.clear()
        self.streak = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "ewma": self.ewma,
            "loss_window": [[s, v] for s, v in self.window],
            "loss_streak": self.streak,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ewma = state.get("ewma")
        self.window.clear()
        self.window.extend((int(s), float(v)) for s, v in state.get("loss_window", []))
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
            mean = statistics.fmean(self.samples)
            std = statistics.pstdev(self.samples, mu=mean)
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


class SystemLayer:
    """GPU errors and sustained storage latency: fires while the environment is risky."""

    def __init__(self, spec: SystemLayerSpec) -> None:
        self.spec = spec
        self.latency_high_since: float | None = None

    def check(self, signals: SystemSignals | None, now: float) -> tuple[bool, str]:
        """Fold one sample in; return (fired, why)."""
        s = self.spec
        if signals is None:
            self.latency_high_since = None
            return False, ""
        why: list[str] = []
        if signals.gpu_errors is not None and signals.gpu_errors > s.gpu_error_threshold:
            why.append(f"gpu_errors={signals.gpu_errors}")
        lat = signals.write_latency_ms
        if lat is not None and math.isfinite(lat) and lat > s.write_latency_ms:
            if self.latency_high_since is None:
                self.latency_high_since = now
            held = now - self.latency_high_since
            if held >= s.sustained_seconds:
                why.append(
                    f"write latency {lat:.1f} ms > {s.write_latency_ms:g} ms for {held:.1f} s"
                )
        else:
            self.latency_high_since = None
        return bool(why), ", ".join(why)

    def state_dict(self) -> dict[str, Any]:
        return {"latency_high_since": self.latency_high_since}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.latency_high_since = state.get("latency_high_since")
