"""How the sidecar runs: :class:`SidecarOptions` (the ``ckpt sidecar`` flags) and its config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ckpt_agent.flash.replica.replicator import ReplicaOptions
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.policy.storage_models import file_url

__all__ = [
    "DEFAULT_COMMIT_TIMEOUT_S",
    "DEFAULT_GRACE_S",
    "ENV_GRACE",
    "SidecarOptions",
    "grace_from_env",
    "load_config",
]

#: Seconds the coordinator waits for the other ranks' parts before giving up on a checkpoint.
DEFAULT_COMMIT_TIMEOUT_S = 300.0
#: SIGTERM drain deadline (seconds) when neither ``--grace-s`` nor ``CKPT_GRACE_S`` is set.
DEFAULT_GRACE_S = 25.0
ENV_GRACE = "CKPT_GRACE_S"


@dataclass
class SidecarOptions:
    """How the sidecar runs (command-line flags)."""

    poll_s: float = 0.02
    grace_s: float = DEFAULT_GRACE_S
    probe_every_s: float = 10.0
    commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S
    exit_with_trainer: bool = False
    """Local mode: exit once every trainer seen is dead and nothing is left to persist."""
    wait_for_trainer_s: float = 120.0
    """Local mode: give up when no trainer appeared within this time."""
    metrics_port: int | None = None
    """None: the config's port; 0: no HTTP server."""
    ranks: tuple[int, ...] | None = None
    """Serve only these ranks (default: every area that appears)."""
    replicas: ReplicaOptions | None = None
    """Push every handled snapshot to peer nodes and serve theirs (docs/replicas.md);
    None (the default): no replication."""


def grace_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``CKPT_GRACE_S`` (the pod's termination grace the operator injects), else the default."""
    raw = (os.environ if environ is None else environ).get(ENV_GRACE, "").strip()
    return float(raw) if raw else DEFAULT_GRACE_S


def load_config(
    config: str | Path | None = None,
    *,
    shm_dir: str | None = None,
    run_id: str | None = None,
    storage: str | None = None,
) -> AgentConfig:
    """The full agent config, like the trainer's: ``config`` (JSON file), else ``$CKPT_CONFIG``
    + ``CKPT_*`` variables; then the command-line overrides."""
    cfg = AgentConfig.from_json(Path(config).read_text()) if config else AgentConfig.from_env()
    updates: dict[str, str] = {}
    if shm_dir:
        updates["shm_dir"] = shm_dir
    if run_id:
        updates["run_id"] = run_id
    if storage:
        updates["storage_url"] = file_url(storage) if storage.startswith("/") else storage
    return cfg.model_copy(update=updates) if updates else cfg
