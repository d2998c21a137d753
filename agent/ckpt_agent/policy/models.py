"""The ``CheckpointPolicy`` model: the single source of truth.

Everything that means something about a policy is defined here once:

* the CRD's OpenAPI schema (``crds/`` and the chart are generated from these
  classes by ``python -m ckpt_agent.policy.crdgen``; a test fails on drift);
* the agent's runtime configuration (:mod:`ckpt_agent.policy.agent_config`);
* the defaults every component falls back to.

The shared base (camelCase, CEL rules) is :mod:`ckpt_agent.policy.schema_base`; the
storage section is :mod:`ckpt_agent.policy.storage_models` (re-exported here), the
scheduler section :mod:`ckpt_agent.policy.scheduler_models`.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in
Python. Cross-field rules are written twice on purpose, in the same words: as a
pydantic validator (for the agent and the operator) and as a CEL rule
(``x-kubernetes-validations``) so that the API server itself rejects a bad
policy at ``kubectl apply`` time, naming the field.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt_agent.policy.replica_contract import DEFAULT_REPLICA_PORT, MAX_REPLICA_PEERS
from ckpt_agent.policy.scheduler_models import SchedulerSpec
from ckpt_agent.policy.schema_base import (
    CamelModel,
    Fraction,
    PositiveInt,
    cel,
)
from ckpt_agent.policy.storage_models import (
    StorageSpec,
)

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "KIND",
    "MEMORY_TIER_NEEDS_SIDECAR",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "AgentSpec",
    "CheckpointPolicy",
    "CheckpointPolicySpec",
    "CheckpointPolicyStatus",
    "CompressionSpec",
    "Condition",
    "FullTierSpec",
    "HeartbeatTierSpec",
    "JobCheckpointStatus",
    "MemoryTierSpec",
    "ObjectMeta",
    "PreemptionSpec",
    "PriorityBoostSpec",
    "PulseTierSpec",
    "RecoverySpec",
    "ReplicasSpec",
    "RetentionSpec",
    "Tier",
    "TiersSpec",
    "ValidationSpec",
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


# --------------------------------------------------------------------------- tiers


class HeartbeatTierSpec(CamelModel):
    """L0 heartbeat settings."""

    enabled: bool = True
    """Write heartbeats at all."""
    every_steps: PositiveInt = 1
    """Write a heartbeat every N steps."""
    flush_interval_seconds: Annotated[float, Field(gt=0.0, le=60.0)] = 0.25
    """At most one heartbeat write (one fsync) per this many seconds; the newest heartbeat
    is durable at most this long (plus one write) after its step."""


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


class MemoryTierSpec(CamelModel):
    """The memory tier (docs/replicas.md "The memory tier"): snapshots into the node's shared
    memory, and the peers' replicas, between the durable pulses; never written to storage.
    Its interval is Young/Daly's for the measured snapshot stall and the MTBF, no shorter than
    the stall budget allows, clamped to ``[minInterval, maxInterval]``; ``everySteps`` fixes
    it instead. A snapshot that finds no free shared-memory slot (its persister still records
    or pushes the previous one: the replica bandwidth) is taken at the next step."""

    enabled: bool = False
    """Take memory-tier snapshots (needs ``agent.sidecar: true``; a local run: ``CKPT_SHM_DIR``)."""
    every_steps: PositiveInt | None = None
    """A fixed interval in steps instead of the adaptive one."""
    base_interval: PositiveInt = 10
    """The interval before the snapshot stall and the step time are measured (and without
    ``scheduler.risk.enabled``)."""
    min_interval: PositiveInt = 1
    """Lower clamp of the adaptive interval, in steps."""
    max_interval: PositiveInt = 100
    """Upper clamp: a memory snapshot at least this often (when a slot is free)."""
    uncovered_share: Annotated[float, Field(ge=0.001, le=1.0)] = 1.0
    """The share of failures memory does not cover: a node lost with its replicas' peers, a
    restart in new pods (a job restarted by the operator; ``restartPolicy: Never``). The
    pulse is sized for the MTBF of those alone (``mtbf / uncoveredShare``), so below 1
    storage persists less often; 1 (the default) keeps the pulse as without the memory tier.
    ``ckpt simulate --trace llama3`` estimates it for a failure mix."""


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
                cel(
                    "self.memory.minInterval <= self.memory.maxInterval",
                    "memory.minInterval must be <= memory.maxInterval",
                    ".memory.minInterval",
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
    memory: MemoryTierSpec = Field(default_factory=MemoryTierSpec)
    """In-memory snapshots between the durable tiers (off by default)."""

    @model_validator(mode="after")
    def _check_intervals(self) -> TiersSpec:
        p = self.pulse
        if p.min_interval > p.max_interval:
            raise ValueError("tiers.pulse.minInterval must be <= pulse.maxInterval")
        if not p.min_interval <= p.base_interval <= p.max_interval:
            raise ValueError("tiers.pulse.baseInterval must lie within [minInterval, maxInterval]")
        m = self.memory
        if m.min_interval > m.max_interval:
            raise ValueError("tiers.memory.minInterval must be <= memory.maxInterval")
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
    mode: Literal["full", "stored"] = "full"
    """``full`` (default): re-read every blob and check it, decode it and compare the
    decoded bytes' hash with the writer's (an uncompressed blob, whose stored bytes are
    its raw bytes, is hashed once: BLAKE3 where recorded). ``stored``: re-read every blob
    and compare its size and hash (what storage returns is what the writer wrote), decode
    only the state tree: for zstd blobs 5x less CPU, but a blob that is well named and
    does not decode (a forged zstd bomb) is called valid and refused only by the restore
    (docs/security.md: what each mode proves; docs/performance.md: the measurement)."""


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


class ReplicasSpec(CamelModel):
    """Peer replicas of flash snapshots (docs/replicas.md): each node's sidecar pushes its
    snapshots to the sidecars of the next ``peers`` ranks, which keep them in memory."""

    enabled: bool = False
    """Replicate every flash snapshot to peer nodes (needs ``spec.agent.sidecar: true``)."""
    peers: Annotated[int, Field(ge=1, le=MAX_REPLICA_PEERS)] = 1
    """How many peers hold each rank's replica: the next ranks in a ring."""
    port: Annotated[int, Field(ge=1024, le=65535)] = DEFAULT_REPLICA_PORT
    """TCP port the sidecars serve replicas on (allow it between the job's pods only)."""


class AgentSpec(CamelModel):
    """How the agent is injected into pods."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!self.replicas.enabled || self.sidecar",
                    "replicas.enabled needs sidecar: true (the sidecar pushes the replicas)",
                    ".replicas.enabled",
                ),
                cel(
                    "!self.jitSave || self.sidecar",
                    "jitSave needs sidecar: true (the snapshot goes to shared memory)",
                    ".jitSave",
                ),
                cel(
                    "!self.replicas.enabled || (self.replicas.port != self.metricsPort"
                    " && self.replicas.port != self.metricsPort + 1"
                    " && self.replicas.port != self.metricsPort - 1)",
                    "replicas.port must differ from metricsPort and its two neighbours (the "
                    "sidecar's metrics port is metricsPort + 1, or - 1 at 65535)",
                    ".replicas.port",
                ),
            ]
        }
    )

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
    replicas: ReplicasSpec = Field(default_factory=ReplicasSpec)
    """Peer replicas of the sidecar's flash snapshots (off by default)."""
    jit_save: bool = False
    """Just-in-time saves (docs/replicas.md): every step's RNG and data position go to shared
    memory, and when a rank dies mid-step the surviving ranks save the last finished step
    before they exit, so that the restart loses at most that step (replicated state only,
    not FSDP; needs ``sidecar: true`` in a policy, ``CKPT_SHM_DIR`` in a local run)."""

    @model_validator(mode="after")
    def _check_replicas(self) -> AgentSpec:
        r = self.replicas
        if r.enabled and not self.sidecar:
            raise ValueError(
                "agent.replicas.enabled needs agent.sidecar: true (the sidecar pushes the replicas)"
            )
        if r.enabled and abs(r.port - self.metrics_port) <= 1:
            raise ValueError(
                "agent.replicas.port must differ from agent.metricsPort and its two neighbours "
                "(the sidecar's metrics port is metricsPort + 1, or - 1 at 65535)"
            )
        return self


# --------------------------------------------------------------------------- preemption


class PriorityBoostSpec(CamelModel):
    """Kueue's ``kueue.x-k8s.io/priority-boost`` on the job's Workload, kept in step with the
    job's at-risk work (the operator's ``--kueue``; Kueue's ``PriorityBoost`` feature gate).

    Effective priority = the Workload's priority + the boost, and Kueue preempts the lowest
    effective priority first: a job that just checkpointed (little to lose) becomes the
    preferred victim among its equals. Kueue also compares effective priorities to decide
    *whether* a workload may preempt another, so keep ``maxBoost`` below the gap between
    two adjacent priority classes of the queue (the default 100 is far below the usual
    1000s apart): then the boost only reorders victims of one class and never shields a
    job from a preemptor of a higher class (docs/kueue.md)."""

    enabled: bool = False
    """Set the boost on the Workloads of this policy's jobs admitted through Kueue."""
    max_boost: Annotated[int, Field(ge=1, le=1_000_000)] = 100
    """The largest boost written (points of priority); keep it below the gap between two
    adjacent priority classes."""
    seconds_per_point: Annotated[float, Field(gt=0.0, le=86_400.0)] = 30.0
    """One point of boost per this many seconds of at-risk work (time since the newest
    valid checkpoint, plus the expected save time): 100 points at 30 s = 50 minutes."""
    min_update_seconds: Annotated[float, Field(ge=1.0, le=86_400.0)] = 30.0
    """At least this long between two boost writes to one Workload (removing the boost
    when the job ends or is evicted is not delayed)."""


class PreemptionSpec(CamelModel):
    """Preemption by a queueing system (Kueue): the boost that picks the cheapest victim,
    the save before an eviction ends the pods."""

    priority_boost: PriorityBoostSpec = Field(default_factory=PriorityBoostSpec)
    """Kueue priority boost from the at-risk work."""
    save_on_eviction: bool = True
    """Ask every pod of the job for an emergency checkpoint as soon as its Workload shows
    an eviction (preemption, quota change, ``waitForPodsReady`` timeout), before SIGTERM,
    and raise the pods' ``terminationGracePeriodSeconds`` to cover the expected save."""
    max_grace_seconds: Annotated[int, Field(ge=0, le=86_400)] = 300
    """The most the webhook raises a pod's ``terminationGracePeriodSeconds`` to (a larger
    value the pod already has is kept; 0: never raised)."""


# --------------------------------------------------------------------------- spec / status


MEMORY_TIER_NEEDS_SIDECAR: Final = (
    "tiers.memory.enabled needs agent.sidecar: true (the snapshots go to shared memory)"
)


class CheckpointPolicySpec(CamelModel):
    """Desired checkpointing behaviour for the jobs that reference this policy."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.tiers) || !has(self.tiers.memory)"
                    " || !has(self.tiers.memory.enabled) || !self.tiers.memory.enabled"
                    " || (has(self.agent) && has(self.agent.sidecar) && self.agent.sidecar)",
                    MEMORY_TIER_NEEDS_SIDECAR,
                    ".tiers.memory.enabled",
                ),
            ]
        }
    )

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
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    """Preemption by Kueue: priority boost, save on eviction (docs/kueue.md)."""

    @model_validator(mode="after")
    def _check_jit(self) -> CheckpointPolicySpec:
        # here, not in AgentSpec: a local run's config (CKPT_SHM_DIR, no sidecar) may use it
        if self.agent.jit_save and not self.agent.sidecar:
            raise ValueError(
                "agent.jitSave needs agent.sidecar: true (the snapshot goes to shared memory)"
            )
        if self.tiers.memory.enabled and not self.agent.sidecar:
            raise ValueError(MEMORY_TIER_NEEDS_SIDECAR)
        return self


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
