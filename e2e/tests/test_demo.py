"""The README's demo (``scripts/demo.sh`` → ``python -m ckpt_e2e.demo``) cannot rot.

The demo's core, :func:`ckpt_e2e.demo.run_demo`, runs here against the suite's cluster
and operator (brought up by the same ``Stack.up`` the demo uses; two clusters at once
would not fit on a small machine); the entry points are checked for their options.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ckpt_e2e import LocalCluster
from ckpt_e2e.demo import DEMO_TRAINING, Printer, run_demo, summary_text
from ckpt_e2e.stack import OperatorProcess, Stack
from ckpt_e2e.tools import REPO_ROOT
from ckpt_e2e.training import Training

pytestmark = pytest.mark.e2e


def test_demo_entry_points_answer_help() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "e2e")}
    for argv in (
        [sys.executable, "-m", "ckpt_e2e.demo", "--help"],
        ["bash", str(REPO_ROOT / "scripts" / "demo.sh"), "--help"],
    ):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)
        assert out.returncode == 0, out.stderr
        assert "--keep" in out.stdout


def test_demo_trains_crashes_resumes_and_reports(
    cluster: LocalCluster, stack: Stack, operator: OperatorProcess, tmp_path: Path
) -> None:
    namespace = f"e2e-demo-{uuid.uuid4().hex[:5]}"
    training = Training(steps=100, seed=DEMO_TRAINING.seed, step_sleep=0.05)
    try:
        result = run_demo(
            cluster, stack, tmp_path / "demo", namespace=namespace, training=training, say=Printer()
        )
    finally:
        cluster.delete_namespace(namespace)
    assert result.exact, result
    assert result.restart == "mnist-r1"
    assert result.resume_step < result.killed_at_step
    assert result.resume_from.endswith(f"_step_{result.resume_step:012d}")
    assert 0 < result.seconds_to_restart_job < 60
    assert result.seconds_to_restart_job <= result.seconds_to_resume
    assert "pulse" in result.checkpoints_by_tier and result.heartbeat_ring
    report = (tmp_path / "demo" / "report.md").read_text()
    assert "Summary" in report and "Restarted" in report and result.resume_from in report
    data = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert data["resume_from"] == result.resume_from
    assert (tmp_path / "demo" / "events.txt").read_text().count("Restarted") == 1
    page = Path(result.checkpointing_report).read_text()  # `ckpt report` of the run
    assert result.resume_from in page and 'id="plot-loss"><svg' in page
    doc = json.loads(Path(result.checkpointing_json).read_text())  # ... its --json twin
    assert len(doc["logs"]) >= 2  # both pods' logs, merged: the second pod resumed
    assert any(r["checkpoint"] == result.resume_from and r["ok"] for r in doc["restarts"])
    saves = [s for s in doc["saves"] if s["persist_s"] is not None]  # flash mode: persisted
    assert saves and all(s["stall_s"] is not None and s["bytes_raw"] for s in saves)
    fleet = json.loads(Path(result.fleet_report).with_suffix(".json").read_text())  # --all
    assert [r["run_id"] for r in fleet["runs"]] == [result.run_id]
    assert "no decision log" not in fleet["runs"][0]["traits"]
    assert 'id="plot-fleet"><svg' in Path(result.fleet_report).read_text()
    text = summary_text(result)
    assert "identical to the uninterrupted run" in text
