"""The policy's ``scheduler`` section: the loss, gradient and system layers, and the risk model.

Part of the ``CheckpointPolicy`` model (:mod:`ckpt_agent.policy.models`, the
CRD's single source of truth); the decisions these settings drive are
:mod:`ckpt_agent.decide.scheduler`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ckpt_agent.policy.schema_base import CamelModel, Fraction, PositiveInt

__all__ = ["GradientLayerSpec", "LossLayerSpec", "RiskSpec", "SchedulerSpec", "SystemLayerSpec"]


class LossLayerSpec(CamelModel):
    """Fast-phase detector on the loss curve (works on log10(loss + epsilon)).

    The slope is a recursive EWMA of the per-step differences of the log-loss:
    ``slope_t = alpha·Δ_t + (1 − alpha)·slope_(t−1)`` (decades per step)."""

    weight: Fraction = 0.4
    """Score contribution when the layer fires."""
    ewma_alpha: Annotated[float, Field(gt=0.0, le=1.0)] = 0.2
    """Smoothing factor of the EWMA over the log-loss differences (and of the smoothed log-loss
    that spikes are measured against)."""
    window: Annotated[int, Field(ge=2, le=10_000)] = 20
    """Losses seen before a `loss_spike` can be reported (the slope no longer uses it: it was
    once fitted over this many points)."""
    slope_threshold: Annotated[float, Field(gt=0.0)] = 0.05
    """|slope| of the log10-loss, in decades per step, above which the run is in a fast phase.

    0.05 decades per step is the loss falling (or rising) about 11 % per step."""
    consecutive_steps: PositiveInt = 3
    """Steps in a row the slope must exceed the threshold before the layer fires."""
    warmup_steps: Annotated[int, Field(ge=0, le=10_000)] = 3
    """Loss differences folded in before the layer may fire."""
    epsilon: Annotated[float, Field(gt=0.0)] = 1e-8
    """Added to the loss before the log transform."""
    spike_decades: Annotated[float, Field(gt=0.0)] = 0.5
    """A loss this many decades (log10) above the smoothed loss is a `loss_spike` anomaly.

    0.5 decades is about 3.2x the smoothed loss. Only reported (it pins the last
    known good checkpoint in retention); it adds nothing to the score."""


class GradientLayerSpec(CamelModel):
    """Gradient-norm anomaly detector."""

    weight: Fraction = 0.35
    """Score contribution when the layer fires."""
    sample_every: PositiveInt = 10
    """Sample the global gradient L2 norm every N steps."""
    history: Annotated[int, Field(ge=2, le=100_000)] = 50
    """Samples kept for mean and standard deviation."""
    std_multiplier: Annotated[float, Field(gt=0.0)] = 3.0
    """A sample outside mean ± k·std of the previous samples is anomalous.

    With 2 in a row, k = 3 fires about once per 33,000 samples of stationary Gaussian noise
    (18 firings in 3 × 200,000 samples), and still catches the simulator's × 5 gradient
    spikes (k = 1, the original design, fires about once every 10-18 samples: see
    docs/performance.md)."""
    consecutive_anomalies: PositiveInt = 2
    """Anomalous samples in a row that fire the layer (and request a lightweight pulse)."""
    min_samples: Annotated[int, Field(ge=2)] = 5
    """Samples needed before anything can be called anomalous."""


class SystemLayerSpec(CamelModel):
    """System-health alarm (GPU errors, slow storage)."""

    weight: Fraction = 0.25
    """Score contribution when the layer fires."""
    gpu_error_threshold: Annotated[int, Field(ge=0)] = 0
    """GPU error count above which the layer fires."""
    write_latency_ms: Annotated[float, Field(gt=0.0)] = 15.0
    """Storage write latency (ms) that is unhealthy when sustained."""
    sustained_seconds: Annotated[float, Field(ge=0.0)] = 5.0
    """How long the latency must stay above the threshold."""
    emergency_tier: Literal["pulse", "full"] = "full"
    """Tier of the emergency checkpoint requested when the layer fires: once per alarm
    episode (a warning that holds for hours saves once; new GPU errors, another node
    warning, or the alarm cleared and raised again is a new episode)."""
    emergency_cooldown_steps: Annotated[int, Field(ge=0)] = 100
    """Minimum steps between two emergency checkpoints (a new episode's save waits)."""


class RiskSpec(CamelModel):
    """Hazard-aware pulse interval (Young/Daly) and a stall budget.

    The pulse interval follows the Young/Daly optimum sqrt(2·cost·M) with M the MTBF
    of the failures no warning announces (`mtbfSeconds` / (1 − warned share)) while
    calm, and `warningMtbfSeconds` while a warning holds (system alarm or node warning)."""

    enabled: bool = True
    """Set the pulse interval from the Young/Daly optimum (else `baseInterval` and the score)."""
    mtbf_seconds: Annotated[float, Field(gt=0.0)] = 86_400.0
    """Mean time between failures of the job: the prior the operator refines at every
    restart from the run's failures and those of other runs on its node pool."""
    stall_budget: Annotated[float, Field(gt=0.0, le=1.0)] = 0.03
    """Maximum fraction of training time spent stalled in checkpoint saves."""
    warned_fraction: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """Share of failures a warning announces; unset: learned from the warnings seen
    (warning episodes per MTBF of observed time), at most `maxWarnedFraction`."""
    max_warned_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = 0.9
    """Upper bound of the learned warned share (the calm interval grows at most
    1/sqrt(1 − this) times the plain Young/Daly interval)."""
    warning_mtbf_seconds: Annotated[float, Field(gt=0.0)] = 120.0
    """Expected seconds to a failure while a warning holds (the hazard multiplier is
    `mtbfSeconds` / this, at least 1). A warning older than this decays by
    exp(-(age - this)/this) and ends at the calm hazard."""
    warning_hold_seconds: Annotated[float, Field(ge=0.0)] = 60.0
    """A warning still holds this long after its last signal, then the interval relaxes."""


class SchedulerSpec(CamelModel):
    """When to save: the three-layer adaptive score."""

    loss: LossLayerSpec = Field(default_factory=LossLayerSpec)
    """Loss-curve layer."""
    gradient: GradientLayerSpec = Field(default_factory=GradientLayerSpec)
    """Gradient-norm layer."""
    system: SystemLayerSpec = Field(default_factory=SystemLayerSpec)
    """System-health layer."""
    pulse_now_score: Fraction = 0.7
    """A score at or above this triggers a pulse immediately."""
    max_interval_score: Fraction = 0.95
    """The score is capped at this value when shrinking the interval."""
    risk: RiskSpec = Field(default_factory=RiskSpec)
    """Hazard-aware Young/Daly interval and stall budget."""
