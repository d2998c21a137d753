"""Scenario 9: the operator is SIGKILLed in the middle of a restart.

Two jobs fail at once. An admission gate (a validating webhook served by the test) holds
the operator's CREATEs of their restarts on the wire: the decision is written on the
failed jobs (``ckpt.dev/restarted-as``, ``ckpt.dev/restart-decision``) and the create
is in flight. The operator is frozen (SIGSTOP, its connections stay open) while one
create is denied (as if it had never been made) and the other allowed (the API server
stores the restart and answers into the frozen operator's socket), then SIGKILLed: it
never learns either outcome. The restarted operator must end with exactly one restart
per job: the first by replaying the written decision, the second through the 409 on
the deterministic name.

(Killing the operator while a create is merely held does not work as a test: the API
server cancels a request whose client went away, webhook call included.)
"""

from __future__ import annotations

import json
import time

import pytest

from ckpt_e2e.admission import AdmissionGate
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import (
    Training,
    annotations_of,
    events,
    list_jobs,
    operator_status,
)

pytestmark = pytest.mark.e2e


def test_operator_killed_during_a_restart_makes_exactly_one_new_job(scenario: Scenario) -> None:
    cluster, ns, op = scenario.cluster, scenario.namespace, scenario.operator
    scenario.apply_policy("e2e", recovery={"backoffSeconds": 0})
    # nothing trains here: the pods are ended by hand with exit code 137
    runner = scenario.runner(decide=lambda pod: "ignore")
    for name in ("alpha", "beta"):
        scenario.submit(name, Training(steps=5))
    pods = {name: runner.wait_run(name).name for name in ("alpha", "beta")}

    with AdmissionGate(cluster, ns) as gate:
        gate.hold(r".*-r\d+")
        for pod in pods.values():
            cluster.set_pod_exit(ns, pod, 137)
        for name in ("alpha", "beta"):
            gate.wait_held(f"{name}-r1")
            # intent first: the decision is on the failed job before the create
            ann = annotations_of(scenario.job(name))
            assert ann["ckpt.dev/restarted-as"] == f"{name}-r1"
            assert json.loads(ann["ckpt.dev/restart-decision"])["name"] == f"{name}-r1"
            assert operator_status(scenario.job(name))["state"] == "Restarting"

        op.freeze()
        gate.stop_holding()
        gate.release("alpha-r1", allow=False, message="the request never made it")
        gate.release("beta-r1", allow=True)
        cluster.wait_for(lambda: scenario.job("beta-r1"), timeout=30, what="beta-r1 created")
        op.kill()
        assert not op.running
        assert scenario.job("alpha-r1") is None
        for name in ("alpha", "beta"):  # it never got to record the outcome
            assert operator_status(scenario.job(name))["state"] == "Restarting"
        # the operator is down: nothing moves
        time.sleep(2)
        assert scenario.job("alpha-r1") is None

        op.start()
        for name in ("alpha", "beta"):
            cluster.wait_for(
                lambda name=name: operator_status(scenario.job(name)).get("state") == "Restarted",
                timeout=60,
                what=f"{name} Restarted after the operator came back",
            )

    # exactly one restart per job, each a restart of its own job, nothing else
    time.sleep(3)  # give a duplicate the chance to show up
    names = sorted(j["metadata"]["name"] for j in list_jobs(cluster, ns))
    assert names == ["alpha", "alpha-r1", "beta", "beta-r1"], names
    for name in ("alpha", "beta"):
        restart = scenario.job(f"{name}-r1")
        assert annotations_of(restart)["ckpt.dev/restart-of"] == name
        assert annotations_of(restart)["ckpt.dev/restart-count"] == "1"
        restarted = events(cluster, ns, name=name, reason="Restarted")
        assert len(restarted) == 1, restarted
        assert events(cluster, ns, name=name, reason="GaveUp") == []
    assert "already exists (409): done" in op.log_since(0)
