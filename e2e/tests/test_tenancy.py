"""Tenancy (issue #17): two namespaces, one storage root; a job in namespace B annotated
with namespace A's run id is refused — no restart from A's checkpoints, A's checkpoints
untouched, a Warning Event — and B's policy's retention never deletes from A's run.

Both policies name the same folder (A's PVC folder, which the operator may read: the
e2e chart values grant every namespace the cluster's PVC root), so only the run's owner
record (``<run>/OWNER.json``, claimed for A when the operator first sees A's job use the
run) keeps them apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_e2e.cluster import LocalCluster
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.stack import OperatorProcess
from ckpt_e2e.training import Training, annotations_of, events

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=40, seed=11, step_sleep=0.05)


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_a_job_in_another_namespace_cannot_use_a_run_it_does_not_own(
    scenario: Scenario, cluster: LocalCluster, operator: OperatorProcess
) -> None:
    # namespace A: a real run with real checkpoints, claimed for A by the operator
    scenario.apply_policy("e2e")
    view = scenario.view()
    runner = scenario.runner()
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    run_id = scenario.run_id("train")
    assert first.wait(180) == 0, first.local.log_text()[-3000:] if first.local else ""
    owner_file = scenario.store / run_id / "OWNER.json"
    cluster.wait_for(owner_file.exists, timeout=60, what=f"the operator claiming {run_id} for A")
    assert json.loads(owner_file.read_text())["namespace"] == scenario.namespace
    valid = [r.id for r in view.valid(run_id)]
    assert len(valid) >= 2
    before = _tree(scenario.store / run_id)

    # namespace B: the same storage root, aggressive retention, a job carrying A's run id
    ns_b = cluster.create_namespace(f"{scenario.namespace}-b"[:63])
    thief = Scenario(cluster, ns_b, operator)
    try:
        thief.apply_policy(
            "e2e",
            storage=scenario.local_storage(),
            retention={"importantKeep": 1, "routineKeep": 1, "reconcileIntervalSeconds": 10},
        )
        # its pod dies at once (it never gets to read the storage itself): the operator
        # is the only one who could hand A's checkpoints to B
        thief.runner(decide=lambda pod: "crash")
        thief.submit("steal", TRAINING, annotations={"ckpt.dev/run-id": run_id})

        status = thief.wait_operator_state("steal", "GaveUp", timeout=120)
        assert status["reason"] == "RunOwnedElsewhere", status
        assert f"belongs to namespace {scenario.namespace}" in status["message"]
        gave_up = events(cluster, ns_b, name="steal", reason="GaveUp", wait=30)
        assert gave_up and gave_up[-1]["type"] == "Warning", gave_up
        assert "RunOwnedElsewhere" in gave_up[-1]["message"]
        assert thief.job("steal-r1") is None  # no restart, from A's checkpoint or any
        assert annotations_of(thief.job("steal")).get("ckpt.dev/restarted-as") is None

        # B's retention looked at the run, refused it, said so
        refused = cluster.wait_for(
            lambda: events(cluster, ns_b, kind="CheckpointPolicy", reason="RunOwnedElsewhere"),
            timeout=60,
            what="B's retention refusing A's run",
        )
        assert refused[-1]["type"] == "Warning"
        # ... and A's checkpoints and owner record are exactly as they were
        assert [r.id for r in view.valid(run_id)] == valid
        assert _tree(scenario.store / run_id) == before
        assert json.loads(owner_file.read_text())["namespace"] == scenario.namespace
    finally:
        thief.close()
        cluster.delete_namespace(ns_b, wait=False)
