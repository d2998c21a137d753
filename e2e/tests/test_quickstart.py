"""The newcomer's paths cannot rot: ``scripts/demo.sh --local`` (no cluster) trains, is
SIGKILLed, resumes bit-exact and writes ``ckpt report``; ``scripts/demo.sh`` builds exactly
the Go tools the demo's harness starts (no Go toolchain or cluster needed for these)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_e2e import tools
from ckpt_e2e.bootstrap import ClusterOptions, ControlPlane
from ckpt_e2e.tools import REPO_ROOT

DEMO_SH = REPO_ROOT / "scripts" / "demo.sh"


def _demo_tools() -> set[str]:
    found = re.search(r"^DEMO_TOOLS=\(([^)]*)\)", DEMO_SH.read_text(), re.MULTILINE)
    assert found, "scripts/demo.sh lost its DEMO_TOOLS list"
    return set(found.group(1).split())


def test_the_demo_builds_exactly_the_tools_its_cluster_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What the demo's LocalCluster (default options) resolves, plus helm (the chart) and
    the training-operator module (its PyTorchJob CRD): no MinIO, Toxiproxy, promtool,
    JobSet or Trainer."""
    asked: list[str] = []
    monkeypatch.setattr(tools, "binary", lambda name: asked.append(name) or tmp_path / name)
    plane = ControlPlane(tmp_path, ClusterOptions(), None, persistent=False)  # type: ignore[arg-type]
    plane._resolve_binaries()
    needed = {tools.BINARIES[name] for name in asked} | {"helm", "training-operator"}
    assert _demo_tools() == needed
    assert all((tools.TOOLS_DIR / name / "go.mod").exists() for name in needed)


def test_demo_sh_local_answers_help() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "e2e")}
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_e2e.quickstart", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "--kill-after" in out.stdout
    assert (
        "--local"
        in subprocess.run(
            ["bash", str(DEMO_SH), "--help"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_trains_is_killed_resumes_exactly_and_reports(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "e2e"), str(REPO_ROOT / "agent")]),
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckpt_e2e.quickstart",
            "--steps",
            "40",
            "--kill-after",
            "15",
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "every step's loss bit-exact: True" in out.stdout
    assert (tmp_path / "latest-local").is_symlink()
    (run,) = [p for p in tmp_path.iterdir() if p.name.endswith("-local") and not p.is_symlink()]
    second = json.loads((run / "attempt2.json").read_text())
    assert second["resume"]["action"] == "resume" and second["resume"]["checkpoint_id"]
    assert second["first_step"] > 15  # resumed, not a fresh start
    report = json.loads((run / "checkpointing.json").read_text())
    assert report  # `ckpt report --json` of the run
    assert (run / "checkpointing.html").read_text().lstrip().lower().startswith("<!doctype html")
