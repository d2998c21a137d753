"""Issue #19: the pod webhook fails closed for opted-in pods, and only for them.

An opted-in PyTorchJob's pod templates get ``ckpt.dev/inject=true`` (the ``label-job``
webhook), so every pod the training-operator creates for it carries the label and calls
the pod webhook (``objectSelector``, ``failurePolicy: Fail``). With the operator stopped,
such a pod is refused with an admission error naming the webhook — never admitted without
the agent — and the training-operator's retry creates it injected once the operator is
back. A pod without the label in the same namespace never calls the webhook: it is
admitted while the operator is down.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from ckpt_e2e.errors import ApiError
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import Training, pytorchjob_manifest

pytestmark = pytest.mark.e2e

INJECT = "ckpt.dev/inject"
INJECTED = "ckpt.dev/injected"
JOB_LABEL = "training.kubeflow.org/job-name"


def _pods(scenario: Scenario, job: str) -> list[dict[str, Any]]:
    path = f"/api/v1/namespaces/{scenario.namespace}/pods?labelSelector={JOB_LABEL}%3D{job}"
    items: list[dict[str, Any]] = scenario.cluster.request("GET", path).get("items") or []
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def _plain_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }


def test_opted_in_pods_wait_for_the_operator_and_others_never_call_it(
    scenario: Scenario,
) -> None:
    cluster, ns, op = scenario.cluster, scenario.namespace, scenario.operator
    scenario.apply_policy("e2e")
    scenario.runner(decide=lambda pod: "ignore")  # nothing trains: admission is the point
    manifest = pytorchjob_manifest("alpha", Training(steps=5), scenario.results, policy="e2e")
    manifest["spec"]["runPolicy"] = {"suspend": True}  # its pod is created later, on resume
    cluster.apply(manifest, namespace=ns)
    job = scenario.job("alpha")
    assert job is not None
    # the label-job webhook labelled the templates at creation
    for rspec in job["spec"]["pytorchReplicaSpecs"].values():
        assert rspec["template"]["metadata"]["labels"][INJECT] == "true"

    op.stop()
    assert not op.running
    pods = f"/api/v1/namespaces/{ns}/pods"
    # the training-operator creates the pod now: refused while the operator is down
    cluster.request(
        "PATCH",
        f"/apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/alpha",
        {"spec": {"runPolicy": {"suspend": False}}},
    )
    # an opted-in pod gets an admission error naming the webhook, not a silent admission
    with pytest.raises(ApiError) as refused:
        cluster.request("POST", pods, _plain_pod("opted-in", {INJECT: "true"}))
    assert refused.value.status >= 400, refused.value
    message = json.loads(refused.value.body)["message"]
    assert 'failed calling webhook "inject.pods.ckpt.dev"' in message, message
    # an unrelated pod in the same namespace never calls the webhook
    t0 = time.monotonic()
    created = cluster.request("POST", pods, _plain_pod("unrelated", {"app": "web"}))
    assert time.monotonic() - t0 < 3.0
    assert INJECTED not in (created["metadata"].get("labels") or {})
    time.sleep(5)  # the training-operator keeps trying meanwhile
    assert _pods(scenario, "alpha") == []
    assert "FailedCreate" in cluster.kubectl("get", "events", "-n", ns).stdout

    op.start()
    (again,) = cluster.wait_for(
        lambda: _pods(scenario, "alpha"),
        timeout=120,
        what="the training-operator's retry admitted once the operator is back",
    )
    labels = again["metadata"]["labels"]
    assert labels[INJECT] == "true" and labels[INJECTED] == "true"
    assert again["metadata"]["annotations"]["ckpt.dev/run-id"]
    names = {c["name"] for c in again["spec"]["containers"]}
    volumes = {v["name"] for v in again["spec"].get("volumes") or ()}
    assert "pytorch" in names and "ckpt-config" in volumes
