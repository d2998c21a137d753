"""Scenarios 4–6: SIGKILL → resume exactly; a corrupted newest checkpoint; a crash loop.

Every "pod" is the real example script with the real agent (run locally by the
PodRunner), writing real checkpoints to the namespace's PVC folder; the operator sees
the training-operator mark the PyTorchJob Failed, walks the ladder over the same
storage and creates the restart, whose pod the webhook injects with the resume point.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from ckpt_e2e.kubelet import PodRun
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import (
    StorageView,
    Training,
    annotations_of,
    condition,
    events,
    final_loss,
    operator_status,
    reference_run,
    result_path,
)

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=80, seed=7, step_sleep=0.1)


def _result(scenario: Scenario, run: PodRun) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(result_path(scenario.results, run.pod).read_text())
    return data


def _reference(scenario: Scenario) -> dict[str, Any]:
    return reference_run(TRAINING, scenario.cluster.workdir / "reference")


def _kill_after_valid(
    scenario: Scenario, view: StorageView, run: PodRun, run_id: str, step: int
) -> None:
    """SIGKILL the training once a valid weights checkpoint at ``step`` or later exists."""

    def ready() -> bool:
        if not run.running:
            raise AssertionError(f"{run.name} ended early:\n{run.local and run.local.log_text()}")
        newest = view.newest_valid(run_id)
        return newest is not None and newest.step >= step

    scenario.cluster.wait_for(ready, timeout=120, what=f"a valid checkpoint at step >= {step}")
    assert run.local is not None
    run.local.kill()  # the whole container, as when a node or the container dies
    assert run.wait(30) == 137


def _assert_same_end(scenario: Scenario, run: PodRun, resumed_from_step: int) -> dict[str, Any]:
    """The resumed run continued right after its checkpoint and ended like the reference."""
    ref = _reference(scenario)
    res = _result(scenario, run)
    assert res["first_step"] == resumed_from_step + 1
    assert res["resume"]["exact"] is True
    # every step it ran has exactly the reference's loss (float.hex, bit for bit) ...
    for step, loss in res["losses"].items():
        assert loss == ref["losses"][step], f"step {step}: {loss} != {ref['losses'][step]}"
    # ... so the final loss and the final parameters are the uninterrupted run's
    assert final_loss(res) == final_loss(ref)
    assert res["final_params_sha256"] == ref["final_params_sha256"]
    return res


# --------------------------------------------------------------------------- scenario 4
def test_sigkill_mid_run_resumes_from_the_newest_valid_checkpoint(scenario: Scenario) -> None:
    _reference(scenario)  # computed first: the job then has both CPUs
    scenario.apply_policy("e2e")
    view = scenario.view()
    runner = scenario.runner()
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    run_id = scenario.run_id("train")

    _kill_after_valid(scenario, view, first, run_id, 30)
    newest = view.newest_valid(run_id)
    assert newest is not None
    tiers = {r.tier.value for r in view.checkpoints(run_id, heartbeat=True)}
    assert {"heartbeat", "pulse"} <= tiers  # tiered checkpoints were written

    # pod Failed (137) -> PyTorchJob Failed (training-operator) -> operator restarts it
    pod = scenario.cluster.get_json("pod", first.name, "-n", scenario.namespace)
    assert pod["status"]["phase"] == "Failed"
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 137
    restart = scenario.wait_restart("train")
    failed = scenario.job("train")
    assert condition(failed, "Failed") is not None
    ann = annotations_of(restart)
    assert restart["metadata"]["name"] == "train-r1"
    assert ann["ckpt.dev/resume-from"] == newest.id
    assert ann["ckpt.dev/resume-step"] == str(newest.step)
    assert ann["ckpt.dev/restart-count"] == "1"
    assert ann["ckpt.dev/restart-of"] == "train"
    assert ann["ckpt.dev/run-id"] == run_id  # same run, same storage folder
    assert operator_status(failed)["state"] == "Restarted"

    # the new pod gets the resume point injected and resumes from exactly that checkpoint
    second = runner.wait_run("train-r1")
    env = {e["name"]: e.get("value") for e in second.pod["spec"]["containers"][0]["env"]}
    assert env["CKPT_RESUME_FROM"] == newest.id
    assert second.wait(180) == 0, second.local.log_text()[-3000:] if second.local else ""
    res = _assert_same_end(scenario, second, newest.step)
    assert res["resume"]["checkpoint_id"] == newest.id
    assert condition(scenario.wait_finished("train-r1"), "Succeeded") is not None

    # what happened is on the job as Events, in order
    reasons = [e["reason"] for e in events(scenario.cluster, scenario.namespace, name="train")]
    for r in ("Injected", "JobFailed", "LadderStep", "Restarted"):
        assert r in reasons, reasons
    restarted = events(
        scenario.cluster, scenario.namespace, name="train", reason="Restarted", wait=30
    )
    assert (
        f"restarted as train-r1 from step {newest.step} ({newest.id}, resume)"
        in (restarted[0]["message"])
    )
    assert scenario.operator.metric("ckpt_operator_restarts_total", {"action": "resume"}) >= 1


# --------------------------------------------------------------------------- scenario 5
def _unique_blob(store: Path, run_id: str, ckpt_id: str) -> Path:
    """A payload blob referenced by ``ckpt_id`` and by no other checkpoint of the run."""
    steps = store / run_id / "steps"

    def blobs_of(folder: Path) -> set[str]:
        out: set[str] = set()
        for manifest in folder.glob("rank_*.json"):
            out |= set(json.loads(manifest.read_text()).get("blobs") or {})
        return out

    mine = blobs_of(steps / ckpt_id)
    others: set[str] = set()
    for folder in steps.iterdir():
        if folder.name != ckpt_id:
            others |= blobs_of(folder)
    unique = sorted(mine - others)
    assert unique, f"{ckpt_id} shares all its blobs with other checkpoints"
    return store / run_id / "blobs" / "sha256" / unique[0][:2] / unique[0]


def test_corrupted_newest_checkpoint_makes_the_ladder_take_the_previous(
    scenario: Scenario,
) -> None:
    _reference(scenario)
    scenario.apply_policy("e2e")
    view = scenario.view()
    runner = scenario.runner()
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    run_id = scenario.run_id("train")

    def two_valid() -> bool:
        assert first.running, first.local and first.local.log_text()
        return len(view.valid(run_id)) >= 2 and view.valid(run_id)[-1].step >= 30

    scenario.cluster.wait_for(two_valid, timeout=120, what="two valid checkpoints")
    # Freeze the training (nothing new gets written), rot a byte of the newest valid
    # checkpoint's payload, then crash it.
    assert first.local is not None
    first.local.signal_container(signal.SIGSTOP)  # freeze the whole container
    valid = view.valid(run_id)
    newest, previous = valid[-1], valid[-2]
    blob = _unique_blob(scenario.store, run_id, newest.id)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    first.local.kill()
    first.local.signal_container(signal.SIGCONT)
    assert first.wait(30) == 137

    restart = scenario.wait_restart("train")
    ann = annotations_of(restart)
    assert ann["ckpt.dev/resume-from"] == previous.id, (newest.id, previous.id)
    rejected = events(
        scenario.cluster, scenario.namespace, name="train", reason="CheckpointRejected", wait=30
    )
    assert rejected and newest.id in rejected[0]["message"], rejected
    assert f"blob {blob.name[:16]}" in rejected[0]["message"]
    assert "corrupted" in rejected[0]["message"]
    ladder = events(
        scenario.cluster, scenario.namespace, name="train", reason="LadderStep", wait=30
    )
    assert previous.id in ladder[-1]["message"] and "accepted" in ladder[-1]["message"]

    second = runner.wait_run(restart["metadata"]["name"])
    assert second.wait(180) == 0, second.local.log_text()[-3000:] if second.local else ""
    _assert_same_end(scenario, second, previous.step)


# --------------------------------------------------------------------------- scenario 6
def test_crash_loop_poisons_checkpoints_then_gives_up_after_max_restarts(
    scenario: Scenario,
) -> None:
    scenario.apply_policy("e2e", recovery={"maxRestarts": 3, "backoffSeconds": 0})
    view = scenario.view()

    def crash_restarts(pod: dict[str, Any]) -> Any:
        # every resumed run dies right after it starts (e.g. an OOM kill while loading)
        job = pod["metadata"]["labels"]["training.kubeflow.org/job-name"]
        is_restart = re.search(r"-r\d+$", job) is not None
        return "crash" if is_restart else "run"

    runner = scenario.runner(decide=crash_restarts)
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    run_id = scenario.run_id("train")

    def three_valid() -> bool:
        assert first.running, first.local and first.local.log_text()
        return len(view.valid(run_id)) >= 3

    scenario.cluster.wait_for(three_valid, timeout=120, what="three valid checkpoints")
    assert first.local is not None
    first.local.kill()
    assert first.wait(30) == 137
    valid = [r.id for r in view.valid(run_id)]

    # train -> r1 (newest) -> r2 (r1's checkpoint poisoned) -> r3 (poisoned again) -> give up
    chain = ["train", "train-r1", "train-r2", "train-r3"]
    resumed: list[str] = []
    for prev, name in itertools.pairwise(chain):
        job = scenario.wait_restart(prev)
        assert job["metadata"]["name"] == name
        resumed.append(annotations_of(job)["ckpt.dev/resume-from"])
        run = runner.wait_run(name)
        assert run.wait(60) == 137
    assert resumed == [valid[-1], valid[-2], valid[-3]], (resumed, valid)

    last = scenario.wait_finished("train-r3")
    ann = annotations_of(last)
    assert ann["ckpt.dev/poisoned"].split(",") == [valid[-1], valid[-2]]
    for name, poisoned in (("train-r1", valid[-1]), ("train-r2", valid[-2])):
        crash = events(scenario.cluster, scenario.namespace, name=name, reason="CrashLoop", wait=30)
        assert crash and poisoned in crash[0]["message"], crash

    # after maxRestarts: stays failed, says why, and nothing else is created
    status = scenario.wait_operator_state("train-r3", "GaveUp")
    assert status["reason"] == "MaxRestartsExceeded"
    assert "recovery.maxRestarts is 3" in status["message"]
    gave_up = events(
        scenario.cluster, scenario.namespace, name="train-r3", reason="GaveUp", wait=30
    )
    assert gave_up and gave_up[0]["type"] == "Warning"
    assert "MaxRestartsExceeded" in gave_up[0]["message"]
    assert condition(scenario.job("train-r3"), "Failed") is not None
    assert scenario.job("train-r4") is None
    assert "ckpt.dev/restarted-as" not in annotations_of(scenario.job("train-r3"))
