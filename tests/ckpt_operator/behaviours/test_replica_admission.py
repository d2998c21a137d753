"""The pod webhook hands the job to the injection, so a policy with
``spec.agent.replicas.enabled`` gets a replicating sidecar (behaviours.admission)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from typing import Any

import pytest

from ckpt_operator.behaviours.admission import inject_pod
from ckpt_operator.model.jsonpatch import apply_patch


def _enable(world: Any, **replicas: Any) -> None:
    policy = world.api.policies[("ml-team", "llm-finetune")]
    policy["spec"].setdefault("agent", {}).update(
        {
            "sidecar": True,
            "image": "ghcr.io/x/agent:0.1.0",
            "replicas": {"enabled": True, **replicas},
        }
    )


def _sidecar_env(pod: dict[str, Any], ops: list[Any]) -> dict[str, Any]:
    out = apply_patch(pod, ops)
    sc = next(c for c in out["spec"]["initContainers"] if c["name"] == "ckpt-agent")
    return {e["name"]: e.get("value") for e in sc["env"]}


def test_the_webhook_injects_a_replicating_sidecar(world: Any, fixture: Any) -> None:
    _enable(world, peers=2)
    world.api.add_job(fixture("pytorchjob_running.json"))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    out = asyncio.run(inject_pod(world.deps, pod, "ml-team"))
    assert out.result == "injected" and out.warnings == []
    env = _sidecar_env(pod, out.ops)
    assert env["CKPT_REPLICA_PEERS"] == (
        "mnist-ddp-worker-1.ml-team.svc:7471,mnist-ddp-master-0.ml-team.svc:7471"
    )
    assert env["CKPT_REPLICA_JOB"] == "ml-team/mnist-ddp"


def test_a_pod_that_cannot_replicate_is_injected_with_a_warning(world: Any, fixture: Any) -> None:
    _enable(world)
    job = fixture("pytorchjob_running.json")
    del job["spec"]["pytorchReplicaSpecs"]["Master"]
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1
    world.api.add_job(job)
    pod = fixture("admission_review_pod.json")["request"]["object"]
    out = asyncio.run(inject_pod(world.deps, pod, "ml-team"))
    assert out.result == "injected"
    assert any("peer replication off" in w and "world of one" in w for w in out.warnings)
    assert "CKPT_REPLICA_PORT" not in _sidecar_env(pod, out.ops)
    assert "world of one" in world.events.events[0].message


# --------------------------------------------------------------- the operator issues the Secret


def _issuing(world: Any) -> None:
    world.deps.config = dataclasses.replace(world.deps.config, issue_replica_secrets=True)


def test_the_first_replicating_pod_gets_its_job_secret_issued(world: Any, fixture: Any) -> None:
    """--issue-replica-secrets: the webhook creates ckpt-replica-<job> before the pod is
    stored (a random key, owned by the job); the next pods find it and leave it as it is."""
    _enable(world)
    _issuing(world)
    job = fixture("pytorchjob_running.json")
    world.api.add_job(job)
    pod = fixture("admission_review_pod.json")["request"]["object"]
    out = asyncio.run(inject_pod(world.deps, pod, "ml-team"))
    assert out.result == "injected" and out.warnings == []
    secret = world.api.created_secrets[("ml-team", "ckpt-replica-mnist-ddp")]
    key = base64.b64decode(secret["data"]["secret"]).decode()
    assert len(key) == 64 and int(key, 16) >= 0
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "PyTorchJob",
        "mnist-ddp",
        job["metadata"]["uid"],
    )
    assert [e.reason for e in world.events.events] == ["ReplicaSecretIssued", "Injected"]
    again = asyncio.run(inject_pod(world.deps, pod, "ml-team"))
    assert (
        again.warnings == [] and world.api.called("create_secret") == ["ckpt-replica-mnist-ddp"] * 2
    )
    assert world.api.created_secrets[("ml-team", "ckpt-replica-mnist-ddp")] == secret  # kept
    assert [e.reason for e in world.events.events].count("ReplicaSecretIssued") == 1


@pytest.mark.parametrize("case", ["switch off", "dry run", "no replication"])
def test_no_secret_without_the_switch_on_a_dry_run_or_for_a_pod_that_does_not_replicate(
    world: Any, fixture: Any, case: str
) -> None:
    if case != "no replication":
        _enable(world)
    if case != "switch off":
        _issuing(world)
    world.api.add_job(fixture("pytorchjob_running.json"))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    out = asyncio.run(inject_pod(world.deps, pod, "ml-team", dryrun=case == "dry run"))
    assert out.result == "injected"
    assert world.api.called("create_secret") == [] and world.api.created_secrets == {}


def test_an_operator_that_may_not_create_secrets_injects_and_says_what_to_do(
    world: Any, fixture: Any
) -> None:
    _enable(world)
    _issuing(world)
    world.api.forbid_secrets = True
    world.api.add_job(fixture("pytorchjob_running.json"))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    out = asyncio.run(inject_pod(world.deps, pod, "ml-team"))
    assert out.result == "injected"
    assert "CKPT_REPLICA_PEERS" in _sidecar_env(pod, out.ops)
    (warning,) = out.warnings
    assert "may not create the replica Secret ckpt-replica-mnist-ddp" in warning
    assert "rbac.issueReplicaSecrets" in warning and "by hand" in warning
    assert "rbac.issueReplicaSecrets" in world.events.events[0].message
