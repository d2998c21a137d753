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

from ckpt_agent.flash.sidecar import SidecarOptions, load_config, run_sidecar
from ckpt_agent.flash.sidecar.options import DEFAULT_COMMIT_TIMEOUT_S, grace_from_env

__all__ = ["sidecar"]


def sidecar(
    config: Annotated[
        str | None,
        typer.Option("--config", help="Agent config JSON (default: $CKPT_CONFIG + CKPT_* env)."),
    ] = None,
    shm_dir: Annotated[
        str | None,
        typer.Option("--shm-dir", help="Shared-memory directory (default: $CKPT_SHM_DIR)."),
    ] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id.")] = None,
    storage: Annotated[str | None, typer.Option("--storage", help="Storage URL or path.")] = None,
    poll_s: Annotated[float, typer.Option("--poll-s", help="Seconds between passes.")] = 0.02,
    grace_s: Annotated[
        float | None,
        typer.Option("--grace-s", help="SIGTERM drain deadline (default: $CKPT_GRACE_S or 25)."),
    ] = None,
    probe_every_s: Annotated[
        float, typer.Option("--probe-every-s", help="Seconds between storage/GPU probes.")
    ] = 10.0,
    commit_timeout_s: Annotated[
        float,
        typer.Option("--commit-timeout-s", help="Seconds to wait for the other ranks' parts."),
    ] = DEFAULT_COMMIT_TIMEOUT_S,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="HTTP port (default: the config's; 0: none)."),
    ] = None,
    rank: Annotated[
        list[int] | None,
        typer.Option("--rank", help="Serve only this rank (repeatable)."),
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
        typer.Option("--wait-for-trainer-s", help="Local mode: give up without a trainer."),
    ] = 120.0,
) -> None:
    """Persist a run's shared-memory snapshots (the pod's sidecar; flash checkpoints).

    Reads the same environment as the trainer (CKPT_CONFIG, CKPT_SHM_DIR,
    CKPT_STORAGE_URL, CKPT_RUN_ID, CKPT_METRICS_PORT …), the policy's S3 settings
    included. Serves /metrics, /healthz and /readyz; SIGTERM persists what is
    pending and exits within the grace period (CKPT_GRACE_S).
    """
    logging.basicConfig(
        level=os.environ.get("CKPT_LOG_LEVEL", "INFO"),
        format="%(asctime)s ckpt-sidecar %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    cfg = load_config(config, shm_dir=shm_dir, run_id=run_id, storage=storage)
    if not cfg.shm_dir:
        sys.stderr.write("ckpt sidecar: no shared-memory directory (set CKPT_SHM_DIR)\n")
        raise typer.Exit(2)
    options = SidecarOptions(
        poll_s=poll_s,
        grace_s=grace_s if grace_s is not None else grace_from_env(),
        probe_every_s=probe_every_s,
        commit_timeout_s=commit_timeout_s,
        exit_with_trainer=exit_with_trainer,
        wait_for_trainer_s=wait_for_trainer_s,
        metrics_port=metrics_port,
        ranks=tuple(rank) if rank else None,
    )
    raise typer.Exit(run_sidecar(cfg, options))
