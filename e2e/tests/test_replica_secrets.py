"""The operator issues each replicating job's Secret (``rbac.issueReplicaSecrets``, #31).

The chart is upgraded with ``rbac.issueReplicaSecrets: true`` and the operator restarted
from it (as its ServiceAccount): RBAC grants it ``create`` on Secrets, and the chart's
ValidatingAdmissionPolicy, evaluated by the real API server, bounds that to the replica
Secrets it issues. A PyTorchJob of two pods under a policy with
``spec.agent.replicas.enabled``: the webhook creates ``ckpt-replica-<job>`` (a random
key, owned by the job) before the first pod is stored, and both pods mount it. The chart
and the operator are put back afterwards.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import pytest

from ckpt_e2e.api import free_port
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.stack import Stack
from ckpt_e2e.training import Training, events, pytorchjob_manifest

pytestmark = pytest.mark.e2e

HEX64 = re.compile(r"[0-9a-f]{64}")


def _secret(name: str, *, type_: str = "Opaque", labelled: bool = True) -> str:
    meta: dict[str, Any] = {"name": name}
    if labelled:
        meta["labels"] = {"ckpt.dev/replica-secret": "issued"}
    if type_ == "kubernetes.io/service-account-token":
        meta["annotations"] = {"kubernetes.io/service-account.name": "default"}
    return json.dumps(
        {"apiVersion": "v1", "kind": "Secret", "type": type_, "metadata": meta, "data": {}}
    )


def test_the_operator_issues_the_replica_secret_and_may_create_no_other(
    stack: Stack, scenario: Scenario
) -> None:
    cluster, ns, sa = scenario.cluster, scenario.namespace, stack.install.sa_user
    with stack.upgraded(
        {"rbac": {"issueReplicaSecrets": True}}, expect_arg="--issue-replica-secrets=true"
    ):
        # the admission policy: as the operator's account, only its own kind of Secret
        def create_as_operator(body: str) -> Any:
            return cluster.kubectl(
                "create", "-n", ns, "-f", "-", f"--as={sa}", input=body, check=False
            )

        refused = {
            "ckpt-replica-typed": (
                _secret("ckpt-replica-typed", type_="kubernetes.io/service-account-token"),
                "may create only Opaque Secrets",
            ),
            "other-name": (_secret("other-name"), "named ckpt-replica-<job>"),
            "ckpt-replica-unlabelled": (
                _secret("ckpt-replica-unlabelled", labelled=False),
                "carry the label ckpt.dev/replica-secret: issued",
            ),
        }

        def policy_enforced() -> bool:  # the policy takes effect asynchronously
            res = create_as_operator(refused["other-name"][0])
            if res.returncode == 0:
                cluster.kubectl("delete", "secret", "other-name", "-n", ns, check=False)
                return False
            return "ValidatingAdmissionPolicy" in res.stderr

        cluster.wait_for(policy_enforced, timeout=60, what="the replica-secrets policy enforced")
        for name, (body, message) in refused.items():
            res = create_as_operator(body)
            assert res.returncode != 0 and message in res.stderr, (name, res.stderr)
        assert create_as_operator(_secret("ckpt-replica-by-hand")).returncode == 0

        # a replicating job: its Secret is issued when its first pod is admitted
        scenario.apply_policy(
            "e2e",
            extra={
                "agent": {
                    "metricsPort": free_port(),
                    "sidecar": True,
                    "replicas": {"enabled": True, "peers": 1},
                }
            },
        )
        manifest = pytorchjob_manifest("bert", Training(steps=5), scenario.results, policy="e2e")
        specs = manifest["spec"]["pytorchReplicaSpecs"]
        specs["Worker"] = copy.deepcopy(specs["Master"])
        cluster.apply(manifest, namespace=ns)

        def both_pods() -> list[dict[str, Any]] | None:
            selector = "training.kubeflow.org/job-name=bert"
            got: list[dict[str, Any]] = cluster.get_json("pods", "-n", ns, "-l", selector)["items"]
            return got if len(got) == 2 else None

        pods = cluster.wait_for(both_pods, timeout=60, what="both pods of the job created")
        job = cluster.get_json("pytorchjob", "bert", "-n", ns)
        secret = cluster.get_json("secret", "ckpt-replica-bert", "-n", ns)
        assert secret["type"] == "Opaque"
        assert secret["metadata"]["labels"]["ckpt.dev/replica-secret"] == "issued"
        (owner,) = secret["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == (
            "PyTorchJob",
            "bert",
            job["metadata"]["uid"],
        )
        assert HEX64.fullmatch(base64.b64decode(secret["data"]["secret"]).decode())
        for pod in pods:
            (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "ckpt-replica"]
            assert volume["secret"]["secretName"] == "ckpt-replica-bert"
            created = pod["metadata"]["creationTimestamp"]
            assert secret["metadata"]["creationTimestamp"] <= created
        issued = events(cluster, ns, name="bert", reason="ReplicaSecretIssued")
        assert len(issued) == 1, issued
