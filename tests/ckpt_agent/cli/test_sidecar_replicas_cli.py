"""``ckpt sidecar`` reads peer replication from the webhook's CKPT_REPLICA_* environment; a
bad value is logged and the sidecar runs without replication (never a failed start)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import ckpt_agent.cli.sidecar as cli_sidecar
from ckpt_agent.cli.main import app
from ckpt_agent.flash.sidecar import SidecarOptions
from ckpt_agent.policy import AgentConfig

runner = CliRunner()


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    for var in list(os.environ):
        if var.startswith("CKPT_"):
            monkeypatch.delenv(var)
    got: dict[str, Any] = {}

    def fake_run(config: AgentConfig, options: SidecarOptions) -> int:
        got["options"] = options
        return 0

    monkeypatch.setattr(cli_sidecar, "run_sidecar", fake_run)
    monkeypatch.setenv("CKPT_RUN_ID", "r1")
    monkeypatch.setenv("CKPT_STORAGE_URL", f"file://{tmp_path}/store")
    monkeypatch.setenv("CKPT_SHM_DIR", str(tmp_path / "shm"))
    return got


def _replica_env(monkeypatch: pytest.MonkeyPatch, **over: str) -> None:
    env = {
        "CKPT_REPLICA_PORT": "7471",
        "CKPT_REPLICA_PEERS": "j-worker-0.ns.svc:7471",
        "CKPT_REPLICA_SECRET_FILE": "/etc/ckpt-replica/secret",
        "CKPT_REPLICA_JOB": "ns/j",
        "CKPT_NODE_NAME": "node-1",
        **over,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_without_the_variables_replication_is_off(captured: dict[str, Any]) -> None:
    res = runner.invoke(app, ["sidecar", "--metrics-port", "0"])
    assert res.exit_code == 0, res.output
    assert captured["options"].replicas is None


def test_the_variables_reach_the_sidecar(
    captured: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _replica_env(monkeypatch)
    res = runner.invoke(app, ["sidecar", "--metrics-port", "0"])
    assert res.exit_code == 0, res.output
    replicas = captured["options"].replicas
    assert replicas is not None
    assert (replicas.node, replicas.namespace, replicas.job_id) == ("node-1", "ns", "j")
    assert replicas.peers == ("j-worker-0.ns.svc:7471",) and replicas.listen_port == 7471


def test_a_bad_value_is_logged_and_the_sidecar_runs_without(
    captured: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _replica_env(monkeypatch, CKPT_REPLICA_PEERS="not-a-peer")
    with caplog.at_level(logging.ERROR):
        res = runner.invoke(app, ["sidecar", "--metrics-port", "0"])
    assert res.exit_code == 0, res.output
    assert captured["options"].replicas is None
    logged = caplog.text
    assert "peer replication is off" in logged and "CKPT_REPLICA_PEERS" in logged
