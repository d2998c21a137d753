"""Scenario 7: a node drain → emergency checkpoints before the pod ends → exact resume.

The job runs on its own kwok node. ``kubectl cordon`` makes the operator set the pod's
``ckpt.dev/save-now`` annotation; the harness refreshes the downward-API file like the
kubelet and the agent takes an emergency checkpoint while the pod keeps running.
``kubectl drain`` then evicts the pod: the container's main process gets SIGTERM and
the agent saves again before it exits (143), within the grace period. The job is
Failed (143 with ``restartPolicy: Never``), the operator restarts it from that last
emergency checkpoint, and after ``kubectl uncordon`` the restart's pod resumes from it
and ends exactly like an uninterrupted run.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from ckpt_agent.records import CheckpointRecord
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import (
    Training,
    events,
    final_loss,
    reference_run,
    result_path,
)

pytestmark = pytest.mark.e2e

#: Slow steps: the drain happens while the run is in the middle.
TRAINING = Training(steps=80, seed=7, step_sleep=0.25)


def test_drain_takes_emergency_checkpoints_before_the_pod_ends(scenario: Scenario) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    ref = reference_run(TRAINING, cluster.workdir / "reference")
    node = f"kwok-drain-{uuid.uuid4().hex[:5]}"
    cluster.create_node(node, labels={"e2e.ckpt.dev/pool": node})
    try:
        # scheduled pulses are rare here, so the emergency ones stand out
        scenario.apply_policy("e2e", pulse_every=50, full_every=1000)
        view = scenario.view()
        runner = scenario.runner()
        scenario.submit("train", TRAINING, node_selector={"e2e.ckpt.dev/pool": node})
        first = runner.wait_run("train")
        assert first.pod["spec"]["nodeName"] == node
        run_id = scenario.run_id("train")
        scenario.wait_step(first, 10)

        # 1. cordon: the operator signals the pod, the agent saves while still running
        t_cordon = time.time()
        cluster.kubectl("cordon", node)
        signalled = cluster.wait_for(
            lambda: events(cluster, ns, name=first.name, reason="SaveNowRequested"),
            timeout=30,
            what="SaveNowRequested on the pod",
        )
        assert "unschedulable" in signalled[0]["message"] or "cordon" in signalled[0]["message"]
        pod = cluster.get_json("pod", first.name, "-n", ns)
        assert pod["metadata"]["annotations"].get("ckpt.dev/save-now")

        def emergency(after: float, why: str) -> list[CheckpointRecord]:
            return [r for r in view.since(run_id, after) if r.emergency and why in r.reason.lower()]

        signal_saves = cluster.wait_for(
            lambda: emergency(t_cordon, "save-now"),
            timeout=30,
            what="an emergency checkpoint after the save-now signal",
        )
        assert first.running, "the signal-file save happens before the pod ends"
        assert isinstance(signal_saves, list)

        # 2. drain: eviction -> SIGTERM -> the agent saves once more, then exits 143
        t_drain = time.time()
        drain = cluster.drain(node)
        assert f"pod/{first.name} evicted" in drain.stdout, drain.stdout
        assert first.wait(60) == 143
        assert first.local is not None and first.local.terminated_by_deletion
        ended = time.time()
        sigterm_saves = emergency(t_drain, "sigterm")
        assert sigterm_saves, [(r.id, r.reason) for r in view.since(run_id, t_drain)]
        last = max(sigterm_saves, key=lambda r: r.step)
        assert last.created_at <= ended  # committed before the pod was gone
        assert last.tier.value == "full"
        log = first.local.log_text() if first.local else ""
        assert "Traceback" not in log, log[-3000:]

        # 3. exit 143 is a failure (restartPolicy Never): the job is Failed and the operator
        # restarts it from the SIGTERM checkpoint; its pod waits for a schedulable node.
        restart = scenario.wait_restart("train")
        name = restart["metadata"]["name"]
        assert restart["metadata"]["annotations"]["ckpt.dev/resume-from"] == last.id
        cluster.kubectl("uncordon", node)
        second = runner.wait_run(name, timeout=90)
        assert second.pod["spec"]["nodeName"] == node
        assert second.wait(180) == 0, second.local.log_text()[-3000:] if second.local else ""
        res = json.loads(result_path(scenario.results, second.pod).read_text())
        assert res["resume"]["checkpoint_id"] == last.id, res["resume"]
        assert res["first_step"] == last.step + 1
        assert final_loss(res) == final_loss(ref)
        assert res["final_params_sha256"] == ref["final_params_sha256"]
    finally:
        cluster.kubectl("delete", "node", node, "--ignore-not-found", check=False)
