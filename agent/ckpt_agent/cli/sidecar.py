"""``ckpt sidecar``: persist a run's shared-memory snapshots (the pod's persisting sidecar).

The operator injects it as a native sidecar container with the trainer's
``CKPT_*`` environment; the trainer starts it as a local persister
(``python -m ckpt_agent.cli sidecar --exit-with-trainer``). What it does:
:mod:`ckpt_agent.flash.sidecar`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer

from ckpt_agent.cli.common import fail, guarded, is_seconds, non_negative, plain
from ckpt_agent.errors import ServeError
from ckpt_agent.flash.sidecar import SidecarOptions, load_config, run_sidecar
from ckpt_agent.flash.sidecar.options import DEFAULT_COMMIT_TIMEOUT_S, ENV_GRACE, grace_from_env
from ckpt_agent.flash.sidecar.replica_env import replicas_or_off
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.text import CleanFormatter

__all__ = ["sidecar"]


def _config(
    config: str | None, shm_dir: str | None, run_id: str | None, storage: str | None
) -> AgentConfig:
    try:
        return load_config(config, shm_dir=shm_dir, run_id=run_id, storage=storage)
    except (ValueError, OSError) as e:
        where = f"--config {config}" if config else "CKPT_CONFIG and the CKPT_* variables"
        raise fail(f"cannot load the agent config from {where}: {plain(e)}") from None


def _grace(grace_s: float | None) -> float:
    if grace_s is not None:
        return grace_s
    try:
        grace = grace_from_env()
    except ValueError:
        grace = float("nan")
    if not is_seconds(grace):
        raise fail(
            f"{ENV_GRACE}={plain(os.environ.get(ENV_GRACE, ''), 40)!r} is not a finite number of "
            "seconds >= 0 (or pass --grace-s)"
        )
    return grace


@guarded
def sidecar(
    config: Annotated[
        str | None,
        typer.Option("--config", help="Agent config JSON (default: $CKPT_CONFIG + CKPT_* env)."),
    ] = None,
    shm_dir: Annotated[
        str | None,
        typer.Option("--shm-dir", help="Shared-memory directory (default: $CKPT_SHM_DIR)."),
    ] = None,
    run_id: Annotated[
        str | None, typer.Option("--run-id", help="Run id (default: $CKPT_RUN_ID).")
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option("--storage", help="Storage URL or path (default: $CKPT_STORAGE_URL)."),
    ] = None,
    poll_s: Annotated[
        float,
        typer.Option("--poll-s", callback=non_negative, help="Seconds between passes."),
    ] = 0.02,
    grace_s: Annotated[
        float | None,
        typer.Option(
            "--grace-s",
            callback=non_negative,
            help="SIGTERM drain deadline in seconds (default: $CKPT_GRACE_S or 25).",
        ),
    ] = None,
    probe_every_s: Annotated[
        float,
        typer.Option(
            "--probe-every-s", callback=non_negative, help="Seconds between storage/GPU probes."
        ),
    ] = 10.0,
    commit_timeout_s: Annotated[
        float,
        typer.Option(
            "--commit-timeout-s",
            callback=non_negative,
            help="Seconds to wait for the other ranks' parts.",
        ),
    ] = DEFAULT_COMMIT_TIMEOUT_S,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=0,
            max=65535,
            help="HTTP port for /metrics and probes (default: the config's; 0: none).",
        ),
    ] = None,
    rank: Annotated[
        list[int] | None,
        typer.Option("--rank", min=0, help="Serve only this rank (repeatable)."),
    ] = None,
    exit_with_trainer: Annotated[
        bool,
        typer.Option(
            "--exit-with-trainer",
            help="Local mode: exit once the trainer is gone and everything is persisted.",
        ),
    ] = False,
    wait_for_trainer_s: Annotated[
        float,
        typer.Option(
            "--wait-for-trainer-s",
            callback=non_negative,
            help="Local mode: seconds to wait for a trainer before giving up.",
        ),
    ] = 120.0,
) -> None:
    """Persist a run's shared-memory snapshots (the pod's sidecar; flash checkpoints).

    Reads the same environment as the trainer (CKPT_CONFIG, CKPT_SHM_DIR,
    CKPT_STORAGE_URL, CKPT_RUN_ID, CKPT_METRICS_PORT …), the policy's S3
    settings included. Serves /metrics, /healthz and /readyz; SIGTERM
    persists what is pending and exits within the grace period (CKPT_GRACE_S).

    Peer replicas (docs/replicas.md): with CKPT_REPLICA_PORT,
    CKPT_REPLICA_PEERS, CKPT_REPLICA_SECRET_FILE, CKPT_REPLICA_JOB and
    CKPT_NODE_NAME (set by the operator's webhook for spec.agent.replicas) it
    also pushes each snapshot to its peers and keeps theirs; a bad value is
    logged and replication stays off, persisting goes on. With CKPT_REPLICA_RANK
    and CKPT_REPLICA_PEERS_DIR it pushes to the peers the operator chose from the
    nodes' zones and racks (its file of the mounted ConfigMap, re-read every 10 s),
    to CKPT_REPLICA_PEERS until that file is there. A trainer recreated on
    this node (its old node lost) gets its rank's snapshot back from them before
    it resumes, with its step heartbeat (spec.agent.jitSave: the sidecar pushes
    each rank's to the peers too). A memory-only snapshot (spec.tiers.memory's, or a
    just-in-time save) is hashed for the in-place restart and replicated, never
    written to storage; a pulse or full taken before it is persisted first.

    Exit code 2 for a missing or invalid config.
    """
    # Every record through text.CleanFormatter: log lines quote stored names and reasons.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(CleanFormatter("%(asctime)s ckpt-sidecar %(levelname)s %(message)s"))
    try:
        logging.basicConfig(
            level=os.environ.get("CKPT_LOG_LEVEL", "INFO").upper(), handlers=[handler]
        )
    except ValueError as e:
        raise fail(f"CKPT_LOG_LEVEL: {plain(e)} (use DEBUG, INFO, WARNING or ERROR)") from None
    cfg = _config(config, shm_dir, run_id, storage)
    if not cfg.shm_dir:
        raise fail("no shared-memory directory: set CKPT_SHM_DIR or pass --shm-dir")
    options = SidecarOptions(
        poll_s=poll_s,
        grace_s=_grace(grace_s),
        probe_every_s=probe_every_s,
        commit_timeout_s=commit_timeout_s,
        exit_with_trainer=exit_with_trainer,
        wait_for_trainer_s=wait_for_trainer_s,
        metrics_port=metrics_port,
        ranks=tuple(rank) if rank else None,
        replicas=replicas_or_off(),
    )
    try:
        code = run_sidecar(cfg, options)
    except ServeError as e:
        raise fail(str(e)) from None
    raise typer.Exit(code)
