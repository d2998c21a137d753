"""An in-place container restart of a pinned job continues; it does not rewind (issue #11).

The operator restarts job ``J`` as ``J-r1`` with ``CKPT_RESUME_FROM=<A>`` in every pod of
``J-r1``. With ``restartPolicy: OnFailure`` a container of ``J-r1`` that dies (SIGKILL,
exit 137) is restarted in the same pod, with the same env. It must resume from the
newest valid checkpoint it wrote past ``A`` — the pin was applied once — and supersede
none of them; the stitched run still ends bit for bit like the uninterrupted one.

The checkpoints are on a PVC only the pods mount (``Scenario.pvc_storage``): the operator
cannot read them, so the in-place decision is the agent's alone, from the storage it
mounts; the test reads the claim's folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_e2e.localpod import LocalPod
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import (
    Training,
    final_loss,
    pytorchjob_manifest,
    reference_run,
    result_path,
)

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=80, seed=7, step_sleep=0.1)
KEEP = {"importantKeep": 30, "routineKeep": 30}  # the pin must outlive the first job


def _superseded(records: list[CheckpointRecord]) -> list[str]:
    return [
        r.id
        for r in records
        if r.status == CheckpointStatus.EXPIRED
        and r.extra.get("status_reason", "").startswith("superseded")
    ]


def test_in_place_restart_after_progress_resumes_past_the_pin(scenario: Scenario) -> None:
    ref = reference_run(TRAINING, scenario.cluster.workdir / "reference")
    assert not Path(scenario.pod_only_path).exists()  # the operator cannot open the claim
    scenario.apply_policy("e2e", storage=scenario.pvc_storage(), retention=KEEP)
    view = scenario.view()
    runner = scenario.runner()

    # J: runs to the end, leaving checkpoints of the whole run
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    assert first.wait(180) == 0, first.local.log_text()[-3000:] if first.local else ""
    run_id = scenario.run_id("train")
    pin = max((r for r in view.valid(run_id) if r.step <= 30), key=lambda r: r.step)

    # J-r1 as the operator makes it (same run, pinned), with restartPolicy OnFailure
    manifest = pytorchjob_manifest(
        "train-r1",
        TRAINING,
        scenario.results,
        policy="e2e",
        annotations={"ckpt.dev/run-id": run_id, "ckpt.dev/resume-from": pin.id},
    )
    manifest["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] = "OnFailure"
    scenario.cluster.apply(manifest, namespace=scenario.namespace)
    second = runner.wait_run("train-r1")
    env = {e["name"]: e.get("value") for e in second.pod["spec"]["containers"][0]["env"]}
    assert env["CKPT_RESUME_FROM"] == pin.id

    def progressed() -> CheckpointRecord | None:
        assert second.running, second.local and second.local.log_text()[-3000:]
        mine = [r for r in view.valid(run_id) if r.lineage.epoch >= 1]
        return mine[-1] if mine and mine[-1].step >= pin.step + 25 else None

    scenario.cluster.wait_for(progressed, timeout=120, what="checkpoints past the pin")
    assert second.local is not None
    second.local.kill()  # SIGKILL: exit 137, OnFailure restarts the container in place
    assert second.wait(30) == 137
    written = [r for r in view.valid(run_id) if r.lineage.epoch >= 1]
    newest = written[-1]
    assert newest.step >= pin.step + 25
    pod = scenario.cluster.get_json("pod", second.name, "-n", scenario.namespace)
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 1

    # the kubelet's in-place restart: same pod, same env (CKPT_RESUME_FROM still the pin)
    again = LocalPod(scenario.cluster, scenario.namespace, second.name).start()
    try:
        assert again.wait(180) == 0, again.log_text()[-3000:]
    finally:
        again.stop()
    res: dict[str, Any] = json.loads(result_path(scenario.results, second.pod).read_text())
    resumed = res["resume"]
    assert resumed["action"] == "resume", resumed
    assert resumed["checkpoint_id"] != pin.id
    step = int(resumed["step"]) - 1
    assert step >= newest.step, (resumed, newest.id)
    assert res["first_step"] == step + 1 and resumed["exact"] is True
    for s, loss in res["losses"].items():
        assert loss == ref["losses"][s], f"step {s}: {loss} != {ref['losses'][s]}"
    assert final_loss(res) == final_loss(ref)
    assert res["final_params_sha256"] == ref["final_params_sha256"]

    # nothing J-r1 wrote was superseded (retention may have released old ones, not more)
    after = {r.id: r for r in view.checkpoints(run_id)}
    for r in written:
        now = after.get(r.id)
        if now is not None and now.manifest_hash == r.manifest_hash:
            assert r.id not in _superseded([now]), now
