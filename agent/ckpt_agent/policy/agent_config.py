"""The agent's runtime configuration: a policy spec plus the pod's context.

The operator's webhook turns a :class:`CheckpointPolicySpec` into an
:class:`AgentConfig` (:func:`AgentConfig.from_policy`), writes it as JSON into
a ConfigMap mounted into the pod, and points ``CKPT_CONFIG`` at it. The agent
reads it back with :func:`AgentConfig.from_env`, which also honours the
individual ``CKPT_*`` variables below (they win over the file, so a local run
needs no file at all). :meth:`AgentConfig.to_policy_spec` goes back; the
round trip is lossless (tested).

Environment contract (all optional):

==================== ===========================================================
``CKPT_CONFIG``      path of the JSON config file (the mounted ConfigMap)
``CKPT_RUN_ID``      stable id of the training run across restarts
``CKPT_STORAGE_URL`` ``/path``, ``file:///path`` or ``s3://bucket/prefix``
``CKPT_RESUME_FROM`` checkpoint id to resume from (set by the operator on restart)
``CKPT_RESUME_WEIGHTS`` the weights source when ``CKPT_RESUME_FROM`` is a heartbeat
``CKPT_RESUME_PIN``  a manual restart's pin identity (a new pin even for a pinned id)
``CKPT_RUN_STARTED_AT`` Unix time the run's first job was created (the long-run rule)
``CKPT_MTBF_SECONDS`` the operator's MTBF estimate for this run (seconds)
``CKPT_SHM_DIR``     memory-backed directory for snapshots (flash checkpoints)
``CKPT_SIGNAL_FILE`` downward-API file; a change of its content means "save now"
``CKPT_METRICS_PORT`` Prometheus port (0 disables the server)
``CKPT_METRICS_ADDR`` the address it binds (default ``0.0.0.0``; ``::`` for IPv6 pods)
``CKPT_WORK_DIR``    local directory for the catalog and the decision log
``CKPT_NAMESPACE``   the pod's namespace (downward API): the owner the run is claimed for
``CKPT_JOB_NAME``    the PyTorchJob's name, ``CKPT_JOB_UID`` its uid (owner record, humans)
``CKPT_POD_NAME``    the pod's name, ``CKPT_NODE_NAME`` its node (downward API): the
                     writer record of a fenced run names them
``CKPT_POD_UID``     the pod's uid (downward API): a pod that lost the run to a newer
                     writer never claims it back (a container restarted in place)
==================== ===========================================================
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from pydantic import Field

from ckpt_agent.policy.models import (
    AgentSpec,
    CheckpointPolicySpec,
    CompressionSpec,
    PreemptionSpec,
    RecoverySpec,
    RetentionSpec,
    TiersSpec,
    ValidationSpec,
)
from ckpt_agent.policy.scheduler_models import SchedulerSpec
from ckpt_agent.policy.schema_base import CamelModel
from ckpt_agent.policy.storage_models import (
    LocalStorageSpec,
    S3StorageSpec,
    SecretKeyRef,
    ServerSideEncryptionSpec,
    StorageSpec,
    StorageType,
    file_url,
    file_url_path,
)

ENV_CONFIG = "CKPT_CONFIG"
ENV_RUN_ID = "CKPT_RUN_ID"
ENV_STORAGE_URL = "CKPT_STORAGE_URL"
ENV_RESUME_FROM = "CKPT_RESUME_FROM"
ENV_RESUME_WEIGHTS = "CKPT_RESUME_WEIGHTS"
ENV_RESUME_PIN = "CKPT_RESUME_PIN"
ENV_RUN_STARTED_AT = "CKPT_RUN_STARTED_AT"
ENV_MTBF_SECONDS = "CKPT_MTBF_SECONDS"
ENV_SHM_DIR = "CKPT_SHM_DIR"
ENV_SIGNAL_FILE = "CKPT_SIGNAL_FILE"
ENV_METRICS_PORT = "CKPT_METRICS_PORT"
ENV_METRICS_ADDR = "CKPT_METRICS_ADDR"
ENV_WORK_DIR = "CKPT_WORK_DIR"
ENV_NAMESPACE = "CKPT_NAMESPACE"
ENV_JOB_NAME = "CKPT_JOB_NAME"
ENV_JOB_UID = "CKPT_JOB_UID"
ENV_POD_NAME = "CKPT_POD_NAME"
ENV_NODE_NAME = "CKPT_NODE_NAME"
ENV_POD_UID = "CKPT_POD_UID"


DEFAULT_RUN_ID = "local"
"""The run id when nothing sets one (a local run without ``CKPT_RUN_ID``)."""


def default_storage_url() -> str:
    """Where checkpoints go when nothing says (a local run without ``CKPT_STORAGE_URL``):
    ``$XDG_DATA_HOME/ckpt-operator/checkpoints``, by default
    ``~/.local/share/ckpt-operator/checkpoints`` — a folder the user can write to (the
    former default, ``/var/lib/ckpt``, is root's)."""
    base = os.environ.get("XDG_DATA_HOME")
    if not base:
        try:
            base = str(Path.home() / ".local" / "share")
        except RuntimeError:  # no home directory (a bare container user)
            base = str(Path(tempfile.gettempdir()))
    return Path(base, "ckpt-operator", "checkpoints").absolute().as_uri()


class S3Options(CamelModel):
    """S3 connection settings the agent needs (bucket and prefix live in the URL)."""

    endpoint: str | None = None
    region: str = "us-east-1"
    path_style: bool = False
    server_side_encryption: ServerSideEncryptionSpec = Field(
        default_factory=ServerSideEncryptionSpec
    )
    part_size_mb: Annotated[int, Field(ge=5, le=5120)] = 16
    max_concurrency: Annotated[int, Field(ge=1, le=64)] = 4
    max_attempts: Annotated[int, Field(ge=1, le=20)] = 3
    credentials_secret: SecretKeyRef | None = None
    """Kept so the config maps back to the policy; the agent reads the keys from env."""


class AgentConfig(CamelModel):
    """Everything the in-pod agent needs to run."""

    run_id: str = DEFAULT_RUN_ID
    """Stable identity of the training run across restarts (storage folder name)."""
    storage_url: str = Field(default_factory=default_storage_url)
    """Storage root (default: :func:`default_storage_url`, a folder the user can write to;
    the operator always sets it from the policy)."""
    s3: S3Options | None = None
    """S3 settings when ``storage_url`` is ``s3://``."""
    pvc_name: str | None = None
    """PVC backing a local storage path (informational for the agent)."""
    resume_from: str | None = None
    """Checkpoint id chosen by the operator; None: the agent walks the ladder itself."""
    resume_weights: str | None = None
    """When ``resume_from`` is a heartbeat: the checkpoint supplying the weights."""
    resume_pin: str | None = None
    """A manual restart's pin identity: the pin is new even when the id was pinned before."""
    run_started_at: Annotated[float, Field(ge=0)] | None = None
    """Unix time the run's first job was created (None: this process's first step)."""
    mtbf_seconds: Annotated[float, Field(gt=0)] | None = None
    """The operator's MTBF estimate for this run (None: the policy's ``mtbfSeconds``)."""
    shm_dir: str | None = None
    """Memory-backed snapshot directory; None: snapshots stay in process memory."""
    signal_file: str | None = None
    """Downward-API file carrying the operator's save-now request id."""
    work_dir: str | None = None
    """Local folder for the catalog and decision log (default: a temp dir per run)."""
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Prometheus port; 0 disables the HTTP server. The operator probes it too: a pod past
    ``spec.agent.reportDeadlineSeconds`` whose port refuses connections has no agent."""
    metrics_addr: str = "0.0.0.0"
    """The address the metrics server binds (``::`` serves IPv6 and IPv4)."""

    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    tiers: TiersSpec = Field(default_factory=TiersSpec)
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    retention: RetentionSpec = Field(default_factory=RetentionSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    agent: AgentSpec = Field(default_factory=AgentSpec)
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    """The operator's (Kueue preemption); carried so the file describes the whole policy."""

    # ------------------------------------------------------------------ policy <-> config

    @classmethod
    def from_policy(
        cls,
        spec: CheckpointPolicySpec,
        *,
        run_id: str,
        resume_from: str | None = None,
        shm_dir: str | None = None,
        signal_file: str | None = None,
        work_dir: str | None = None,
    ) -> AgentConfig:
        """The runtime config the webhook injects for a job using ``spec``."""
        s3: S3Options | None = None
        if spec.storage.type == StorageType.S3:
            assert spec.storage.s3 is not None
            b = spec.storage.s3
            s3 = S3Options(
                endpoint=b.endpoint,
                region=b.region,
                path_style=b.path_style,
                server_side_encryption=b.server_side_encryption.model_copy(deep=True),
                part_size_mb=b.part_size_mb,
                max_concurrency=b.max_concurrency,
                max_attempts=b.max_attempts,
                credentials_secret=(
                    b.credentials_secret.model_copy() if b.credentials_secret else None
                ),
            )
        return cls(
            run_id=run_id,
            storage_url=spec.storage.url(),
            s3=s3,
            pvc_name=(
                spec.storage.local.pvc_name if spec.storage.type == StorageType.LOCAL else None
            ),
            resume_from=resume_from,
            shm_dir=shm_dir,
            signal_file=signal_file,
            work_dir=work_dir,
            metrics_port=spec.agent.metrics_port,
            scheduler=spec.scheduler.model_copy(deep=True),
            tiers=spec.tiers.model_copy(deep=True),
            compression=spec.compression.model_copy(deep=True),
            validation=spec.validation.model_copy(deep=True),
            retention=spec.retention.model_copy(deep=True),
            recovery=spec.recovery.model_copy(deep=True),
            agent=spec.agent.model_copy(deep=True),
            preemption=spec.preemption.model_copy(deep=True),
        )

    def to_policy_spec(self) -> CheckpointPolicySpec:
        """The policy spec this config was derived from (lossless inverse of from_policy)."""
        if self.storage_url.startswith("s3://"):
            bucket, _, prefix = self.storage_url[len("s3://") :].partition("/")
            o = self.s3 or S3Options()
            storage = StorageSpec(
                type=StorageType.S3,
                s3=S3StorageSpec(
                    bucket=bucket,
                    prefix=prefix,
                    endpoint=o.endpoint,
                    region=o.region,
                    path_style=o.path_style,
                    credentials_secret=o.credentials_secret,
                    server_side_encryption=o.server_side_encryption,
                    part_size_mb=o.part_size_mb,
                    max_concurrency=o.max_concurrency,
                    max_attempts=o.max_attempts,
                ),
            )
        else:
            path = file_url_path(self.storage_url)
            storage = StorageSpec(
                type=StorageType.LOCAL, local=LocalStorageSpec(path=path, pvc_name=self.pvc_name)
            )
        return CheckpointPolicySpec(
            scheduler=self.scheduler,
            tiers=self.tiers,
            storage=storage,
            compression=self.compression,
            validation=self.validation,
            retention=self.retention,
            recovery=self.recovery,
            agent=self.agent,
            preemption=self.preemption,
        )

    # ------------------------------------------------------------------ files and env

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AgentConfig:
        return cls.model_validate_json(text)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AgentConfig:
        """Load ``$CKPT_CONFIG`` (if set) and overlay the individual ``CKPT_*`` variables."""
        env = os.environ if environ is None else environ
        data: dict[str, object] = {}
        path = env.get(ENV_CONFIG)
        if path:
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(
                    f"{ENV_CONFIG}={path} does not exist: mount the policy ConfigMap there "
                    f"or unset {ENV_CONFIG} to use defaults and CKPT_* variables"
                )
            data = json.loads(p.read_text())
        overlay = {
            ENV_RUN_ID: "runId",
            ENV_STORAGE_URL: "storageUrl",
            ENV_RESUME_FROM: "resumeFrom",
            ENV_RESUME_WEIGHTS: "resumeWeights",
            ENV_RESUME_PIN: "resumePin",
            ENV_RUN_STARTED_AT: "runStartedAt",
            ENV_MTBF_SECONDS: "mtbfSeconds",
            ENV_SHM_DIR: "shmDir",
            ENV_SIGNAL_FILE: "signalFile",
            ENV_WORK_DIR: "workDir",
            ENV_METRICS_PORT: "metricsPort",
            ENV_METRICS_ADDR: "metricsAddr",
        }
        for var, key in overlay.items():
            value = env.get(var)
            if value:
                data[key] = value
        url = data.get("storageUrl")
        if isinstance(url, str) and url.startswith("/"):
            data["storageUrl"] = file_url(url)
        return cls.model_validate(data)
