"""Example manifests shipped in examples/ stay valid against the policy model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ckpt_agent.policy import CheckpointPolicy

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("policy*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_policy_is_valid(path: Path) -> None:
    obj = CheckpointPolicy.model_validate(yaml.safe_load(path.read_text()))
    assert obj.metadata.name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_storage_outlives_the_pod(path: Path) -> None:
    """The quickstart never writes checkpoints into the container's own filesystem."""
    storage = CheckpointPolicy.model_validate(yaml.safe_load(path.read_text())).spec.storage
    assert storage.type == "s3" or storage.local.pvc_name, (
        f"{path.name}: local storage without a PVC"
    )


def test_the_quickstart_claim_is_the_one_the_policy_names() -> None:
    root = Path(__file__).resolve().parents[1] / "examples"
    claim = yaml.safe_load((root / "checkpoints-pvc.yaml").read_text())
    policy = CheckpointPolicy.model_validate(yaml.safe_load((root / "policy.yaml").read_text()))
    assert claim["kind"] == "PersistentVolumeClaim"
    assert policy.spec.storage.local.pvc_name == claim["metadata"]["name"]


def test_the_trainjob_example_is_opted_in_and_names_the_torch_runtime() -> None:
    """examples/trainjob.yaml: a Trainer v2 TrainJob with the two annotations (issue #15)."""
    root = Path(__file__).resolve().parents[1] / "examples"
    job = yaml.safe_load((root / "trainjob.yaml").read_text())
    policy = CheckpointPolicy.model_validate(yaml.safe_load((root / "policy.yaml").read_text()))
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    annotations = job["metadata"]["annotations"]
    assert annotations["ckpt.dev/policy"] == policy.metadata.name
    assert annotations["ckpt.dev/auto-resume"] == "true"
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    # the operator adds its own runtime patch (and mounts the policy's claim): none needed
    assert "runtimePatches" not in job["spec"]


def test_the_hf_trainer_manifests_are_opted_in_and_run_the_example_script() -> None:
    """examples/hf-trainer-{pytorchjob,trainjob}.yaml (issue #26; e2e/tests/test_hf_operator.py
    runs them): the two annotations, the shipped Trainer script, the same arguments."""
    root = Path(__file__).resolve().parents[1] / "examples"
    policy = CheckpointPolicy.model_validate(yaml.safe_load((root / "policy.yaml").read_text()))
    pj = yaml.safe_load((root / "hf-trainer-pytorchjob.yaml").read_text())
    tj = yaml.safe_load((root / "hf-trainer-trainjob.yaml").read_text())
    master = pj["spec"]["pytorchReplicaSpecs"]["Master"]
    containers = [master["template"]["spec"]["containers"][0], tj["spec"]["trainer"]]
    for job in (pj, tj):
        annotations = job["metadata"]["annotations"]
        assert annotations["ckpt.dev/policy"] == policy.metadata.name
        assert annotations["ckpt.dev/auto-resume"] == "true"
    assert master["restartPolicy"] == "Never"  # the operator restarts the job
    assert containers[0]["name"] == "pytorch"
    for ctr in containers:
        assert Path(ctr["command"][-1]).name == "train_hf_trainer.py"
    assert (root / "train_hf_trainer.py").is_file()
    assert containers[0]["args"] == containers[1]["args"]
