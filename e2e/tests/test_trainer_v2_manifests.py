"""What the harness derives from the pinned JobSet/Trainer modules (no cluster needed).

The CRDs, webhook configurations and the torch runtime are read from the Go module cache
(``ckpt_e2e.trainer_v2``); these checks catch a pin bump that moves or changes them
before an e2e run would.
"""

from __future__ import annotations

from pathlib import Path

from ckpt_e2e.trainer_v2 import (
    JOBSET_WEBHOOK_SELECTOR,
    NODE,
    crd_files,
    torch_runtime,
    webhook_configurations,
    yaml_docs,
)
from ckpt_e2e.training import IMAGE, Training
from ckpt_e2e.trainjob import PATCH_MANAGER, trainjob_manifest


def test_crds_are_the_four_the_controllers_serve() -> None:
    files = crd_files()
    assert list(files) == [
        "jobsets.jobset.x-k8s.io",
        "trainjobs.trainer.kubeflow.org",
        "trainingruntimes.trainer.kubeflow.org",
        "clustertrainingruntimes.trainer.kubeflow.org",
    ]
    for name, path in files.items():
        (doc,) = yaml_docs(path)
        assert doc["kind"] == "CustomResourceDefinition"
        assert doc["metadata"]["name"] == name


def test_webhooks_point_at_the_local_servers_with_the_ca() -> None:
    docs = list(webhook_configurations("https://127.0.0.1:1", "https://127.0.0.1:2", "Q0E="))
    by_name = {d["metadata"]["name"]: d for d in docs}
    assert set(by_name) == {
        "jobset-mutating-webhook-configuration",
        "jobset-validating-webhook-configuration",
        "defaulter.trainer.kubeflow.org",
        "validator.trainer.kubeflow.org",
    }
    for doc in docs:
        base = "https://127.0.0.1:1/" if doc["metadata"]["name"].startswith("jobset") else None
        for hook in doc["webhooks"]:
            cfg = hook["clientConfig"]
            assert set(cfg) == {"url", "caBundle"} and cfg["caBundle"] == "Q0E="
            assert cfg["url"].startswith(base or "https://127.0.0.1:2/"), cfg
    # JobSet's pod webhooks only see JobSet pods (its kustomize patch), e.g. not PyTorchJob's
    pod_hooks = [
        h
        for d in docs
        for h in d["webhooks"]
        if {r for rule in h["rules"] for r in rule["resources"]} == {"pods"}
    ]
    assert len(pod_hooks) == 2
    assert all(h["objectSelector"] == JOBSET_WEBHOOK_SELECTOR for h in pod_hooks)


def test_torch_runtime_fails_jobs_at_once_and_restarts_the_jobset() -> None:
    rt = torch_runtime("rt", max_restarts=4, termination_grace_seconds=7)
    assert rt["kind"] == "ClusterTrainingRuntime" and rt["metadata"]["name"] == "rt"
    assert rt["spec"]["mlPolicy"]["torch"] == {}
    spec = rt["spec"]["template"]["spec"]
    assert spec["failurePolicy"] == {"maxRestarts": 4}
    (node,) = spec["replicatedJobs"]
    labels = node["template"]["metadata"]["labels"]
    assert labels["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    job = node["template"]["spec"]
    assert job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 7
    assert [(c["name"], c["image"]) for c in pod["containers"]] == [(NODE, IMAGE)]


def test_trainjob_manifest_opts_in_and_patches_volumes_into_the_node_pods(
    tmp_path: Path,
) -> None:
    tj = trainjob_manifest(
        "t", Training(), tmp_path / "results", policy="p", node_selector={"pool": "a"}
    )
    assert tj["metadata"]["annotations"] == {
        "ckpt.dev/policy": "p",
        "ckpt.dev/auto-resume": "true",
    }
    (patch,) = tj["spec"]["runtimePatches"]
    assert patch["manager"] == PATCH_MANAGER
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == NODE
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "a"}
    assert {v["name"] for v in pod["volumes"]} == {"code", "results"}
    assert pod["containers"][0]["name"] == NODE
    assert (tmp_path / "results").is_dir()
    plain = trainjob_manifest("t", Training(), tmp_path / "r2")
    assert plain["metadata"]["annotations"] == {}
