"""The pod webhook hands the job to the injection, so a policy with
``spec.agent.replicas.enabled`` gets a replicating sidecar (behaviours.admission)."""

from __future__ import annotations

import asyncio
from typing import Any

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
