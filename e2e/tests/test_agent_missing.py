"""Scenario ``agent-missing``: training code that never starts the agent (issue #11 item 5).

The job is opted in and its pod injected, but the script runs with
``--no-checkpoint``: no heartbeat, no checkpoint, no report. After the policy's
``spec.agent.reportDeadlineSeconds`` the operator posts a Warning Event on the job
and sets the policy condition ``AgentReporting=False``; when the pod fails, the
restart's Event says it is fresh and the operator warns again.

The first test keeps the checkpoints on a volume the operator reads too
(``Scenario.local_storage``): there it sees, while the pod runs, that no heartbeat came.
The others run blind (``Scenario.pvc_storage``, a PVC only the pods mount). The second:
the agent reports in at ``start()`` in its termination message, so a failed pod with no
report is the signal — the restart is fresh and says so, with the AgentMissing Warning.
The third restarts the container in place (``restartPolicy: OnFailure``) on a pod the
operator cannot reach (kwok's pod IPs route nowhere here, as under a NetworkPolicy): the
probe of the agent's port gives no verdict, the pod's ``lastState`` holding no report
does. The fourth is the live signal: pods on a node whose pod IPs are loopback addresses
(each local pod listens on its own, as on its own network namespace), one job with the
agent and one without; past the deadline the operator probes both pods' agent metrics
port and flags the running pod whose port refused every probe for one more deadline,
never the one whose agent answered (on a loaded machine its process may open the port
late: a first refusal is only a suspicion, docs/operator.md).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_e2e.localpod import LocalPod
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import Training, events, pytorchjob_manifest

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=400, seed=3, step_sleep=0.1, checkpoint=False)
MISSING = "training code does not use the ckpt agent"


def _apply_policy(scenario: Scenario, blind: bool, deadline_s: int = 5) -> None:
    """A 5 s report deadline (``deadline_s``); ``blind``: on a PVC the operator cannot read."""
    storage = scenario.pvc_storage() if blind else scenario.local_storage()
    scenario.apply_policy(
        "e2e",
        storage=storage,
        recovery={"maxRestarts": 1, "backoffSeconds": 0},
        extra={"agent": {"reportDeadlineSeconds": deadline_s}},
    )


def _missing_events(scenario: Scenario) -> list[dict[str, Any]]:
    return events(scenario.cluster, scenario.namespace, name="train", reason="AgentMissing")


def test_agent_missing_is_reported(scenario: Scenario) -> None:
    _apply_policy(scenario, blind=False)
    runner = scenario.runner()
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    scenario.run_id("train")

    warned = scenario.cluster.wait_for(
        lambda: _missing_events(scenario), timeout=90, what="the AgentMissing Event"
    )
    assert warned[0]["type"] == "Warning" and MISSING in warned[0]["message"]
    path = f"/apis/ckpt.dev/v1alpha1/namespaces/{scenario.namespace}/checkpointpolicies/e2e"
    policy = scenario.cluster.request("GET", path)
    cond = next(c for c in policy["status"]["conditions"] if c["type"] == "AgentReporting")
    assert (cond["status"], cond["reason"]) == ("False", "AgentMissing")
    assert MISSING in cond["message"]

    assert first.local is not None
    first.local.kill()
    assert first.wait(30) == 137
    restart = scenario.wait_restart("train")
    restarted = events(
        scenario.cluster, scenario.namespace, name="train", reason="Restarted", wait=30
    )
    assert "fresh" in restarted[0]["message"], restarted
    assert restart["metadata"]["name"] == "train-r1"
    assert "ckpt.dev/resume-from" not in (restart["metadata"].get("annotations") or {})


def test_agent_missing_is_reported_by_the_pods_when_blind(scenario: Scenario) -> None:
    assert not Path(scenario.pod_only_path).exists()
    _apply_policy(scenario, blind=True)
    runner = scenario.runner()
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    scenario.run_id("train")
    assert first.local is not None
    time.sleep(6)  # past the report deadline: an agent would have reported in by now
    assert first.running, first.local.log_text()[-3000:]
    first.local.kill()
    assert first.wait(30) == 137
    pod = scenario.cluster.get_json("pod", first.name, "-n", scenario.namespace)
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert not terminated.get("message"), terminated  # no agent: no report

    restart = scenario.wait_restart("train")
    assert restart["metadata"]["name"] == "train-r1"
    assert "ckpt.dev/resume-from" not in (restart["metadata"].get("annotations") or {})
    restarted = events(
        scenario.cluster, scenario.namespace, name="train", reason="Restarted", wait=30
    )
    assert "fresh" in restarted[0]["message"], restarted
    warned = _missing_events(scenario)
    assert warned and warned[0]["type"] == "Warning", warned
    assert "reported in" in warned[0]["message"] and MISSING in warned[0]["message"]
    assert not Path(scenario.pod_only_path).exists()


def test_agent_missing_in_a_running_pod_when_blind(scenario: Scenario) -> None:
    _apply_policy(scenario, blind=True)
    runner = scenario.runner()
    manifest = pytorchjob_manifest("train", TRAINING, scenario.results, policy="e2e")
    manifest["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] = "OnFailure"
    scenario.cluster.apply(manifest, namespace=scenario.namespace)
    first = runner.wait_run("train")
    time.sleep(6)  # past the deadline, but a running container's message is not visible
    assert not _missing_events(scenario)
    assert first.local is not None
    first.local.kill()  # SIGKILL: exit 137, OnFailure restarts the container in place
    assert first.wait(30) == 137
    pod = scenario.cluster.get_json("pod", first.name, "-n", scenario.namespace)
    assert pod["status"]["phase"] == "Running"
    status = pod["status"]["containerStatuses"][0]
    assert status["restartCount"] == 1 and not status["lastState"]["terminated"].get("message")

    again = LocalPod(scenario.cluster, scenario.namespace, first.name).start()
    try:
        warned = scenario.cluster.wait_for(
            lambda: _missing_events(scenario), timeout=90, what="the AgentMissing Event"
        )
        assert warned[0]["type"] == "Warning" and MISSING in warned[0]["message"]
        assert first.name in warned[0]["message"], warned
        path = f"/apis/ckpt.dev/v1alpha1/namespaces/{scenario.namespace}/checkpointpolicies/e2e"

        def condition() -> dict[str, str] | None:
            policy = scenario.cluster.request("GET", path)
            conds = (policy.get("status") or {}).get("conditions") or []
            cond = next((c for c in conds if c["type"] == "AgentReporting"), None)
            return cond if cond and cond["status"] == "False" else None

        # a pass before the container's restart wrote True: wait for the one that flagged it
        cond = scenario.cluster.wait_for(condition, timeout=60, what="AgentReporting=False")
        assert isinstance(cond, dict)
        assert (cond["status"], cond["reason"]) == ("False", "AgentMissing")
        assert scenario.job("train-r1") is None  # the job has not failed: no restart
    finally:
        again.stop()
    assert not Path(scenario.pod_only_path).exists()


LOOPBACK_NODE = "kwok-loopback-0"
LOOPBACK_TAINT = {"key": "ckpt-e2e/loopback", "value": "true", "effect": "NoSchedule"}


def _on_loopback_node(manifest: dict[str, Any]) -> dict[str, Any]:
    """Pin the job's pods to the node whose pod IPs are reachable here."""
    spec = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    spec["nodeSelector"] = {"kubernetes.io/hostname": LOOPBACK_NODE}
    spec["tolerations"] = [{**LOOPBACK_TAINT, "operator": "Equal"}]
    return manifest


def test_agent_missing_in_a_running_pod_is_probed_when_blind(scenario: Scenario) -> None:
    if LOOPBACK_NODE not in scenario.cluster.plane.node_names:
        scenario.cluster.create_node(
            LOOPBACK_NODE, pod_cidr="127.77.0.0/24", taints=[LOOPBACK_TAINT]
        )
    # The pod with the agent must open its port within the deadline (it refuses until its
    # Python has imported torch and called start()): 10 s, which a loaded 2-core machine's
    # start fits, and the operator's proof takes one more deadline; still well within 60 s.
    _apply_policy(scenario, blind=True, deadline_s=10)
    runner = scenario.runner()
    with_agent = Training(steps=400, seed=3, step_sleep=0.1)
    for name, training in (("train", TRAINING), ("good", with_agent)):
        manifest = pytorchjob_manifest(name, training, scenario.results, policy="e2e")
        scenario.cluster.apply(_on_loopback_node(manifest), namespace=scenario.namespace)
    first, good = runner.wait_run("train"), runner.wait_run("good")
    for run in (first, good):
        pod = scenario.cluster.get_json("pod", run.name, "-n", scenario.namespace)
        assert pod["status"]["podIP"].startswith("127.77.0."), pod["status"]
    t0 = time.monotonic()
    warned = scenario.cluster.wait_for(
        lambda: _missing_events(scenario), timeout=90, what="the AgentMissing Event"
    )
    assert time.monotonic() - t0 < 60, "flagged, but not within the bounded time"
    assert first.running and good.running  # nothing ended: the probe alone is the signal
    assert len(warned) == 1 and warned[0]["type"] == "Warning", warned
    assert first.name in warned[0]["message"] and MISSING in warned[0]["message"]
    assert "refused the connection" in warned[0]["message"], warned
    path = f"/apis/ckpt.dev/v1alpha1/namespaces/{scenario.namespace}/checkpointpolicies/e2e"
    policy = scenario.cluster.request("GET", path)
    cond = next(c for c in policy["status"]["conditions"] if c["type"] == "AgentReporting")
    assert (cond["status"], cond["reason"]) == ("False", "AgentMissing")
    assert first.name in cond["message"] and good.name not in cond["message"], cond
    good_events = events(scenario.cluster, scenario.namespace, name="good", reason="AgentMissing")
    assert not good_events, good_events
    assert scenario.job("train-r1") is None  # the job has not failed: no restart
    assert not Path(scenario.pod_only_path).exists()
