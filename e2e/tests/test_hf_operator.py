"""A Hugging Face ``Trainer`` end to end through the operator (issue #26).

The training is ``examples/train_hf_trainer.py`` — a stock ``Trainer`` (tiny random-init
GPT-2, generated data, dropout, gradient accumulation, warm-up + linear decay) with the
three lines of ``docs/integrations/transformers.md`` — submitted as the shipped
manifests ``examples/hf-trainer-pytorchjob.yaml`` and ``examples/hf-trainer-trainjob.yaml``
(only what the harness needs is added: this checkout's examples folder as the "image",
a results folder, pacing). The pod's container is SIGKILLed at a seeded step once a
checkpoint is valid; the operator restarts the PyTorchJob (``hf-trainer-r1``) or plans
JobSet's restart attempt of the TrainJob from the newest valid checkpoint, the restarted
script resumes there through ``CheckpointCallback``, and the run ends with exactly the
weights, the AdamW state and the parameter groups of an uninterrupted run (the same
script with ``--no-checkpoint``, a plain local process, once per session): SHA-256 of
every tensor, so ``torch.equal`` tensor by tensor, and every step's loss as ``float.hex``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckpt_agent.records import CheckpointRecord
from ckpt_e2e.kubelet import PodRun
from ckpt_e2e.procs import clean_env
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.trainer_v2 import NODE
from ckpt_e2e.training import (
    CODE_MOUNT,
    EXAMPLES_DIR,
    IMAGE,
    RESULTS_MOUNT,
    StorageView,
    Training,
    annotations_of,
    condition,
    last_logged_step,
    loss_log_path,
    result_path,
    trainer_env,
    trainer_mounts,
    trainer_volumes,
)
from ckpt_e2e.trainjob import TrainJobs, trainjob_manifest

pytest.importorskip("transformers")  # the hf extra (in dev)

pytestmark = pytest.mark.e2e

SCRIPT = EXAMPLES_DIR / "train_hf_trainer.py"
PYTORCHJOB = EXAMPLES_DIR / "hf-trainer-pytorchjob.yaml"
TRAINJOB = EXAMPLES_DIR / "hf-trainer-trainjob.yaml"
#: where the example manifests expect the script (the user's image)
IMAGE_DIR = "/workspace"
POLICY = "default"  # the policy the examples name
STEP_SLEEP = 0.4  # paces the 16 steps so a kill lands mid-run (does not change the numbers)
PULSE_EVERY = 4


def _load(path: Path) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(path.read_text())
    return obj


def _args(path: Path) -> list[str]:
    """The training arguments of an example manifest (what changes the numbers)."""
    obj = _load(path)
    ctr = (
        obj["spec"]["trainer"]
        if obj["kind"] == "TrainJob"
        else obj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    )
    return [str(a) for a in ctr["args"]]


# --------------------------------------------------------------------------- reference
_references: dict[tuple[str, ...], dict[str, Any]] = {}


def _reference(workdir: Path, args: list[str]) -> dict[str, Any]:
    """The uninterrupted run: the same script and arguments without the agent (cached)."""
    key = tuple(args)
    if key not in _references:
        out = workdir / f"hf-reference-{hashlib.sha256(' '.join(key).encode()).hexdigest()[:12]}"
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "result.json").exists():
            result = ["--out", str(out / "result.json"), "--output-dir", str(out / "hf")]
            proc = subprocess.run(
                [sys.executable, str(SCRIPT), *key, "--no-checkpoint", *result],
                capture_output=True,
                text=True,
                timeout=300,
                env=clean_env(),
                check=False,
            )
            assert proc.returncode == 0, f"reference run failed:\n{proc.stderr[-3000:]}"
        _references[key] = json.loads((out / "result.json").read_text())
    return _references[key]


# --------------------------------------------------------------------------- manifests
def _in_harness(ctr: dict[str, Any]) -> None:
    """The example's container as the harness runs it: the script from this checkout
    (the examples folder mounted where the image would have it), pod-named outputs."""
    script = ctr["command"][-1]
    assert script == f"{IMAGE_DIR}/{SCRIPT.name}", ctr["command"]
    ctr["image"] = IMAGE  # never pulled: the harness runs the command locally
    ctr["command"] = [*ctr["command"][:-1], f"{CODE_MOUNT}/{SCRIPT.name}"]
    ctr["args"] = [
        *ctr["args"],
        "--step-sleep",
        str(STEP_SLEEP),
        "--out",
        f"{RESULTS_MOUNT}/$(POD_NAME).$(POD_UID).json",
        "--loss-log",
        f"{RESULTS_MOUNT}/$(POD_NAME).$(POD_UID).losses.jsonl",
    ]
    ctr["env"] = [*(ctr.get("env") or ()), *trainer_env()]


def _pytorchjob(scenario: Scenario) -> dict[str, Any]:
    job = copy.deepcopy(_load(PYTORCHJOB))
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    ctr = pod["containers"][0]
    _in_harness(ctr)
    ctr["volumeMounts"] = [*(ctr.get("volumeMounts") or ()), *trainer_mounts()]
    pod["volumes"] = [*(pod.get("volumes") or ()), *trainer_volumes(scenario.results)]
    return job


def _trainjob(scenario: Scenario) -> dict[str, Any]:
    job = copy.deepcopy(_load(TRAINJOB))
    _in_harness(job["spec"]["trainer"])
    # the code and results volumes come in through the harness's runtime patch
    harness = trainjob_manifest(job["metadata"]["name"], Training(), scenario.results)
    job["spec"]["runtimePatches"] = harness["spec"]["runtimePatches"]
    return job


# --------------------------------------------------------------------------- checks
def _log(run: PodRun) -> str:
    return run.local.log_text()[-3000:] if run.local else ""


def _kill_mid_run(
    scenario: Scenario, view: StorageView, run: PodRun, run_id: str, seed: int
) -> CheckpointRecord:
    """SIGKILL the whole container at a seeded step once a checkpoint is valid; the newest
    valid checkpoint left behind (where the operator must resume)."""
    kill_step = random.Random(seed).randint(PULSE_EVERY + 1, 10)

    def ready() -> bool:
        assert run.running, f"{run.name} ended before the kill:\n{_log(run)}"
        return (
            last_logged_step(scenario.results, run.pod) >= kill_step
            and view.newest_valid(run_id) is not None
        )

    scenario.cluster.wait_for(
        ready, timeout=240, what=f"step {kill_step} and a valid checkpoint", interval=0.1
    )
    assert run.local is not None
    run.local.kill()
    assert run.wait(30) == 137, _log(run)
    newest = view.newest_valid(run_id)
    assert newest is not None
    return newest


def _losses(scenario: Scenario, run: PodRun) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in loss_log_path(scenario.results, run.pod).read_text().splitlines():
        rec = json.loads(line)
        out[str(rec["step"])] = rec["loss"]
    return out


def _assert_exact(
    scenario: Scenario, killed: PodRun, resumed: PodRun, ckpt: CheckpointRecord, ref: dict[str, Any]
) -> None:
    """Resumed right after ``ckpt`` and ended bit for bit like the uninterrupted run."""
    res: dict[str, Any] = json.loads(result_path(scenario.results, resumed.pod).read_text())
    assert res["resume"]["checkpoint_id"] == ckpt.id, res["resume"]
    assert res["resume"]["exact"] is True
    assert res["first_step"] == ckpt.step + 1  # HF skipped the trained batches, counted on
    for run in (killed, resumed):  # every step either attempt ran: the reference's loss
        for step, loss in _losses(scenario, run).items():
            assert loss == ref["losses"][step], f"{run.name} step {step}"
    assert res["global_step"] == ref["global_step"] == ref["steps"]
    assert res["epoch"] == ref["epoch"]
    # every tensor of the weights and of the optimizer state: torch.equal (SHA-256)
    assert res["weights"] == ref["weights"]
    assert res["optimizer"] == ref["optimizer"]
    assert res["param_groups"] == ref["param_groups"]


def _env(run: PodRun, container: str) -> dict[str, Any]:
    ctr = next(c for c in run.pod["spec"]["containers"] if c["name"] == container)
    return {e["name"]: e.get("value") for e in ctr.get("env") or ()}


# --------------------------------------------------------------------------- PyTorchJob
def test_hf_trainer_pytorchjob_sigkill_resumes_bitwise(scenario: Scenario) -> None:
    ref = _reference(scenario.cluster.workdir, _args(PYTORCHJOB))
    scenario.apply_policy(POLICY, pulse_every=PULSE_EVERY, full_every=1000)
    view = scenario.view()
    runner = scenario.runner()
    job = _pytorchjob(scenario)
    name = job["metadata"]["name"]
    scenario.cluster.apply(job, namespace=scenario.namespace)
    first = runner.wait_run(name)
    run_id = scenario.run_id(name)
    assert "CKPT_RESUME_FROM" not in _env(first, "pytorch")

    newest = _kill_mid_run(scenario, view, first, run_id, seed=2601)
    restart = scenario.wait_restart(name)
    assert restart["metadata"]["name"] == f"{name}-r1"
    assert annotations_of(restart)["ckpt.dev/resume-from"] == newest.id
    second = runner.wait_run(f"{name}-r1")
    assert _env(second, "pytorch")["CKPT_RESUME_FROM"] == newest.id
    assert second.wait(300) == 0, _log(second)
    _assert_exact(scenario, first, second, newest, ref)
    assert condition(scenario.wait_finished(f"{name}-r1"), "Succeeded") is not None


# --------------------------------------------------------------------------- TrainJob
def test_hf_trainer_trainjob_sigkill_resumes_bitwise(
    scenario: Scenario, trainjobs: TrainJobs
) -> None:
    ref = _reference(scenario.cluster.workdir, _args(TRAINJOB))
    scenario.apply_policy(POLICY, pulse_every=PULSE_EVERY, full_every=1000)
    view = scenario.view()
    runner = trainjobs.runner()
    job = _trainjob(scenario)
    name = job["metadata"]["name"]
    trainjobs.wait_operator_admits(job)
    scenario.cluster.apply(job, namespace=scenario.namespace)
    first = trainjobs.wait_attempt(runner, name, 0)
    run_id = trainjobs.run_id(name)

    newest = _kill_mid_run(scenario, view, first, run_id, seed=2602)
    second = trainjobs.wait_attempt(runner, name, 1)
    assert trainjobs.annotations(name)["ckpt.dev/resume-from"] == newest.id
    env = _env(second, NODE)
    assert env["CKPT_RESUME_FROM"] == newest.id
    assert env["CKPT_RUN_ID"] == run_id
    assert second.wait(300) == 0, _log(second)
    _assert_exact(scenario, first, second, newest, ref)
    assert condition(trainjobs.wait_condition(name, "Complete", timeout=90), "Failed") is None
