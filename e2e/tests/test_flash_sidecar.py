"""Flash checkpoints through Kubernetes: the webhook's native sidecar persists, a trainer
restarted in place resumes from shared memory (issue #31, a step toward node loss).

A policy with ``agent.sidecar: true`` and the memory tier (a snapshot every 2 steps, a
pulse every 10): the webhook injects the ``ckpt-agent`` native sidecar and the
``medium: Memory`` emptyDir at ``CKPT_SHM_DIR``. The harness runs the sidecar and the
trainer as two local processes of the same pod (``PodRunner(sidecars=True)``), sharing
that folder. The trainer is SIGKILLed between two pulses; with ``restartPolicy:
OnFailure`` the kubelet restarts the container in place (a new LocalPod of the same pod)
while the sidecar keeps running: the restart resumes from the newest snapshot in shared
memory (``resume_shm``), newer than anything in storage, and the run ends bit for bit
like the uninterrupted one. The sidecar, not a persister of the trainer's, wrote every
checkpoint; memory-tier snapshots were recorded and never stored.
"""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.policy.models import Tier
from ckpt_e2e.api import http_get
from ckpt_e2e.localpod import LocalPod
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import (
    Training,
    last_logged_step,
    loss_log_path,
    pytorchjob_manifest,
    reference_run,
    result_path,
)

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=80, seed=7, step_sleep=0.05)  # the numbers of test_restart_in_place
PULSE_EVERY = 10
MEMORY_EVERY = 2
SIDECAR = "ckpt-agent"  # ckpt_operator.model.constants.SIDECAR_NAME
SHM_DIR = "/var/run/ckpt/shm"  # ckpt_operator.model.constants.SHM_DIR


def _port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free (the trainer's and the sidecar's metrics)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def _tiers() -> dict[str, Any]:
    pulse = {"baseInterval": PULSE_EVERY, "minInterval": PULSE_EVERY, "maxInterval": PULSE_EVERY}
    return {
        "heartbeat": {"everySteps": 1},
        "pulse": pulse,
        "full": {"everySteps": 40},
        "memory": {"enabled": True, "everySteps": MEMORY_EVERY},
    }


def _metric(text: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels, as exposed), 0 when absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_sidecar_persists_and_in_place_restart_resumes_from_shared_memory(
    scenario: Scenario,
) -> None:
    ref = reference_run(TRAINING, scenario.cluster.workdir / "reference")
    port = _port_pair()
    scenario.apply_policy(
        "e2e",
        metrics_port=None,
        extra={"agent": {"metricsPort": port, "sidecar": True}, "tiers": _tiers()},
    )
    view = scenario.view()
    runner = scenario.runner(sidecars=True)
    manifest = pytorchjob_manifest("flash", TRAINING, scenario.results, policy="e2e")
    manifest["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] = "OnFailure"
    scenario.cluster.apply(manifest, namespace=scenario.namespace)
    run = runner.wait_run("flash")
    assert run.local is not None
    trainer = run.local

    # the webhook's native sidecar runs beside the trainer, on the same shared memory
    [sidecar] = run.sidecars
    assert sidecar.is_sidecar and sidecar.container["name"] == SIDECAR
    assert sidecar.container["command"][:2] == ["ckpt", "sidecar"]
    assert trainer.env["CKPT_SHM_DIR"] == sidecar.env["CKPT_SHM_DIR"]
    shm = trainer.local_path(SHM_DIR)
    assert shm == sidecar.local_path(SHM_DIR) and str(shm).startswith("/dev/shm/")
    run_id = scenario.run_id("flash")
    sidecar_metrics = f"http://127.0.0.1:{port + 1}/metrics"

    # SIGKILL between two pulses, once the sidecar committed a pulse and recorded memory
    # snapshots: the newest snapshot in shared memory is then a memory-only one
    recorded = 'ckpt_sidecar_snapshots_total{outcome="recorded"}'

    def sidecar_at_work() -> bool:
        assert sidecar.running and trainer.running, sidecar.log_text()[-3000:]
        if view.newest_valid(run_id) is None:
            return False
        status, text = http_get(sidecar_metrics)
        return status == 200 and _metric(text, recorded) >= 2

    scenario.cluster.wait_for(sidecar_at_work, timeout=120, what="a pulse and memory snapshots")

    def between_pulses() -> bool:
        assert trainer.running, trainer.log_text()[-3000:]
        return 3 <= last_logged_step(scenario.results, run.pod) % PULSE_EVERY <= 7

    scenario.cluster.wait_for(
        between_pulses, timeout=60, what="a step between pulses", interval=0.01
    )
    trainer.signal_container(signal.SIGKILL)
    assert trainer.wait(30) == 137
    stored_at_kill = view.newest_valid(run_id)
    assert stored_at_kill is not None
    killed_after = last_logged_step(scenario.results, run.pod)
    pod = scenario.cluster.get_json("pod", run.name, "-n", scenario.namespace)
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 1
    assert sidecar.running, "the sidecar must outlive the trainer's container"

    # the kubelet's in-place restart: same pod, same env, same shared memory
    again = LocalPod(scenario.cluster, scenario.namespace, run.name).start()
    try:
        assert again.wait(120) == 0, again.log_text()[-3000:]
    finally:
        again.stop()
    res: dict[str, Any] = json.loads(result_path(scenario.results, run.pod).read_text())
    resumed = res["resume"]
    assert resumed["action"] == "resume_shm", (resumed, again.log_text()[-3000:])
    assert resumed["exact"] is True, resumed
    step = int(resumed["step"]) - 1
    # newer than storage's newest when the trainer died, at most one memory interval lost
    assert step > stored_at_kill.step, (resumed, stored_at_kill.id)
    assert step >= killed_after - MEMORY_EVERY, (resumed, killed_after)
    assert res["first_step"] == step + 1

    # the stitched run (both attempts' loss log) is the uninterrupted run, bit for bit
    lines = loss_log_path(scenario.results, run.pod).read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    assert {e["step"] for e in logged} == set(range(TRAINING.steps))
    for e in logged:
        assert e["loss"] == ref["losses"][str(e["step"])], f"step {e['step']}"
    assert res["final_params_sha256"] == ref["final_params_sha256"]

    # the pod ended: the sidecar was stopped with it and exited cleanly
    assert sidecar.wait(60) == 0, sidecar.log_text()[-3000:]
    assert sidecar.terminated_with_pod
    pod = scenario.cluster.get_json("pod", run.name, "-n", scenario.namespace)
    assert pod["status"]["phase"] == "Succeeded"
    [sc_status] = pod["status"]["initContainerStatuses"]
    assert sc_status["name"] == SIDECAR
    assert sc_status["state"]["terminated"]["exitCode"] == 0

    # storage: pulses from both attempts, all written by the sidecar (no local persister);
    # only durable tiers, never the memory snapshot the restart resumed from
    valid = view.valid(run_id)
    assert any(r.step < step for r in valid) and any(r.step > step for r in valid), valid
    stored = [r for r in view.checkpoints(run_id) if r.tier != Tier.HEARTBEAT]
    assert all(r.tier in (Tier.PULSE, Tier.FULL) for r in stored), stored
    assert step not in {r.step for r in stored}, (step, [r.id for r in stored])
    work = Path(again.env["CKPT_WORK_DIR"])
    assert not list(work.glob("sidecar.rank*.log")), "a trainer started its own persister"
