"""Names shared by the webhook, the watchers and the agent (the contract in one place).

Everything the operator writes on Kubernetes objects or into pods is named
here, so the injection, the restart planner, the disruption watcher, the chart
and ``docs/operator.md`` cannot drift apart. The environment variable names
themselves come from :mod:`ckpt_agent.policy.agent_config` (the agent reads
what the webhook injects).
"""

from __future__ import annotations

from typing import Final

#: Annotation/label prefix of everything the project owns.
PREFIX: Final = "ckpt.dev"

# --------------------------------------------------------------------------- PyTorchJob (user)
#: Name of the CheckpointPolicy (same namespace) the job uses. Opts the job's pods in to injection.
ANN_POLICY: Final = f"{PREFIX}/policy"
#: ``"true"``: restart the job from its last valid checkpoint when it fails.
ANN_AUTO_RESUME: Final = f"{PREFIX}/auto-resume"

# --------------------------------------------------------------------------- PyTorchJob (operator)
#: Stable identity of the training run across restarts (its storage folder).
ANN_RUN_ID: Final = f"{PREFIX}/run-id"
#: Restarts so far in this run's chain (0 on the user's job).
ANN_RESTART_COUNT: Final = f"{PREFIX}/restart-count"
#: Checkpoint id the job resumes from (set on restarts).
ANN_RESUME_FROM: Final = f"{PREFIX}/resume-from"
#: When ``resume-from`` is a heartbeat: the checkpoint supplying the weights (a rebuild).
ANN_RESUME_WEIGHTS: Final = f"{PREFIX}/resume-weights"
#: A manual restart's own pin identity (the agent's ``CKPT_RESUME_PIN``): a new pin, a new
#: lineage epoch, even when the checkpoint was pinned before.
ANN_RESUME_PIN: Final = f"{PREFIX}/resume-pin"
#: Unix time (seconds) the run's first job was created; carried along the restart chain.
ANN_RUN_STARTED_AT: Final = f"{PREFIX}/run-started-at"
#: The operator's MTBF estimate (seconds) for the run: its failures blended with the policy's.
ANN_MTBF_SECONDS: Final = f"{PREFIX}/mtbf-seconds"
#: Step of ``resume-from`` (for crash-loop detection and humans).
ANN_RESUME_STEP: Final = f"{PREFIX}/resume-step"
#: Comma-separated checkpoint ids that made a resumed run fail before it advanced.
ANN_POISONED: Final = f"{PREFIX}/poisoned"
#: On a failed job: the name of the job it was restarted as (written before the create).
ANN_RESTARTED_AS: Final = f"{PREFIX}/restarted-as"
#: On a failed job: the restart decision (JSON), so a crash between the decision and the
#: create replays exactly the same restart.
ANN_RESTART_DECISION: Final = f"{PREFIX}/restart-decision"
#: On a restarted job: the name of the job it replaces.
ANN_RESTART_OF: Final = f"{PREFIX}/restart-of"
#: The operator's view of the job, as JSON ``{"state", "reason", "message", "time"}``.
ANN_STATUS: Final = f"{PREFIX}/status"
#: On a TrainJob (operator): the JobSet restart attempt the operator planned last; pods of a
#: newer attempt are refused until it has planned theirs (their resume point).
ANN_RESTART_ATTEMPT: Final = f"{PREFIX}/restart-attempt"
#: On a TrainJob (operator): when that attempt was planned (its crash-loop reference time).
ANN_ATTEMPT_STARTED_AT: Final = f"{PREFIX}/attempt-started-at"

# --------------------------------------------------------------------------- manual recovery
#: On a failed job (set by a person, ``ckpt recover --job``): restart from this step, even
#: after ``GaveUp``.
ANN_RECOVER_STEP: Final = f"{PREFIX}/recover-step"
#: ``"true"``: the step's checkpoint may be used although corrupted/poisoned/pending.
ANN_RECOVER_FORCE: Final = f"{PREFIX}/recover-force"
#: ``"true"``: only report the plan (an Event and ``recover-plan``), change nothing.
ANN_RECOVER_DRY_RUN: Final = f"{PREFIX}/recover-dry-run"
#: Who asked and why (required with ``recover-step``); copied onto the new job as the audit.
ANN_RECOVER_BY: Final = f"{PREFIX}/recover-by"
ANN_RECOVER_REASON: Final = f"{PREFIX}/recover-reason"
#: On the failed job: the last manual request handled (its JSON), so it is applied once.
ANN_RECOVER_HANDLED: Final = f"{PREFIX}/recover-handled"
#: On the failed job: the plan a dry run found (JSON).
ANN_RECOVER_PLAN: Final = f"{PREFIX}/recover-plan"
#: The request annotations (a person's): never copied onto a restart.
RECOVER_REQUEST_ANNOTATIONS: Final = frozenset(
    {ANN_RECOVER_STEP, ANN_RECOVER_FORCE, ANN_RECOVER_DRY_RUN, ANN_RECOVER_BY, ANN_RECOVER_REASON}
)

# --------------------------------------------------------------------------- pods
#: Pod annotation: a request id; a change means "take an emergency checkpoint now".
#: Exposed to the agent as the file ``$CKPT_SIGNAL_FILE`` through a downward-API volume.
ANN_SAVE_NOW: Final = f"{PREFIX}/save-now"
#: Pod annotation: why ``save-now`` was requested (humans only; not in the volume).
ANN_SAVE_NOW_REASON: Final = f"{PREFIX}/save-now-reason"
#: Pod label and annotation set by the webhook; the label selects the pods the
#: disruption watcher follows, the annotation (injection format version) makes
#: re-admission a no-op.
LABEL_INJECTED: Final = f"{PREFIX}/injected"
ANN_INJECTED: Final = f"{PREFIX}/injected"
INJECTION_VERSION: Final = "v1"
#: Label on the pod templates of opted-in PyTorchJobs (set by the ``label-job`` webhook,
#: by the job watcher and on every restart), so every pod the training-operator creates
#: for them carries it: the pod webhook selects exactly these pods (``objectSelector``)
#: and fails closed for them; other pods never call it.
LABEL_INJECT: Final = f"{PREFIX}/inject"

#: The run's verified checkpoints as the pods reported them in their termination
#: messages (:mod:`ckpt_agent.format.termination`), merged by the operator; copied onto a
#: restart, so the chain keeps what earlier jobs reported.
ANN_CHECKPOINTS: Final = f"{PREFIX}/checkpoints"
#: JSON ``{checkpointId, step, tier, time, source}``: the newest verified weights checkpoint.
ANN_LAST_VERIFIED: Final = f"{PREFIX}/last-verified-checkpoint"

#: On a job: the pod found running without the agent reporting in (Event posted once).
ANN_AGENT_MISSING: Final = f"{PREFIX}/agent-missing"

#: Annotations on user objects that the operator owns (never copied onto a restart).
OPERATOR_JOB_ANNOTATIONS: Final = frozenset(
    {
        ANN_LAST_VERIFIED,
        ANN_RESTARTED_AS,
        ANN_RESTART_DECISION,
        ANN_STATUS,
        ANN_RESTART_COUNT,
        ANN_RESUME_FROM,
        ANN_RESUME_STEP,
        ANN_RESUME_WEIGHTS,
        ANN_RESUME_PIN,
        ANN_RUN_STARTED_AT,
        ANN_MTBF_SECONDS,
        ANN_POISONED,
        ANN_RESTART_OF,
        ANN_RECOVER_HANDLED,
        ANN_RECOVER_PLAN,
        ANN_AGENT_MISSING,
        ANN_RESTART_ATTEMPT,
        ANN_ATTEMPT_STARTED_AT,
    }
)
#: kopf's peering object (``ClusterKopfPeering``/``KopfPeering``) replicas elect a leader in.
PEERING_NAME: Final = "ckpt-operator"
#: kopf's own bookkeeping annotations use this prefix (configured in main.py).
KOPF_PREFIX: Final = f"operator.{PREFIX}"

# --------------------------------------------------------------------------- Kubeflow
PYTORCHJOB_GROUP: Final = "kubeflow.org"
PYTORCHJOB_VERSION: Final = "v1"
PYTORCHJOB_PLURAL: Final = "pytorchjobs"
PYTORCHJOB_KIND: Final = "PyTorchJob"
#: Label the training-operator puts on every pod of a job (value: the job name).
LABEL_TO_JOB_NAME: Final = "training.kubeflow.org/job-name"
LABEL_TO_REPLICA_TYPE: Final = "training.kubeflow.org/replica-type"
LABEL_TO_REPLICA_INDEX: Final = "training.kubeflow.org/replica-index"

# --------------------------------------------------------------------------- Kubeflow Trainer v2
#: ``TrainJob`` (Trainer v2, built on JobSet): the JobSet it creates has the TrainJob's name
#: and a controller owner reference to it; JobSet labels every Job and pod.
TRAINJOB_GROUP: Final = "trainer.kubeflow.org"
TRAINJOB_VERSION: Final = "v1alpha1"
TRAINJOB_PLURAL: Final = "trainjobs"
TRAINJOB_KIND: Final = "TrainJob"
#: The runtimes a TrainJob's ``spec.runtimeRef`` names (``kind``; default the cluster one).
CLUSTER_TRAINING_RUNTIME_KIND: Final = "ClusterTrainingRuntime"
TRAINING_RUNTIME_KIND: Final = "TrainingRuntime"
CLUSTER_TRAINING_RUNTIME_PLURAL: Final = "clustertrainingruntimes"
TRAINING_RUNTIME_PLURAL: Final = "trainingruntimes"
#: Label on a runtime's replicated Job template naming the TrainJob step it runs
#: (``trainer``, ``dataset-initializer``, ``model-initializer``).
LABEL_TRAINER_ANCESTOR: Final = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_ANCESTOR_TRAINER: Final = "trainer"
#: Trainer v2's training container (``node``) in its torch runtimes.
TRAINJOB_CONTAINER: Final = "node"
#: ``spec.runtimePatches[].manager`` of the patch that labels an opted-in TrainJob's pods.
RUNTIME_PATCH_MANAGER: Final = f"{PREFIX}/operator"
JOBSET_GROUP: Final = "jobset.x-k8s.io"
JOBSET_VERSION: Final = "v1alpha2"
JOBSET_PLURAL: Final = "jobsets"
#: Label (and annotation) JobSet puts on every Job and pod: the JobSet's (= TrainJob's) name.
LABEL_JOBSET_NAME: Final = "jobset.sigs.k8s.io/jobset-name"
#: Label (and annotation) JobSet puts on every Job and pod: the JobSet's ``status.restarts``
#: when they were created (each JobSet restart recreates every pod with the next number).
LABEL_JOBSET_RESTART_ATTEMPT: Final = "jobset.sigs.k8s.io/restart-attempt"

# --------------------------------------------------------------------------- injected pod layout
VOL_CONFIG: Final = "ckpt-config"
VOL_SHM: Final = "ckpt-shm"
VOL_SIGNAL: Final = "ckpt-signal"
VOL_WORK: Final = "ckpt-work"
VOL_STORAGE: Final = "ckpt-storage"
INJECTED_VOLUMES: Final = (VOL_CONFIG, VOL_SHM, VOL_SIGNAL, VOL_WORK, VOL_STORAGE)

CONFIG_DIR: Final = "/etc/ckpt"
CONFIG_KEY: Final = "config.json"
CONFIG_PATH: Final = f"{CONFIG_DIR}/{CONFIG_KEY}"
SHM_DIR: Final = "/var/run/ckpt/shm"
SIGNAL_DIR: Final = "/var/run/ckpt/signal"
SIGNAL_KEY: Final = "save-now"
SIGNAL_FILE: Final = f"{SIGNAL_DIR}/{SIGNAL_KEY}"
WORK_DIR: Final = "/var/run/ckpt/work"

SIDECAR_NAME: Final = "ckpt-agent"
METRICS_PORT_NAME: Final = "ckpt-metrics"
SIDECAR_METRICS_PORT_NAME: Final = "ckpt-sc-metrics"

#: S3 credentials env names the agent's StorageOptions read (never the job's own AWS_*).
ENV_S3_ACCESS_KEY_ID: Final = "CKPT_S3_ACCESS_KEY_ID"
ENV_S3_SECRET_ACCESS_KEY: Final = "CKPT_S3_SECRET_ACCESS_KEY"
ENV_S3_ENDPOINT_URL: Final = "CKPT_S3_ENDPOINT_URL"
ENV_S3_REGION: Final = "CKPT_S3_REGION"
ENV_S3_PATH_STYLE: Final = "CKPT_S3_PATH_STYLE"
ENV_S3_SSE: Final = "CKPT_S3_SSE"
ENV_S3_KMS_KEY_ID: Final = "CKPT_S3_KMS_KEY_ID"

# --------------------------------------------------------------------------- webhooks
#: kopf serves each admission handler at ``/<handler id>``; the chart points there.
WEBHOOK_INJECT_ID: Final = "inject-pods"
WEBHOOK_VALIDATE_ID: Final = "validate-policy"
#: Validates the ``ckpt.dev`` annotations of PyTorchJobs (run id, resume point).
WEBHOOK_VALIDATE_JOB_ID: Final = "validate-job"
#: Adds :data:`LABEL_INJECT` to the pod templates of opted-in PyTorchJobs at creation.
WEBHOOK_LABEL_JOB_ID: Final = "label-job"
#: The TrainJob counterparts: the runtime patch that labels its trainer pods, and the
#: ``ckpt.dev`` annotation checks.
WEBHOOK_LABEL_TRAINJOB_ID: Final = "label-trainjob"
WEBHOOK_VALIDATE_TRAINJOB_ID: Final = "validate-trainjob"
