"""Scenarios 1–3: policies through the API server, the chart and its RBAC, injection.

The chart is installed once per session with the real ``helm`` (fixture ``stack``); the
operator runs as a local process in its Deployment's place, authenticated as the
chart's ServiceAccount (``ckpt_e2e.stack``).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml

from ckpt_e2e import LocalCluster
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.stack import CHART_DIR, RBAC_DENIED, OperatorProcess, Stack, can_i, rules_of
from ckpt_e2e.tools import REPO_ROOT
from ckpt_e2e.training import Training, annotations_of, events

pytestmark = pytest.mark.e2e


# --------------------------------------------------------------------------- scenario 1
def _policy(name: str, spec: dict[str, Any]) -> str:
    return json.dumps(
        {
            "apiVersion": "ckpt.dev/v1alpha1",
            "kind": "CheckpointPolicy",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


INVALID = [
    pytest.param(
        {"tiers": {"pulse": {"minInterval": -5}}},
        ["spec.tiers.pulse.minInterval", "greater than or equal to 1"],
        id="negative-interval",
    ),
    pytest.param(
        {"tiers": {"pulse": {"baseInterval": 50, "minInterval": 60, "maxInterval": 40}}},
        ["spec.tiers.pulse.minInterval", "pulse.minInterval must be <= pulse.maxInterval"],
        id="min-above-max",
    ),
    pytest.param(
        {"scheduler": {"loss": {"weight": 1.5}}},
        ["spec.scheduler.loss.weight", "less than or equal to 1"],
        id="weight-above-1",
    ),
    pytest.param(
        {"tiers": {"superfast": {"everySteps": 1}}},
        ['unknown field "spec.tiers.superfast"'],
        id="unknown-tier",
    ),
    pytest.param(
        {"retention": {"routineKeep": 0}},
        ["spec.retention.routineKeep", "greater than or equal to 1"],
        id="keep-below-1",
    ),
    pytest.param(
        {"retention": {"importantScore": 0.9, "criticalScore": 0.5}},
        ["spec.retention.importantScore", "importantScore must be <= criticalScore"],
        id="important-above-critical",
    ),
    pytest.param(
        {"storage": {"type": "s3"}},
        ["spec.storage.s3", "s3 is required when type is s3"],
        id="s3-without-bucket",
    ),
    pytest.param(
        {"agent": {"jitSave": True}},
        ["spec.agent.jitSave", "jitSave needs sidecar: true"],
        id="jit-without-sidecar",
    ),
    pytest.param(
        {"tiers": {"memory": {"enabled": True}}},
        ["spec.tiers.memory.enabled", "tiers.memory.enabled needs agent.sidecar: true"],
        id="memory-tier-without-sidecar",
    ),
    pytest.param(
        {"tiers": {"memory": {"minInterval": 8, "maxInterval": 4}}},
        ["spec.tiers.memory.minInterval", "memory.minInterval must be <= memory.maxInterval"],
        id="memory-tier-bounds",
    ),
]


@pytest.mark.parametrize(("spec", "expected"), INVALID)
def test_invalid_policy_is_rejected_naming_the_field(
    cluster: LocalCluster,
    namespace: str,
    operator: OperatorProcess,
    spec: dict[str, Any],
    expected: list[str],
) -> None:
    res = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=_policy("bad", spec), check=False
    )
    assert res.returncode != 0, res.stdout
    for text in expected:
        assert text in res.stderr, res.stderr
    gone = cluster.kubectl("get", "checkpointpolicy", "bad", "-n", namespace, check=False)
    assert gone.returncode != 0  # nothing was stored


def test_valid_policy_is_accepted_and_gets_a_status(scenario: Scenario) -> None:
    cluster, ns, op = scenario.cluster, scenario.namespace, scenario.operator
    validated = op.metric("ckpt_operator_webhook_requests_total", {"webhook": "validate-policy"})
    example = yaml.safe_load((REPO_ROOT / "examples" / "policy.yaml").read_text())
    example["spec"]["storage"] = scenario.local_storage()
    out = cluster.apply(example, namespace=ns)
    assert "checkpointpolicy.ckpt.dev/default created" in out

    policy = scenario.wait_policy_ready("default")
    status = policy["status"]
    assert status["observedGeneration"] == policy["metadata"]["generation"] == 1
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["reason"] == "Validated"
    # the API server filled in every default of the model (nested objects included)
    spec = policy["spec"]
    assert spec["scheduler"]["loss"]["weight"] == 0.4
    assert spec["compression"]["codec"] == "zstd"
    assert spec["tiers"]["pulse"]["baseInterval"] == 100
    # the agent config the webhook mounts into pods is published, owned by the policy
    cm = cluster.get_json("configmap", "ckpt-default", "-n", ns)
    config = json.loads(cm["data"]["config.json"])
    assert config["storageUrl"] == f"file://{scenario.store}"
    assert config["tiers"]["full"]["everySteps"] == 1000
    (owner,) = cm["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("CheckpointPolicy", "default")
    # the retention loop has looked at it too
    cluster.wait_for(
        lambda: any(
            c["type"] == "Reconciled"
            for c in cluster.get_json("checkpointpolicy", "default", "-n", ns)["status"].get(
                "conditions", []
            )
        ),
        timeout=30,
        what="Reconciled condition",
    )
    # the validating webhook was consulted on the way in
    after = op.metric("ckpt_operator_webhook_requests_total", {"webhook": "validate-policy"})
    assert after > validated

    # a change is validated and reconciled again (observedGeneration follows)
    example["spec"]["tiers"]["full"]["everySteps"] = 500
    cluster.apply(example, namespace=ns)
    policy = scenario.wait_policy_ready("default")
    assert policy["status"]["observedGeneration"] == 2

    def full_every() -> int:
        cm = cluster.get_json("configmap", "ckpt-default", "-n", ns)
        return int(json.loads(cm["data"]["config.json"])["tiers"]["full"]["everySteps"])

    cluster.wait_for(lambda: full_every() == 500, timeout=30, what="ConfigMap updated")


# --------------------------------------------------------------------------- scenario 2
#: What the operator needs (docs/operator.md, "RBAC"): exactly these, nothing else.
EXPECTED_RULES = {
    "pytorchjobs.kubeflow.org": {"get", "list", "watch", "create", "patch"},
    # Kubeflow Trainer v2 (issue #15): TrainJobs as PyTorchJobs (patch also suspends one the
    # operator gave up on), the runtime a TrainJob names (label-trainjob webhook), JobSets'
    # restart attempts (watched, and read when a TrainJob pod failed)
    "trainjobs.trainer.kubeflow.org": {"get", "list", "watch", "create", "patch"},
    "clustertrainingruntimes.trainer.kubeflow.org": {"get"},
    "trainingruntimes.trainer.kubeflow.org": {"get"},
    "jobsets.jobset.x-k8s.io": {"get", "list", "watch"},
    "checkpointpolicies.ckpt.dev": {"get", "list", "watch", "patch"},
    "checkpointpolicies.ckpt.dev/status": {"get", "patch"},
    "pods": {"get", "list", "watch", "patch"},
    "nodes": {"get", "list", "watch"},
    "configmaps": {"get", "create", "patch"},
    "events": {"create"},
    "customresourcedefinitions.apiextensions.k8s.io": {"list", "watch"},
    "secrets": {"get"},  # rbac.readStorageSecrets (default): S3 credentials of policies
}


def may(cluster: LocalCluster, user: str, verb: str, group: str, resource: str) -> bool:
    """What ``kubectl auth can-i`` asks, as a SubjectAccessReview (no discovery needed)."""
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "resourceAttributes": {"verb": verb, "group": group, "resource": resource},
        },
    }
    out = cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(review)).stdout
    return bool(json.loads(out)["status"].get("allowed"))


def test_helm_install_creates_crd_rbac_webhooks_and_a_valid_deployment(
    stack: Stack, operator: OperatorProcess
) -> None:
    cluster, inst = stack.cluster, stack.install
    status = json.loads(
        cluster.helm("status", inst.release, "-n", inst.namespace, "-o", "json").stdout
    )
    assert status["info"]["status"] == "deployed"

    crd = cluster.get_json("crd", "checkpointpolicies.ckpt.dev")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert crd["spec"]["names"]["shortNames"] == ["ckptpol"]

    # The Deployment was validated and stored by the API server and rolled out (on kwok).
    dep = cluster.get_json("deployment", inst.fullname, "-n", inst.namespace)
    assert dep["status"].get("availableReplicas") == 1
    pod_spec = dep["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == inst.service_account
    (container,) = pod_spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert f"--webhook-port={inst.webhook_port}" in container["args"]
    # ... and the local operator runs with exactly those flags (only listen addresses,
    # the mounted certificate folder and the kubeconfig are local).
    for arg in container["args"]:
        flag = arg.split("=", 1)[0]
        if flag not in ("--liveness", "--metrics-port", "--webhook-cert-dir"):
            assert arg in operator.argv, arg

    # Webhooks: the API server calls the local operator with the Helm-generated CA.
    secret = cluster.get_json("secret", inst.tls_secret, "-n", inst.namespace)
    for kind, path in (
        ("mutatingwebhookconfiguration", "/inject-pods"),
        ("validatingwebhookconfiguration", "/validate-policy"),
    ):
        hooks = cluster.get_json(kind, inst.fullname)["webhooks"]
        hook = hooks[0]  # then: label-job (mutating), validate-job (validating)
        assert hook["clientConfig"]["url"] == inst.webhook_url + path
        for h in hooks:
            assert h["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    local_ca = (operator.tls_dir / "ca.crt").read_bytes()
    assert base64.b64decode(secret["data"]["ca.crt"]) == local_ca

    # RBAC: the ServiceAccount has exactly the documented rights, cluster-wide ...
    sa = inst.sa_user
    assert rules_of(cluster, sa) == EXPECTED_RULES
    assert rules_of(cluster, sa, "kube-system") == EXPECTED_RULES
    # ... and none of the dangerous ones.
    for verb, resource in [
        ("delete", "pytorchjobs.kubeflow.org"),
        ("update", "pytorchjobs.kubeflow.org"),
        ("create", "pods"),
        ("delete", "pods"),
        ("create", "pods/eviction"),
        ("list", "secrets"),
        ("watch", "secrets"),
        ("delete", "checkpointpolicies.ckpt.dev"),
        ("create", "mutatingwebhookconfigurations.admissionregistration.k8s.io"),
        ("patch", "validatingwebhookconfigurations.admissionregistration.k8s.io"),
        ("create", "customresourcedefinitions.apiextensions.k8s.io"),
        ("delete", "configmaps"),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
        ("impersonate", "serviceaccounts"),
        ("patch", "nodes"),
        ("*", "*"),
    ]:
        assert not can_i(cluster, sa, verb, resource, "-A"), f"{sa} may {verb} {resource}"
    assert can_i(cluster, sa, "patch", "pods", "-A")
    assert can_i(cluster, sa, "create", "pytorchjobs.kubeflow.org", "-A")
    # Trainer v2 / JobSet (issue #15): their CRDs need not be installed here, and
    # `kubectl auth can-i` resolves a resource through discovery, so these ask the API server
    # the same question directly (a SubjectAccessReview, group and resource spelled out).
    for verb, group, resource in [
        ("delete", "trainer.kubeflow.org", "trainjobs"),
        ("update", "trainer.kubeflow.org", "trainjobs"),
        ("create", "jobset.x-k8s.io", "jobsets"),
        ("patch", "jobset.x-k8s.io", "jobsets"),
        ("delete", "jobset.x-k8s.io", "jobsets"),
        ("list", "trainer.kubeflow.org", "clustertrainingruntimes"),
        ("patch", "trainer.kubeflow.org", "clustertrainingruntimes"),
        ("create", "trainer.kubeflow.org", "trainingruntimes"),
    ]:
        assert not may(cluster, sa, verb, group, resource), f"{sa} may {verb} {resource}"
    for verb, group, resource in [
        ("create", "trainer.kubeflow.org", "trainjobs"),
        ("patch", "trainer.kubeflow.org", "trainjobs"),
        ("watch", "jobset.x-k8s.io", "jobsets"),
        ("get", "jobset.x-k8s.io", "jobsets"),
        ("get", "trainer.kubeflow.org", "clustertrainingruntimes"),
        ("get", "trainer.kubeflow.org", "trainingruntimes"),
    ]:
        assert may(cluster, sa, verb, group, resource), f"{sa} may not {verb} {resource}"
    # a real request as the ServiceAccount is refused, worded as the log check expects
    denied = cluster.kubectl("get", "secrets", "-A", f"--as={sa}", check=False)
    assert denied.returncode != 0 and RBAC_DENIED.search(denied.stderr), denied.stderr

    # The operator really runs as that ServiceAccount (TokenRequest token), not as admin.
    if operator.container is not None:  # from the image: the token mounted like a kubelet's
        assert operator.token_user() == sa
        return
    kubeconfig = yaml.safe_load((operator.dir / "kubeconfig").read_text())
    (user,) = kubeconfig["users"]
    assert user["name"] == sa and "token" in user["user"]
    assert "client-certificate" not in user["user"]


def test_chart_defaults_render_objects_the_api_server_accepts(
    cluster: LocalCluster, namespace: str
) -> None:
    """The in-cluster configuration (webhooks through the Service) is valid too."""
    rendered = cluster.helm(
        "template", "dry", str(CHART_DIR), "--namespace", namespace, "--set", "crds.enabled=false"
    ).stdout
    out = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=rendered
    ).stdout
    for kind in (
        "deployment.apps",
        "serviceaccount",
        "clusterrole.rbac.authorization.k8s.io",
        "mutatingwebhookconfiguration.admissionregistration.k8s.io",
        "validatingwebhookconfiguration.admissionregistration.k8s.io",
    ):
        assert f"{kind}/dry-ckpt-operator created (server dry run)" in out, out


# --------------------------------------------------------------------------- scenario 3
def test_annotated_pytorchjob_pods_get_the_agent_and_others_do_not(scenario: Scenario) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    scenario.apply_policy("e2e")
    injections = scenario.operator.metric("ckpt_operator_injections_total", {"result": "injected"})
    training = Training(steps=12)
    scenario.submit("opted-in", training, policy="e2e")
    scenario.submit("plain", training, policy=None)

    def pod(job: str) -> dict[str, Any] | None:
        items = cluster.get_json("pods", "-n", ns, "-l", f"training.kubeflow.org/job-name={job}")[
            "items"
        ]
        return items[0] if items else None

    injected = cluster.wait_for(lambda: pod("opted-in"), timeout=60, what="pod of opted-in")
    plain = cluster.wait_for(lambda: pod("plain"), timeout=60, what="pod of plain")
    assert isinstance(injected, dict) and isinstance(plain, dict)
    run_id = scenario.run_id("opted-in")

    # --- the opted-in pod carries the agent's configuration
    meta = injected["metadata"]
    assert meta["labels"]["ckpt.dev/injected"] == "true"
    assert meta["annotations"]["ckpt.dev/injected"] == "v1"
    assert meta["annotations"]["ckpt.dev/run-id"] == run_id
    (container,) = injected["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["CKPT_CONFIG"]["value"] == "/etc/ckpt/config.json"
    assert env["CKPT_RUN_ID"]["value"] == run_id
    assert env["CKPT_STORAGE_URL"]["value"] == f"file://{scenario.store}"
    assert env["CKPT_SIGNAL_FILE"]["value"] == "/var/run/ckpt/signal/save-now"
    assert "CKPT_RESUME_FROM" not in env  # a first run starts fresh
    # the training-operator's own env is untouched
    assert env["WORLD_SIZE"]["value"] == "1" and env["RANK"]["value"] == "0"
    volumes = {v["name"]: v for v in injected["spec"]["volumes"]}
    assert volumes["ckpt-config"]["configMap"]["name"] == "ckpt-e2e"
    assert volumes["ckpt-storage"]["persistentVolumeClaim"]["claimName"] == scenario.claim
    assert volumes["ckpt-shm"]["emptyDir"]["medium"] == "Memory"
    signal_items = volumes["ckpt-signal"]["downwardAPI"]["items"]
    assert signal_items[0]["fieldRef"]["fieldPath"] == "metadata.annotations['ckpt.dev/save-now']"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/ckpt"] == "ckpt-config"
    assert mounts[str(scenario.store)] == "ckpt-storage"
    assert any(p.get("name") == "ckpt-metrics" for p in container.get("ports", []))
    # the user's own volumes and mounts are kept
    assert {"code", "results"} <= set(volumes)

    # --- the unannotated job's pod is exactly what the training-operator asked for
    assert "ckpt.dev/injected" not in (plain["metadata"].get("labels") or {})
    (pc,) = plain["spec"]["containers"]
    assert not [e for e in pc["env"] if e["name"].startswith("CKPT_")]
    assert not [v for v in plain["spec"]["volumes"] if v["name"].startswith("ckpt-")]

    # --- the decision is visible: an Event on the job, the operator's status, metrics
    ev = cluster.wait_for(
        lambda: events(cluster, ns, name="opted-in", reason="Injected"), timeout=30, what="Event"
    )
    assert "injected checkpoint agent (policy e2e" in ev[0]["message"]
    assert not events(cluster, ns, name="plain", reason="Injected")
    status = json.loads(annotations_of(scenario.job("opted-in"))["ckpt.dev/status"])
    assert status["state"] == "Watching"
    assert "ckpt.dev/status" not in annotations_of(scenario.job("plain"))
    assert (
        scenario.operator.metric("ckpt_operator_injections_total", {"result": "injected"})
        == injections + 1
    )

    # the injected pod really runs the example with the agent: a few steps, checkpoints
    runner = scenario.runner(
        decide=lambda pod: "run" if "ckpt.dev/injected" in pod["metadata"]["labels"] else "ignore"
    )
    run = runner.wait_run("opted-in", timeout=60)
    assert run.wait(120) == 0, run.local.log_text()[-3000:] if run.local else ""
    assert scenario.view().checkpoints(run_id, heartbeat=True)
