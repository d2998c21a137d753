"""What the harness derives from the pinned Kueue module (no cluster needed).

The CRDs, webhook configurations, the manager's configuration and its feature gates are
read from, or checked against, the Go module cache (``ckpt_e2e.kueue``): these checks catch
a pin bump that renames an integration, a gate or a webhook before an e2e run would.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpt_e2e.kueue import (
    FEATURE_GATES,
    FRAMEWORKS,
    METRICS_CERT_DIR,
    cluster_queue,
    crd_files,
    feature_gates_flag,
    kueue_dir,
    manager_config,
    queue_labels,
    webhook_configurations,
    with_labels,
    workload_condition,
)
from ckpt_e2e.trainer_v2 import yaml_docs


def test_crds_include_the_queueing_objects_and_workloads() -> None:
    files = crd_files()
    for kind in ("clusterqueues", "localqueues", "resourceflavors", "workloads"):
        assert f"{kind}.kueue.x-k8s.io" in files
    assert "workloadpriorityclasses.kueue.x-k8s.io" in files
    for name, path in files.items():
        (doc,) = yaml_docs(path)
        assert doc["kind"] == "CustomResourceDefinition" and doc["metadata"]["name"] == name
        # no conversion webhook: the API server serves the stored version as is
        assert (doc["spec"].get("conversion") or {}).get("strategy", "None") == "None"
    (wl,) = yaml_docs(files["workloads.kueue.x-k8s.io"])
    assert [v["name"] for v in wl["spec"]["versions"] if v.get("storage")] == ["v1beta2"]


def test_webhooks_only_for_kueue_objects_and_the_two_integrations() -> None:
    docs = list(webhook_configurations("https://127.0.0.1:9", "Q0E="))
    assert {d["metadata"]["name"] for d in docs} == {
        "kueue-mutating-webhook-configuration",
        "kueue-validating-webhook-configuration",
    }
    resources: set[str] = set()
    for doc in docs:
        for hook in doc["webhooks"]:
            cfg = hook["clientConfig"]
            assert set(cfg) == {"url", "caBundle"} and cfg["caBundle"] == "Q0E="
            assert cfg["url"].startswith("https://127.0.0.1:9/"), cfg
            for rule in hook["rules"]:
                resources.update(rule["resources"])
    assert {"pytorchjobs", "trainjobs", "workloads", "clusterqueues"} <= resources
    # never on the path of the other controllers' pods, Jobs or JobSets
    assert not resources & {"pods", "jobs", "jobsets", "deployments", "statefulsets"}


def test_integration_names_and_feature_gates_exist_in_the_pinned_source() -> None:
    src = kueue_dir()
    names = set()
    for path in (src / "pkg" / "controller" / "jobs").rglob("*_controller.go"):
        names.update(re.findall(r'FrameworkName\s*=\s*"([^"]+)"', path.read_text()))
    assert set(FRAMEWORKS) <= names, names
    gates = (src / "pkg" / "features" / "kube_features.go").read_text()
    for gate in FEATURE_GATES:
        assert re.search(rf'\b{gate}\s+featuregate\.Feature\s*=\s*"{gate}"', gates), gate
    assert feature_gates_flag().startswith("PriorityBoost=true,")
    # the workaround's premise: cmd/kueue reads its metrics certificate from this path
    assert f'"{METRICS_CERT_DIR}"' in (src / "cmd" / "kueue" / "main.go").read_text()


def test_manager_config_is_out_of_cluster_and_queue_name_only() -> None:
    cfg = manager_config(1111, 2222, Path("/certs"))
    assert cfg["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"
    assert cfg["leaderElection"] == {"leaderElect": False}
    assert cfg["internalCertManagement"] == {"enable": False}
    assert cfg["manageJobsWithoutQueueName"] is False
    assert cfg["webhook"] == {"port": 2222, "host": "127.0.0.1", "certDir": "/certs"}
    assert cfg["health"] == {"healthProbeBindAddress": "127.0.0.1:1111"}
    assert cfg["metrics"] == {"bindAddress": "0"}
    assert cfg["integrations"]["frameworks"] == list(FRAMEWORKS)


def test_queueing_helpers() -> None:
    cq = cluster_queue("cq", {"cpu": "1", "memory": "1Gi"})
    (group,) = cq["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory"]
    assert group["flavors"][0]["resources"] == [
        {"name": "cpu", "nominalQuota": "1"},
        {"name": "memory", "nominalQuota": "1Gi"},
    ]
    assert cq["spec"]["preemption"] == {"withinClusterQueue": "LowerPriority"}
    job = {"metadata": {"name": "j", "labels": {"a": "b"}}}
    labelled = with_labels(job, queue_labels("lq", "low"))
    assert labelled["metadata"]["labels"] == {
        "a": "b",
        "kueue.x-k8s.io/queue-name": "lq",
        "kueue.x-k8s.io/priority-class": "low",
    }
    assert job["metadata"]["labels"] == {"a": "b"}  # a copy
    wl = {"status": {"conditions": [{"type": "Evicted", "status": "True", "reason": "X"}]}}
    assert workload_condition(wl, "Evicted") == {"type": "Evicted", "status": "True", "reason": "X"}
    assert workload_condition(wl, "Admitted") is None
    assert workload_condition(None, "Evicted") is None
