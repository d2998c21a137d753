"""Scenario ``manual-recover``: after ``GaveUp``, a person names a step (issue #11 item 4).

``ckpt recover --job J --step N --reason ...`` (the real CLI, through kubectl)
annotates the failed job; a dry run changes nothing and reports the plan in an
Event; the real request makes a new job that resumes exactly at step N (a new
pin: ``ckpt.dev/resume-pin``), and the Events and the new job's annotations name
who asked and why.

The checkpoints are on a PVC only the pods mount (``Scenario.pvc_storage``): the operator
plans the manual restart from the checkpoints the failed pod reported in its termination
message, never from the storage; the step asked for is one the pod reported.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_agent.format.termination import parse_report
from ckpt_e2e import tools
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import Training, annotations_of, events

from .test_recovery import _assert_same_end, _kill_after_valid

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=80, seed=7, step_sleep=0.1)
REASON = "loss spike: rewind (e2e)"


def _ckpt_recover(scenario: Scenario, tmp: Path, *args: str) -> str:
    """The real ``ckpt recover --job`` with kubectl pointed at the test cluster."""
    wrapper = tmp / "kubectl"
    kubectl = tools.binary("kubectl")
    wrapper.write_text(
        f'#!/bin/sh\nexec "{kubectl}" --kubeconfig="{scenario.cluster.kubeconfig}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "KUBECTL": str(wrapper), "COLUMNS": "200"}
    argv = [sys.executable, "-m", "ckpt_agent.cli", "recover", "-n", scenario.namespace, *args]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_manual_recover_after_gave_up(scenario: Scenario, tmp_path: Path) -> None:
    assert not Path(scenario.pod_only_path).exists()
    scenario.apply_policy("e2e", storage=scenario.pvc_storage(), recovery={"maxRestarts": 0})
    view = scenario.view()
    runner = scenario.runner()
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    run_id = scenario.run_id("train")
    _kill_after_valid(scenario, view, first, run_id, 40)
    status = scenario.wait_operator_state("train", "GaveUp")
    assert status["reason"] == "MaxRestartsExceeded"
    # rewind to the oldest valid one the pod reported (all the operator knows of)
    pod = scenario.cluster.get_json("pod", first.name, "-n", scenario.namespace)
    message = pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    reported = {c.id for c in parse_report(message).checkpoints if c.tier.value != "heartbeat"}
    target = next(r for r in view.valid(run_id) if r.id in reported)

    # a dry run: an Event with the plan, nothing created
    _ckpt_recover(
        scenario,
        tmp_path,
        "--job",
        "train",
        "--step",
        str(target.step),
        "--reason",
        REASON,
        "--dry-run",
    )
    planned = scenario.cluster.wait_for(
        lambda: events(scenario.cluster, scenario.namespace, name="train", reason="RecoverPlanned"),
        timeout=60,
        what="the dry run's RecoverPlanned Event",
    )
    assert f"would restart as train-r1 from {target.id}" in planned[0]["message"]
    assert REASON in planned[0]["message"]
    ann = annotations_of(scenario.job("train"))
    assert json.loads(ann["ckpt.dev/recover-plan"])["resumeFrom"] == target.id
    assert scenario.job("train-r1") is None
    assert json.loads(ann["ckpt.dev/status"])["state"] == "GaveUp"

    # the request: a new job resuming exactly there
    _ckpt_recover(
        scenario, tmp_path, "--job", "train", "--step", str(target.step), "--reason", REASON
    )
    restart = scenario.wait_restart("train", timeout=60)
    new = annotations_of(restart)
    assert restart["metadata"]["name"] == "train-r1"
    assert new["ckpt.dev/resume-from"] == target.id
    assert new["ckpt.dev/resume-pin"] == "train-r1"
    assert new["ckpt.dev/recover-reason"] == REASON
    assert new["ckpt.dev/recover-by"]
    assert "ckpt.dev/recover-step" not in new
    manual = events(
        scenario.cluster, scenario.namespace, name="train", reason="ManualRecover", wait=30
    )
    assert (
        manual
        and REASON in manual[0]["message"]
        and new["ckpt.dev/recover-by"] in (manual[0]["message"])
    )
    second = runner.wait_run("train-r1")
    assert second.wait(180) == 0, second.local.log_text()[-3000:] if second.local else ""
    res = _assert_same_end(scenario, second, target.step)
    assert res["resume"]["checkpoint_id"] == target.id
    assert not Path(scenario.pod_only_path).exists()  # the operator never saw the claim
