"""TrainJobs (Kubeflow Trainer v2 on JobSet) on the real controllers: issue #15.

The chain is the real one: TrainJob → JobSet (Trainer's controller) → Job (JobSet's) →
pod (kube-controller-manager's Job controller) → kwok node, and the harness runs the pod
as the example trainer with the real agent (``ckpt_e2e.trainer_v2``, ``ckpt_e2e.trainjob``).
A crashed or evicted trainer fails its Job (``backoffLimit: 0``), JobSet restarts the
whole JobSet (``failurePolicy``: restart attempt ``n+1`` recreates every pod) and the
operator, which owns the budget, plans each attempt on the TrainJob (resume point,
poisoning, giving up) before the attempt's pods may run.

Lean on purpose (two TrainJobs): the first goes through a SIGKILL and a drain in one
run, the second through a crash loop.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from ckpt_agent.records import CheckpointRecord
from ckpt_e2e.kubelet import PodRun
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import (
    Training,
    condition,
    events,
    final_loss,
    loss_log_path,
    reference_run,
    result_path,
)
from ckpt_e2e.trainjob import TrainJobs, restart_attempt

pytestmark = pytest.mark.e2e

#: Paced so that a drain fits in the middle of a restart attempt.
TRAINING = Training(steps=80, seed=7, step_sleep=0.2)


def _env(run: PodRun) -> dict[str, Any]:
    ctr = next(c for c in run.pod["spec"]["containers"] if c["name"] == "node")
    return {e["name"]: e.get("value") for e in ctr.get("env") or ()}


def _result(scenario: Scenario, run: PodRun) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(result_path(scenario.results, run.pod).read_text())
    return data


def _log(run: PodRun) -> str:
    return run.local.log_text()[-3000:] if run.local else ""


# --------------------------------------------------------------------------- SIGKILL + drain
def test_trainjob_resumes_through_jobset_restarts_after_sigkill_and_drain(
    scenario: Scenario, trainjobs: TrainJobs
) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    ref = reference_run(TRAINING, cluster.workdir / "reference")
    node = f"kwok-tj-{uuid.uuid4().hex[:5]}"
    cluster.create_node(node, labels={"e2e.ckpt.dev/pool": node})
    try:
        scenario.apply_policy("e2e", pulse_every=10, full_every=1000)
        view = scenario.view()
        runner = trainjobs.runner()
        trainjobs.submit("train", TRAINING, node_selector={"e2e.ckpt.dev/pool": node})

        # 1. the TrainJob's pod (made by JobSet's Job) gets the agent
        first = trainjobs.wait_attempt(runner, "train", 0)
        labels = first.pod["metadata"]["labels"]
        assert labels["jobset.sigs.k8s.io/jobset-name"] == "train"
        assert labels.get("ckpt.dev/inject") == "true"
        run_id = trainjobs.run_id("train")
        env = _env(first)
        assert env["CKPT_RUN_ID"] == run_id
        assert env.get("CKPT_STORAGE_URL")
        assert "CKPT_RESUME_FROM" not in env
        injected = events(cluster, ns, reason="Injected", wait=30)
        assert injected, [e["reason"] for e in events(cluster, ns)]

        # 2. SIGKILL -> Job Failed -> JobSet restart attempt 1 -> resume from the newest valid
        def valid_at(step: int) -> bool:
            assert first.running, _log(first)
            newest = view.newest_valid(run_id)
            return newest is not None and newest.step >= step

        cluster.wait_for(lambda: valid_at(30), timeout=120, what="a valid checkpoint >= 30")
        assert first.local is not None
        first.local.kill()
        assert first.wait(30) == 137
        newest = view.newest_valid(run_id)
        assert newest is not None
        second = trainjobs.wait_attempt(runner, "train", 1)
        assert trainjobs.jobset_restarts("train") == 1
        ann = trainjobs.annotations("train")
        assert ann["ckpt.dev/resume-from"] == newest.id
        assert ann["ckpt.dev/restart-attempt"] == "1"
        assert _env(second)["CKPT_RESUME_FROM"] == newest.id
        assert _env(second)["CKPT_RUN_ID"] == run_id  # same run, same storage folder
        restarted = events(cluster, ns, name="train", kind="TrainJob", reason="Restarted", wait=30)
        assert restarted, [e["reason"] for e in events(cluster, ns, name="train")]
        assert (
            f"JobSet restart attempt 1 resumes from step {newest.step} ({newest.id}"
            in restarted[0]["message"]
        )

        # 3. a drain during attempt 1: save-now on cordon, a SIGTERM save on eviction
        scenario.wait_step(second, newest.step + 2)
        t_cordon = time.time()
        cluster.kubectl("cordon", node)

        def emergency(after: float, why: str) -> list[CheckpointRecord]:
            return [r for r in view.since(run_id, after) if r.emergency and why in r.reason.lower()]

        cluster.wait_for(
            lambda: emergency(t_cordon, "save-now"),
            timeout=30,
            what="an emergency checkpoint after the save-now signal",
        )
        assert second.running, "the signal-file save happens while the pod runs"
        t_drain = time.time()
        drain = cluster.drain(node)
        assert f"pod/{second.name} evicted" in drain.stdout, drain.stdout
        assert second.wait(60) == 143
        sigterm = emergency(t_drain, "sigterm")
        assert sigterm, [(r.id, r.reason) for r in view.since(run_id, t_drain)]
        last = max(sigterm, key=lambda r: r.step)
        assert "Traceback" not in _log(second), _log(second)

        # 4. attempt 2 resumes from the SIGTERM checkpoint once the node is back
        cluster.kubectl("uncordon", node)
        third = trainjobs.wait_attempt(runner, "train", 2, timeout=120)
        assert _env(third)["CKPT_RESUME_FROM"] == last.id
        assert third.wait(180) == 0, _log(third)
        res = _result(scenario, third)
        assert res["resume"]["checkpoint_id"] == last.id, res["resume"]
        assert res["first_step"] == last.step + 1
        # bit-exact: every step of the attempts equals the uninterrupted run's loss
        for run in (first, second, third):
            for step, loss in _logged_losses(scenario, run).items():
                assert loss == ref["losses"][step], f"{run.name} step {step}"
        assert final_loss(res) == final_loss(ref)
        assert res["final_params_sha256"] == ref["final_params_sha256"]
        done = trainjobs.wait_condition("train", "Complete", timeout=60)
        assert condition(done, "Failed") is None
        assert trainjobs.jobset_restarts("train") == 2
    finally:
        cluster.kubectl("uncordon", node, check=False)
        cluster.kubectl("delete", "node", node, "--ignore-not-found", check=False)


def _logged_losses(scenario: Scenario, run: PodRun) -> dict[str, str]:
    """The losses a pod logged, step -> float.hex (the loss log: an evicted pod has no result)."""
    out: dict[str, str] = {}
    for line in loss_log_path(scenario.results, run.pod).read_text().splitlines():
        rec = json.loads(line)
        out[str(rec["step"])] = rec["loss"]
    return out


# --------------------------------------------------------------------------- crash loop
def test_trainjob_crash_loop_poisons_checkpoints_then_gives_up(
    scenario: Scenario, trainjobs: TrainJobs
) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    scenario.apply_policy("e2e", recovery={"maxRestarts": 2, "backoffSeconds": 0})
    view = scenario.view()
    # every restart attempt dies right after it starts (e.g. an OOM kill while loading)
    runner = trainjobs.runner(decide=lambda pod: "crash" if restart_attempt(pod) else "run")
    trainjobs.submit("loop", Training(steps=200, seed=7, step_sleep=0.05))
    first = trainjobs.wait_attempt(runner, "loop", 0)
    run_id = trainjobs.run_id("loop")

    def three_valid() -> bool:
        assert first.running, _log(first)
        return len(view.valid(run_id)) >= 3

    cluster.wait_for(three_valid, timeout=120, what="three valid checkpoints")
    assert first.local is not None
    first.local.kill()
    assert first.wait(30) == 137
    valid = [r.id for r in view.valid(run_id)]

    # attempt 1 resumes the newest and crashes: attempt 2 skips it (poisoned)
    resumed = []
    for attempt in (1, 2):
        run = trainjobs.wait_attempt(runner, "loop", attempt)
        resumed.append(_env(run)["CKPT_RESUME_FROM"])
        assert run.wait(60) == 137
    assert resumed == [valid[-1], valid[-2]], (resumed, valid)
    crash = events(cluster, ns, name="loop", reason="CrashLoop", wait=30)
    assert crash and valid[-1] in crash[0]["message"], crash

    # the budget (2) is spent: GaveUp, the TrainJob is suspended, no attempt 3 runs
    status = trainjobs.wait_operator_state("loop", "GaveUp")
    assert status["reason"] == "MaxRestartsExceeded"
    assert "recovery.maxRestarts is 2" in status["message"]
    ann = trainjobs.annotations("loop")
    assert valid[-1] in ann["ckpt.dev/poisoned"].split(",")
    gave_up = events(cluster, ns, name="loop", reason="GaveUp", wait=30)
    assert gave_up and gave_up[0]["type"] == "Warning"
    cluster.wait_for(  # (the suspend follows the GaveUp status)
        lambda: (trainjobs.trainjob("loop") or {}).get("spec", {}).get("suspend") is True,
        timeout=30,
        what="TrainJob loop suspended",
    )
    time.sleep(3)
    assert len(runner.runs_of("loop")) == 3, [r.name for r in runner.runs_of("loop")]
