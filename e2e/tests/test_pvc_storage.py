"""Scenario ``pvc-storage``: checkpoints on a PVC that only the pods mount.

As in a real cluster, the operator (a host process given only what the chart's
Deployment gives it) cannot open the policy's ``storage.local.path``: the claim is mounted
at a container path that exists only in the pods' mount translation. Everything it knows
about the run's checkpoints comes from the pods' termination messages (the agent's
checkpoint report, ``ckpt_agent.format.termination``), which the harness reports in the
pod status as a kubelet would, also after a SIGKILL:

* a SIGKILL restarts the job from the newest verified checkpoint the pod reported;
* the restart dies right away (nothing new reported): a crash loop, the checkpoint is
  poisoned and the next restart resumes from the one before;
* the policy status names the last verified checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.format.termination import parse_report
from ckpt_e2e.kubelet import PodRun
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import (
    Training,
    annotations_of,
    condition,
    events,
    operator_status,
    result_path,
)

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=80, seed=7, step_sleep=0.1)


def _reported_ids(run: PodRun) -> list[str]:
    assert run.local is not None
    text = run.local.termination_log.read_bytes()
    return [c.id for c in parse_report(text).checkpoints] if text.strip() else []


def test_pvc_storage_the_operator_cannot_read(scenario: Scenario) -> None:
    assert not Path(scenario.pod_only_path).exists()
    scenario.apply_policy(
        "e2e", storage=scenario.pvc_storage(), recovery={"maxRestarts": 3, "backoffSeconds": 0}
    )
    view = scenario.view()  # the test may look at the claim's folder; the operator cannot

    def crash_first_restart(pod: dict[str, Any]) -> Any:
        job = pod["metadata"]["labels"]["training.kubeflow.org/job-name"]
        return "crash" if re.search(r"-r1$", job) else "run"

    runner = scenario.runner(decide=crash_first_restart)
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    run_id = scenario.run_id("train")
    # the claim is mounted at the pod-only path, the storage URL translated to the claim
    assert first.local is not None
    assert first.local.local_path(scenario.pod_only_path) == scenario.store

    # SIGKILL once two weights checkpoints are verified and the pod has reported them
    def two_reported() -> bool:
        assert first.running, first.local and first.local.log_text()[-3000:]
        valid = [r for r in view.valid(run_id) if r.has_weights and r.step >= 20]
        return len(valid) >= 2 and valid[-1].id in _reported_ids(first)

    scenario.cluster.wait_for(two_reported, timeout=120, what="two reported checkpoints")
    first.local.kill()
    assert first.wait(30) == 137
    reported = parse_report(first.local.termination_log.read_bytes())
    weights = [c for c in reported.checkpoints if c.tier.value != "heartbeat"]
    newest, previous = weights[0], weights[1]
    assert reported.run_id == run_id

    # the kubelet's report of the SIGKILLed container carries the checkpoint report
    pod = scenario.cluster.get_json("pod", first.name, "-n", scenario.namespace)
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 137
    assert parse_report(terminated["message"]).checkpoints == reported.checkpoints

    # 1. SIGKILL -> restart from the newest verified checkpoint the pod reported
    r1 = scenario.wait_restart("train")
    assert r1["metadata"]["name"] == "train-r1"
    ann = annotations_of(r1)
    assert ann["ckpt.dev/resume-from"] == newest.id
    assert ann["ckpt.dev/resume-step"] == str(newest.step)
    assert newest.id in [c.id for c in parse_report(ann["ckpt.dev/checkpoints"]).checkpoints]
    failed = annotations_of(scenario.job("train"))
    last = json.loads(failed["ckpt.dev/last-verified-checkpoint"])
    assert (last["checkpointId"], last["source"]) == (newest.id, "pods")
    ladder = events(
        scenario.cluster, scenario.namespace, name="train", reason="LadderStep", wait=30
    )
    assert ladder and newest.id in ladder[-1]["message"]

    # 2. the restart dies before advancing: crash loop, poisoned, the one before is next
    run1 = runner.wait_run("train-r1")
    assert run1.wait(60) == 137
    r2 = scenario.wait_restart("train-r1")
    assert r2["metadata"]["name"] == "train-r2"
    ann2 = annotations_of(r2)
    assert ann2["ckpt.dev/poisoned"] == newest.id
    assert ann2["ckpt.dev/resume-from"] == previous.id
    crash = events(
        scenario.cluster, scenario.namespace, name="train-r1", reason="CrashLoop", wait=30
    )
    assert crash and newest.id in crash[0]["message"], crash

    run2 = runner.wait_run("train-r2")
    assert run2.wait(180) == 0, run2.local.log_text()[-3000:] if run2.local else ""
    res = json.loads(result_path(scenario.results, run2.pod).read_text())
    assert res["first_step"] == previous.step + 1
    assert res["resume"]["checkpoint_id"] == previous.id
    assert condition(scenario.wait_finished("train-r2"), "Succeeded") is not None
    assert operator_status(scenario.job("train")).get("state") == "Restarted"

    # 3. the policy status names the last verified checkpoint, as the pods reported it
    final = _reported_ids(run2)
    assert final, "the finished pod reported no checkpoint"
    path = f"/apis/ckpt.dev/v1alpha1/namespaces/{scenario.namespace}/checkpointpolicies/e2e"

    def policy_status() -> dict[str, Any] | None:
        status = scenario.cluster.request("GET", path).get("status") or {}
        lv = status.get("lastVerifiedCheckpoint") or {}
        return status if lv.get("step", -1) > newest.step else None

    status = scenario.cluster.wait_for(policy_status, timeout=90, what="lastVerifiedCheckpoint")
    assert isinstance(status, dict)
    lv = status["lastVerifiedCheckpoint"]
    assert lv["runId"] == run_id and lv["source"] == "pods"
    assert lv["checkpointId"] in final
    assert status["lastValid"][run_id]["checkpointId"] == lv["checkpointId"]
    reconciled = [c for c in status["conditions"] if c["type"] == "Reconciled"]
    assert reconciled and reconciled[0]["reason"] == "RetentionInPods"
    # the operator never created the path it cannot see
    assert not Path(scenario.pod_only_path).exists()
