"""The webhook's peer replication (planners.replica_injection via build_pod_patch): nothing
changes unless the policy asks; then the sidecar, and only it, gets the env, the port and the
job's Secret; every pod that cannot replicate is injected without it and a note says why."""

from __future__ import annotations

import copy
from typing import Any

from ckpt_agent.flash.replica.replicator import ReplicaOptions
from ckpt_agent.flash.sidecar.replica_env import replica_options_from_env
from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_operator.model.jsonpatch import apply_patch
from ckpt_operator.planners.injection import InjectionContext, build_pod_patch
from ckpt_operator.planners.replica_injection import mounts_replica_secret, replica_secret_name

RUN_ID = "mnist-ddp-5f0c6a7e"
IMAGE = "ghcr.io/x/agent:0.1.0"


def _spec(fixture: Any, replicas: dict[str, Any] | None, **agent: Any) -> CheckpointPolicySpec:
    spec = fixture("checkpointpolicy.json")["spec"]
    spec.setdefault("agent", {}).update({"sidecar": True, "image": IMAGE, **agent})
    if replicas is not None:
        spec["agent"]["replicas"] = replicas
    return CheckpointPolicySpec.model_validate(spec)


def _ctx(job: dict[str, Any] | None) -> InjectionContext:
    return InjectionContext(policy_name="llm-finetune", run_id=RUN_ID, job=job)


def _pytorch(fixture: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = fixture("admission_review_pod.json")["request"]["object"]
    return pod, fixture("pytorchjob_running.json")


def _inject(
    pod: dict[str, Any], spec: CheckpointPolicySpec, job: dict[str, Any] | None
) -> tuple[dict[str, Any], tuple[str, ...]]:
    result = build_pod_patch(pod, spec, {}, _ctx(job))
    assert result.injected and result.skipped is None
    return apply_patch(pod, result.ops), result.notes


def _sidecar(out: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in out["spec"]["initContainers"] if c["name"] == "ckpt-agent")


def _env(ctr: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in ctr.get("env", [])}


ON = {"enabled": True}


def test_nothing_changes_unless_the_policy_asks(fixture: Any) -> None:
    pod, job = _pytorch(fixture)
    plain = build_pod_patch(pod, _spec(fixture, None), {}, _ctx(None)).ops
    assert build_pod_patch(pod, _spec(fixture, None), {}, _ctx(job)).ops == plain
    off = _spec(fixture, {"enabled": False, "peers": 3, "port": 7000})
    assert build_pod_patch(pod, off, {}, _ctx(job)).ops == plain
    out, notes = _inject(pod, off, job)
    assert not any(k.startswith("CKPT_REPLICA_") for k in _env(_sidecar(out)))
    assert notes == ()


def test_the_sidecar_gets_env_port_and_the_jobs_secret(fixture: Any) -> None:
    pod, job = _pytorch(fixture)  # worker-0 of a Master + 2 Workers: rank 1 of 3
    out, notes = _inject(pod, _spec(fixture, ON), job)
    assert notes == ()
    sc = _sidecar(out)
    env = _env(sc)
    assert env["CKPT_REPLICA_PORT"] == "7471"
    assert env["CKPT_REPLICA_PEERS"] == "mnist-ddp-worker-1.ml-team.svc:7471"
    assert env["CKPT_REPLICA_SECRET_FILE"] == "/etc/ckpt-replica/secret"
    assert env["CKPT_REPLICA_JOB"] == "ml-team/mnist-ddp"
    assert env["CKPT_REPLICA_RANK"] == "1"
    assert env["CKPT_REPLICA_PEERS_DIR"] == "/etc/ckpt-replica-peers"
    assert env["CKPT_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert {"name": "ckpt-replica", "containerPort": 7471, "protocol": "TCP"} in sc["ports"]
    assert {
        "name": "ckpt-replica",
        "mountPath": "/etc/ckpt-replica",
        "readOnly": True,
    } in sc["volumeMounts"]
    volume = next(v for v in out["spec"]["volumes"] if v["name"] == "ckpt-replica")
    assert volume["secret"] == {
        "secretName": "ckpt-replica-mnist-ddp",
        "items": [{"key": "secret", "path": "secret"}],
        "optional": True,  # a job without it runs, and restarts, without replication
    }
    # the operator's peer map: the whole ConfigMap (the kubelet refreshes it), optional
    assert {
        "name": "ckpt-replica-peers",
        "mountPath": "/etc/ckpt-replica-peers",
        "readOnly": True,
    } in sc["volumeMounts"]
    assert not any("subPath" in m for m in sc["volumeMounts"])
    peer_map = next(v for v in out["spec"]["volumes"] if v["name"] == "ckpt-replica-peers")
    assert peer_map["configMap"] == {"name": "ckpt-replica-peers-mnist-ddp", "optional": True}
    # the training container sees neither the secret nor the replica settings
    trainer = next(c for c in out["spec"]["containers"] if c["name"] == "pytorch")
    assert all(not m["name"].startswith("ckpt-replica") for m in trainer["volumeMounts"])
    assert not any(k.startswith("CKPT_REPLICA_") for k in _env(trainer))


def test_what_the_webhook_sets_is_what_the_sidecar_reads(fixture: Any) -> None:
    pod, job = _pytorch(fixture)
    out, _ = _inject(pod, _spec(fixture, {"enabled": True, "peers": 2, "port": 7500}), job)
    env = {k: v for k, v in _env(_sidecar(out)).items() if isinstance(v, str)}
    env["CKPT_NODE_NAME"] = "gpu-node-7"  # what the downward API resolves to
    assert replica_options_from_env(env) == ReplicaOptions(
        node="gpu-node-7",
        namespace="ml-team",
        job_id="mnist-ddp",
        secret_file="/etc/ckpt-replica/secret",
        peers=("mnist-ddp-worker-1.ml-team.svc:7500", "mnist-ddp-master-0.ml-team.svc:7500"),
        peers_file="/etc/ckpt-replica-peers/rank-1",
        listen_port=7500,
    )


def test_a_trainjob_pod_replicates_to_its_jobset_neighbour(fixture: Any) -> None:
    pod = fixture("trainjob_pod.json")
    job = fixture("trainjob_running.json")  # numNodes 2; the pod is completion index 0
    out, notes = _inject(pod, _spec(fixture, ON, containerName="node"), job)
    assert notes == ()
    env = _env(_sidecar(out))
    assert env["CKPT_REPLICA_PEERS"] == "llm-ft-node-0-1.llm-ft.ml-team.svc:7471"
    assert env["CKPT_REPLICA_JOB"] == "ml-team/llm-ft"


def test_a_world_of_one_is_injected_without_replication_and_noted(fixture: Any) -> None:
    pod, job = _pytorch(fixture)
    del job["spec"]["pytorchReplicaSpecs"]["Master"]
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 1  # the pod is worker-0
    out, notes = _inject(pod, _spec(fixture, ON), job)
    assert not any(k.startswith("CKPT_REPLICA_") for k in _env(_sidecar(out)))
    assert all(not v["name"].startswith("ckpt-replica") for v in out["spec"]["volumes"])
    assert len(notes) == 1 and "peer replication off" in notes[0] and "world of one" in notes[0]


def test_the_patch_says_whether_the_pod_replicates(fixture: Any) -> None:
    """What the webhook reads to issue the job's Secret (behaviours.replica_secrets)."""
    pod, job = _pytorch(fixture)
    on = build_pod_patch(pod, _spec(fixture, ON), {}, _ctx(job)).ops
    assert mounts_replica_secret(on)
    assert not mounts_replica_secret(build_pod_patch(pod, _spec(fixture, None), {}, _ctx(job)).ops)
    assert not mounts_replica_secret(build_pod_patch(pod, _spec(fixture, ON), {}, _ctx(None)).ops)


def test_an_unknown_job_or_rank_is_noted(fixture: Any) -> None:
    pod, job = _pytorch(fixture)
    _, notes = _inject(pod, _spec(fixture, ON), None)
    assert notes == ("peer replication off for this pod: its job is not known",)
    del pod["metadata"]["labels"]["training.kubeflow.org/replica-type"]
    _, notes = _inject(pod, _spec(fixture, ON), job)
    assert len(notes) == 1 and "rank is not known" in notes[0]


def test_a_taken_volume_name_or_port_is_noted(fixture: Any) -> None:
    pod, job = _pytorch(fixture)
    taken = copy.deepcopy(pod)
    taken["spec"]["volumes"].append({"name": "ckpt-replica", "emptyDir": {}})
    out, notes = _inject(taken, _spec(fixture, ON), job)
    assert "volume named 'ckpt-replica'" in notes[0]
    assert [v["name"] for v in out["spec"]["volumes"]].count("ckpt-replica") == 1
    peers = copy.deepcopy(pod)
    peers["spec"]["volumes"].append({"name": "ckpt-replica-peers", "emptyDir": {}})
    out, notes = _inject(peers, _spec(fixture, ON), job)
    assert "volume named 'ckpt-replica-peers'" in notes[0]
    assert "CKPT_REPLICA_RANK" not in _env(_sidecar(out))
    port = copy.deepcopy(pod)
    port["spec"]["containers"][0].setdefault("ports", []).append({"containerPort": 7471})
    out, notes = _inject(port, _spec(fixture, ON), job)
    assert "already declares port 7471" in notes[0] and "spec.agent.replicas.port" in notes[0]
    assert "CKPT_REPLICA_PORT" not in _env(_sidecar(out))


def test_without_a_sidecar_there_is_no_replication(fixture: Any) -> None:
    pod, job = _pytorch(fixture)
    spec = _spec(fixture, ON, image=None)  # no image anywhere: the agent persists in-process
    out, notes = _inject(pod, spec, job)
    assert "initContainers" not in out["spec"] or all(
        c["name"] != "ckpt-agent" for c in out["spec"]["initContainers"]
    )
    assert all(v["name"] != "ckpt-replica" for v in out["spec"]["volumes"])
    assert not any("replication" in n for n in notes)


def test_a_pod_without_volumes_gets_the_secret_volume_too(fixture: Any) -> None:
    pod, job = _pytorch(fixture)
    del pod["spec"]["volumes"]
    out, _ = _inject(pod, _spec(fixture, ON), job)
    names = [v["name"] for v in out["spec"]["volumes"]]
    assert names[0] == "ckpt-config" and names[-2:] == ["ckpt-replica", "ckpt-replica-peers"]


def test_the_input_pod_and_job_are_not_changed(fixture: Any) -> None:
    pod, job = _pytorch(fixture)
    before = (copy.deepcopy(pod), copy.deepcopy(job))
    build_pod_patch(pod, _spec(fixture, ON), {}, _ctx(job))
    assert (pod, job) == before


def test_the_secret_name_stays_a_valid_name() -> None:
    assert replica_secret_name("bert") == "ckpt-replica-bert"
    long = replica_secret_name("j" * 300)
    assert len(long) <= 253 and long.startswith("ckpt-replica-jjj")
    assert replica_secret_name("j" * 300) == long != replica_secret_name("j" * 299 + "k")
