"""The ``CheckpointPolicy`` model: the single source of truth.

Everything that means something about a policy is defined here once:

* the CRD's OpenAPI schema (``crds/`` and the chart are generated from these
  classes by ``python -m ckpt_agent.policy.crdgen``; a test fails on drift);
* the agent's runtime configuration (:mod:`ckpt_agent.policy.agent_config`);
* the defaults every component falls back to.

The shared base (camelCase, CEL rules) is :mod:`ckpt_agent.policy.schema_base`; the
storage section is :mod:`ckpt_agent.policy.storage_models` (re-exported here).

Field names are camelCase on the wire (Kubernetes convention) and snake_case in
Python. Cross-field rules are written twice on purpose, in the same words: as a
pydantic validator (for the agent and the operator) and as a CEL rule
(``x-kubernetes-validations``) so that the API server itself rejects a bad
policy at ``kubectl apply`` time, naming the field.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt_agent.policy.schema_base import (
    CamelModel,
    Fraction,
    PositiveInt,
    cel,
)
from ckpt_agent.policy.storage_models import (
    LocalStorageSpec,
    S3StorageSpec,
    SecretKeyRef,
    ServerSideEncryptionSpec,
    SSEMode,
    StorageSpec,
    StorageType,
)

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "AgentSpec",
    "CamelModel",
    "CheckpointPolicy",
    "CheckpointPolicySpec",
    "CheckpointPolicyStatus",
    "CompressionSpec",
    "Condition",
    "Fraction",
    "FullTierSpec",
    "GradientLayerSpec",
    "HeartbeatTierSpec",
    "JobCheckpointStatus",
    "LocalStorageSpec",
    "LossLayerSpec",
    "ObjectMeta",
    "PositiveInt",
    "PulseTierSpec",
    "RecoverySpec",
    "RetentionSpec",
    "RiskSpec",
    "S3StorageSpec",
    "SSEMode",
    "SchedulerSpec",
    "SecretKeyRef",
    "ServerSideEncryptionSpec",
    "StorageSpec",
    "StorageType",
    "SystemLayerSpec",
    "Tier",
    "TiersSpec",
    "ValidationSpec",
    "cel",
]

API_GROUP = "ckpt.dev"
API_VERSION = "v1alpha1"
KIND = "CheckpointPolicy"
PLURAL = "checkpointpolicies"
SINGULAR = "checkpointpolicy"
SHORT_NAMES = ["ckptpol"]


class Tier(StrEnum):
    """Checkpoint tiers, cheapest first."""

    HEARTBEAT = "heartbeat"
    """L0: step, epoch, data position and every RNG state. Tiny, every step."""
    PULSE = "pulse"
    """L1: weights + optimizer + LR scheduler + AMP scaler. Adaptive interval."""
    FULL = "full"
    """L2: everything in a pulse plus the training config. Periodic."""


# --------------------------------------------------------------------------- scheduler


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


# --------------------------------------------------------------------------- tiers


class HeartbeatTierSpec(CamelModel):
    """L0 heartbeat settings."""

    enabled: bool = True
    """Write heartbeats at all."""
    every_steps: PositiveInt = 1
    """Write a heartbeat every N steps."""


class PulseTierSpec(CamelModel):
    """L1 pulse settings: the dynamic interval is clamp(base·(1−score), min, max)."""

    base_interval: PositiveInt = 100
    """Interval in steps when the score is 0."""
    min_interval: PositiveInt = 10
    """Lower clamp of the dynamic interval, in steps."""
    max_interval: PositiveInt = 500
    """Upper clamp; a pulse is always taken at least this often."""


class FullTierSpec(CamelModel):
    """L2 full checkpoint settings."""

    every_steps: PositiveInt = 1000
    """Full checkpoint period in steps."""
    long_run_every_steps: PositiveInt = 500
    """Period once the job has run longer than `longRunAfterHours`."""
    long_run_after_hours: Annotated[float, Field(gt=0.0)] = 360.0
    """Wall-clock age (hours) after which the long-run period applies (default 15 days)."""


class TiersSpec(CamelModel):
    """Per-tier frequencies."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.pulse.minInterval <= self.pulse.maxInterval",
                    "pulse.minInterval must be <= pulse.maxInterval",
                    ".pulse.minInterval",
                ),
                cel(
                    "self.pulse.minInterval <= self.pulse.baseInterval"
                    " && self.pulse.baseInterval <= self.pulse.maxInterval",
                    "pulse.baseInterval must lie within [minInterval, maxInterval]",
                    ".pulse.baseInterval",
                ),
            ]
        }
    )

    heartbeat: HeartbeatTierSpec = Field(default_factory=HeartbeatTierSpec)
    """L0 heartbeat."""
    pulse: PulseTierSpec = Field(default_factory=PulseTierSpec)
    """L1 pulse."""
    full: FullTierSpec = Field(default_factory=FullTierSpec)
    """L2 full."""

    @model_validator(mode="after")
    def _check_intervals(self) -> TiersSpec:
        p = self.pulse
        if p.min_interval > p.max_interval:
            raise ValueError("tiers.pulse.minInterval must be <= pulse.maxInterval")
        if not p.min_interval <= p.base_interval <= p.max_interval:
            raise ValueError("tiers.pulse.baseInterval must lie within [minInterval, maxInterval]")
        return self


# ----------------------------------------------------------------- compression / validation


class CompressionSpec(CamelModel):
    """Payload compression."""

    codec: Literal["auto", "none", "zstd"] = "auto"
    """Codec for tensor payloads: `auto` compresses a blob only where that makes the save
    faster (slow storage such as S3 or a network filesystem, or data that compresses well),
    from the storage's measured write speed and the compressor's speed and ratio on this
    run's data; `zstd` always; `none` never. Each blob records its codec."""
    level: Annotated[int, Field(ge=1, le=22)] = 3
    """zstd level."""
    byte_shuffle: bool = True
    """Byte-shuffle float data before compressing (helps fp32/bf16)."""
    min_size_bytes: Annotated[int, Field(ge=0)] = 4096
    """Blobs smaller than this are stored uncompressed."""


class ValidationSpec(CamelModel):
    """What is checked before a checkpoint is recorded as valid."""

    verify_hashes: bool = True
    """Re-read every blob and compare its SHA-256."""
    load_in_subprocess: bool = True
    """Load the checkpoint in a separate process (not a thread)."""
    check_shapes: bool = True
    """Compare every tensor's shape and dtype with the live model."""


# --------------------------------------------------------------------------- retention


class RetentionSpec(CamelModel):
    """Retention classes by score, and optional budgets."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "self.importantScore <= self.criticalScore",
                    "importantScore must be <= criticalScore",
                    ".importantScore",
                )
            ]
        }
    )

    critical_score: Fraction = 0.8
    """Score at or above which a checkpoint is critical (kept forever)."""
    important_score: Fraction = 0.5
    """Score at or above which a checkpoint is important."""
    important_keep: PositiveInt = 3
    """Important checkpoints kept (newest first)."""
    routine_keep: PositiveInt = 1
    """Routine checkpoints kept (newest first)."""
    max_age_hours: Annotated[float, Field(gt=0.0)] | None = None
    """Delete non-protected checkpoints older than this."""
    max_total_gb: Annotated[float, Field(gt=0.0)] | None = None
    """Delete the oldest non-protected checkpoints beyond this total size."""
    reconcile_interval_seconds: Annotated[int, Field(ge=10)] = 300
    """How often the operator applies retention to storage."""

    @model_validator(mode="after")
    def _ordered(self) -> RetentionSpec:
        if self.important_score > self.critical_score:
            raise ValueError("retention.importantScore must be <= retention.criticalScore")
        return self


# --------------------------------------------------------------------------- recovery


class RecoverySpec(CamelModel):
    """Automatic resume of failed jobs."""

    auto_resume: bool = True
    """Restart failed opted-in jobs from the last valid checkpoint."""
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = 3
    """Restarts across the whole chain of a run."""
    backoff_seconds: Annotated[float, Field(ge=0.0)] = 10.0
    """Delay before the first restart; doubles each time."""
    max_backoff_seconds: Annotated[float, Field(ge=0.0)] = 600.0
    """Upper bound of the backoff."""
    max_chain_links: Annotated[int, Field(ge=0, le=100)] = 5
    """How far back the ladder may follow the prev-hash chain from the newest checkpoint."""
    allow_heartbeat_rebuild: bool = True
    """Allow rebuilding from a heartbeat + saved config when no weights checkpoint is usable."""


# --------------------------------------------------------------------------- agent


class AgentSpec(CamelModel):
    """How the agent is injected into pods."""

    sidecar: bool = False
    """Run the persisting agent as a sidecar container (flash checkpoints via shared memory)."""
    image: str | None = None
    """Agent image for the sidecar (default: the operator's image)."""
    metrics_port: Annotated[int, Field(ge=1024, le=65535)] = 9400
    """Prometheus metrics port of the agent, served from ``start()`` on; the operator probes
    it when it cannot read the storage (a refused connection: no agent in the pod)."""
    shm_size_mb: Annotated[int, Field(ge=16)] = 1024
    """Size of the injected memory-backed volume for snapshots."""
    container_name: str = "pytorch"
    """Training container to configure."""
    report_deadline_seconds: Annotated[int, Field(ge=0, le=86_400)] = 300
    """A running pod whose agent has not reported in (a heartbeat or checkpoint in storage;
    storage the operator cannot read: its metrics port refuses the operator's probe, or its
    container ended without a report) after this long is flagged: the training code does
    not use the agent (0: never)."""


# --------------------------------------------------------------------------- spec / status


class CheckpointPolicySpec(CamelModel):
    """Desired checkpointing behaviour for the jobs that reference this policy."""

    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    """Adaptive scheduling."""
    tiers: TiersSpec = Field(default_factory=TiersSpec)
    """Tier frequencies."""
    storage: StorageSpec = Field(default_factory=StorageSpec)
    """Storage."""
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    """Compression."""
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    """Validation after write."""
    retention: RetentionSpec = Field(default_factory=RetentionSpec)
    """Retention classes."""
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    """Automatic recovery."""
    agent: AgentSpec = Field(default_factory=AgentSpec)
    """Agent injection."""


class Condition(CamelModel):
    """A standard Kubernetes condition."""

    model_config = ConfigDict(extra="allow")

    type: str
    """Condition type (Ready, Reconciled, ...)."""
    status: Literal["True", "False", "Unknown"]
    """Condition status."""
    reason: str = ""
    """CamelCase reason."""
    message: str = ""
    """Human-readable details."""
    last_transition_time: str | None = None
    """RFC 3339 time of the last status change."""
    observed_generation: int | None = None
    """Generation the condition was computed for."""


class JobCheckpointStatus(CamelModel):
    """The newest valid checkpoint of one job."""

    step: int
    """Global step."""
    tier: Tier
    """Tier."""
    checkpoint_id: str
    """Checkpoint id (storage key of its commit)."""
    time: str | None = None
    """When it was committed."""
    run_id: str | None = None
    """The run (in ``lastVerifiedCheckpoint``; ``lastValid`` is keyed by run)."""
    source: Literal["storage", "pods"] | None = None
    """Who said so: the operator's own listing of the storage, or the pods' termination
    messages (storage the operator cannot read, e.g. a PVC)."""


class CheckpointPolicyStatus(CamelModel):
    """Observed state, written by the operator."""

    model_config = ConfigDict(extra="allow")

    observed_generation: int | None = None
    """The spec generation last reconciled."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready / Reconciled conditions."""
    jobs: int = 0
    """Jobs referencing this policy."""
    checkpoints: int = 0
    """Checkpoints kept in storage."""
    valid_checkpoints: int = 0
    """Valid checkpoints kept in storage."""
    bytes_stored: int = 0
    """Bytes kept in storage."""
    deleted_by_retention: int = 0
    """Checkpoints deleted by retention so far."""
    last_valid: dict[str, JobCheckpointStatus] = Field(default_factory=dict)
    """Newest valid checkpoint per job (run id)."""
    last_verified_checkpoint: JobCheckpointStatus | None = None
    """The newest verified weights checkpoint of all the policy's runs."""


class ObjectMeta(BaseModel):
    """The bits of metadata the models care about (the rest passes through)."""

    model_config = ConfigDict(extra="allow")

    name: str | None = None
    namespace: str | None = None
    generation: int | None = None


class CheckpointPolicy(CamelModel):
    """A ``CheckpointPolicy`` object as stored in Kubernetes."""

    model_config = ConfigDict(extra="forbid")

    api_version: Literal["ckpt.dev/v1alpha1"] = "ckpt.dev/v1alpha1"
    kind: Literal["CheckpointPolicy"] = "CheckpointPolicy"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: CheckpointPolicySpec = Field(default_factory=CheckpointPolicySpec)
    status: CheckpointPolicyStatus | None = None
