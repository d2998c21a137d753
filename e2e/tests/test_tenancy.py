"""Tenancy (issues #17, #28): two namespaces, one storage root; a job in namespace B
annotated with namespace A's run id is refused — no restart from A's checkpoints, A's
checkpoints untouched, a Warning Event — and B's policy's retention never deletes from
A's run.

Both policies name the same folder (A's PVC folder, which the operator may read: the
e2e chart values grant every namespace the cluster's PVC root), so only the run's owner
record (``<run>/OWNER.json``, claimed for A by A's trainer when it created the run; the
operator never writes one) keeps them apart. Without that record (a legacy run) nobody
uses the run — B's job is not restarted from it, B's retention deletes nothing, no
record is written — until an administrator runs ``ckpt claim``.
"""

from __future__ import annotations

import json
import subprocess
import sys
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
    # namespace A: a real run with real checkpoints, claimed for A by its trainer
    scenario.apply_policy("e2e")
    view = scenario.view()
    runner = scenario.runner()
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    run_id = scenario.run_id("train")
    assert first.wait(180) == 0, first.local.log_text()[-3000:] if first.local else ""
    owner_file = scenario.store / run_id / "OWNER.json"
    cluster.wait_for(owner_file.exists, timeout=60, what=f"A's trainer claiming {run_id}")
    record = json.loads(owner_file.read_text())
    assert (record["namespace"], record["claimedBy"]) == (scenario.namespace, "agent")
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

        # the same run as a legacy run (its record removed, as before owner records
        # existed): B's job naming it is not restarted from it, nothing is claimed
        owner_file.unlink()
        legacy_before = _tree(scenario.store / run_id)
        thief.submit("legacy", TRAINING, annotations={"ckpt.dev/run-id": run_id})
        status = thief.wait_operator_state("legacy", "GaveUp", timeout=120)
        assert status["reason"] == "LegacyRunUnclaimed", status
        assert "ckpt claim" in status["message"]
        assert thief.job("legacy-r1") is None
        cluster.wait_for(
            lambda: events(cluster, ns_b, kind="CheckpointPolicy", reason="LegacyRunUnclaimed"),
            timeout=60,
            what="B's retention reporting the unclaimed legacy run",
        )
        assert _tree(scenario.store / run_id) == legacy_before  # no delete, no OWNER.json
        # the administrator gives it back to A
        claimed = subprocess.run(
            [
                sys.executable,
                "-m",
                "ckpt_agent.cli",
                "claim",
                "--storage",
                str(scenario.store),
                "--run-id",
                run_id,
                "--namespace",
                scenario.namespace,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert claimed.returncode == 0, claimed.stdout + claimed.stderr
        record = json.loads(owner_file.read_text())
        assert record["namespace"] == scenario.namespace
        assert record["claimedBy"].startswith("admin")
        assert [r.id for r in view.valid(run_id)] == valid
    finally:
        thief.close()
        cluster.delete_namespace(ns_b, wait=False)
