"""``ckpt sidecar``: its flags, the config it reads, and its usage errors."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import ckpt_agent.cli.sidecar as cli_sidecar
from ckpt_agent.cli.main import app
from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions
from ckpt_agent.policy import AgentConfig

runner = CliRunner()


@pytest.fixture
def no_ckpt_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("CKPT_"):
            monkeypatch.delenv(var)


def test_help_lists_the_flags() -> None:
    res = runner.invoke(app, ["sidecar", "--help"])
    assert res.exit_code == 0
    for flag in ("--config", "--shm-dir", "--grace-s", "--rank", "--exit-with-trainer"):
        assert flag in res.output


def test_without_a_shared_memory_directory_it_is_a_usage_error(no_ckpt_env: None) -> None:
    res = runner.invoke(app, ["sidecar"])
    assert res.exit_code == 2


def test_flags_and_config_reach_the_sidecar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_ckpt_env: None
) -> None:
    got: dict[str, Any] = {}

    def fake_run(config: AgentConfig, options: SidecarOptions) -> int:
        got["config"], got["options"] = config, options
        return 0

    monkeypatch.setattr(cli_sidecar, "run_sidecar", fake_run)
    monkeypatch.setenv("CKPT_GRACE_S", "7")
    cfg = tmp_path / "config.json"
    cfg.write_text(
        AgentConfig.model_validate(
            {"runId": "r1", "storageUrl": "s3://b/p", "s3": {"partSizeMb": 32}}
        ).to_json()
    )
    res = runner.invoke(
        app,
        ["sidecar", "--config", str(cfg), "--shm-dir", str(tmp_path / "shm"),
         "--rank", "0", "--rank", "2", "--exit-with-trainer", "--metrics-port", "0"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    config, options = got["config"], got["options"]
    assert config.run_id == "r1" and config.shm_dir == str(tmp_path / "shm")
    assert config.s3 is not None and config.s3.part_size_mb == 32
    assert options.ranks == (0, 2) and options.exit_with_trainer
    assert options.metrics_port == 0 and options.grace_s == 7.0


def test_a_taken_metrics_port_is_a_clear_usage_error_not_a_storage_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_ckpt_env: None
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("CKPT_METRICS_ADDR", "127.0.0.1")
        res = runner.invoke(
            app,
            ["sidecar", "--shm-dir", str(tmp_path / "shm"), "--run-id", "r1",
             "--storage", (tmp_path / "store").as_uri(), "--metrics-port", str(port)],
        )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert f"cannot serve the sidecar's /metrics and /healthz on 127.0.0.1:{port}" in res.output
    assert "storage failed" not in res.output


def test_the_sidecar_listens_on_the_configured_metrics_address(tmp_path: Path) -> None:
    """CKPT_METRICS_ADDR: a pod's own address (two sidecars of two pods on one machine, or
    an IPv6 pod), as the trainer already did."""
    cfg = AgentConfig.model_validate(
        {
            "runId": "r1",
            "storageUrl": (tmp_path / "store").as_uri(),
            "shmDir": str(tmp_path / "shm"),
            "workDir": str(tmp_path / "work"),
            "metricsAddr": "127.0.0.2",
        }
    )
    with socket.socket() as other:  # the same port on another loopback address is taken
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        sidecar = Sidecar(cfg, SidecarOptions(metrics_port=port, poll_s=0.01))
        try:
            code = sidecar.run(until=lambda: True)
            assert code == 0
        finally:
            sidecar.close()
