"""A replicating job's peer map (planners.replica_peer_map): what a pod's sidecar env says,
when every rank is on a node, and the ConfigMap (name, keys the sidecar reads, owner)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ckpt_agent.flash.sidecar.replica_env import replica_options_from_env
from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.planners.replica_peer_map import (
    ReplicatingPod,
    ScheduledRanks,
    peer_map,
    replica_peers_map_name,
    replicating_pod,
    scheduled_ranks,
)
from ckpt_operator.planners.replica_topology import ZONE_LABEL

HOSTS = tuple(f"j-worker-{i}.ns.svc" for i in range(4))
JOB = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "PyTorchJob",
    "metadata": {"name": "j", "namespace": "ns", "uid": "u1"},
}


def _pod(rank: int | None, node: str | None, port: str = "7471", **meta: Any) -> dict[str, Any]:
    env = [
        {"name": "CKPT_REPLICA_PORT", "value": port},
        {"name": "CKPT_REPLICA_PEERS", "value": "a:1"},
    ]
    if rank is not None:
        env.append({"name": "CKPT_REPLICA_RANK", "value": str(rank)})
    spec: dict[str, Any] = {
        "initContainers": [{"name": "ckpt-agent", "env": env}],
        "containers": [],
    }
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": f"p{rank}", **meta}, "spec": spec}


def test_the_name_is_cut_like_the_replica_secrets() -> None:
    assert replica_peers_map_name("bert") == "ckpt-replica-peers-bert"
    long = replica_peers_map_name("x" * 300)
    assert len(long) == 253 and long.startswith("ckpt-replica-peers-xxx")
    assert long != replica_peers_map_name("x" * 299 + "y")


def test_what_a_pods_sidecar_env_says() -> None:
    assert replicating_pod(_pod(2, "n1")) == ReplicatingPod(2, 7471, 1, "n1")
    assert replicating_pod(_pod(2, None)) == ReplicatingPod(2, 7471, 1, None)
    assert replicating_pod(_pod(None, "n1")) is None  # an older webhook: no rank
    assert replicating_pod(_pod(1, "n1", port="x")) is None
    assert replicating_pod({"spec": {"containers": ["not a container"]}}) is None


def test_every_rank_must_have_a_live_pod_on_a_node() -> None:
    pods = [_pod(r, f"n{r}") for r in range(3)]
    assert scheduled_ranks(HOSTS, pods) == "rank(s) 3 of 4 not on a node yet"
    assert scheduled_ranks(HOSTS, [*pods, _pod(3, None)]) == "rank(s) 3 of 4 not on a node yet"
    gone = _pod(3, "n3", deletionTimestamp="2024-01-01T00:00:00Z")
    assert isinstance(scheduled_ranks(HOSTS, [*pods, gone]), str)
    ok = scheduled_ranks(HOSTS, [*pods, _pod(3, "n3")])
    assert ok == ScheduledRanks(HOSTS, ("n0", "n1", "n2", "n3"), 7471, 1)
    assert "different ports" in str(scheduled_ranks(HOSTS, [*pods, _pod(3, "n3", port="7000")]))
    assert scheduled_ranks(HOSTS[:1], [_pod(0, "n0")]) == "a world of one node has no peer"


def test_the_configmap_holds_each_ranks_peers_as_the_sidecar_reads_them(tmp_path: Any) -> None:
    ranks = ScheduledRanks(HOSTS, ("n0", "n1", "n2", "n3"), 7471, 1)
    labels = {"n0": {ZONE_LABEL: "a"}, "n1": {ZONE_LABEL: "a"}, "n2": {ZONE_LABEL: "b"}}
    body, summary = peer_map(JOB, PYTORCHJOB, ranks, labels, None)  # n3: no label
    assert body["metadata"]["name"] == "ckpt-replica-peers-j"
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "j", "uid": "u1"}
    ]
    data = body["data"]
    assert sorted(data) == ["plan.json", "rank-0", "rank-1", "rank-2", "rank-3"]
    plan = json.loads(data["plan.json"])
    assert plan["ranks"][3]["zone"] is None and plan["world"] == 4
    assert "in another zone" in summary
    # the sidecar of rank 2 reads its file from the mounted folder
    (tmp_path / "rank-2").write_text(data["rank-2"])
    env = {
        "CKPT_REPLICA_PORT": "7471",
        "CKPT_REPLICA_PEERS": "j-worker-3.ns.svc:7471",
        "CKPT_REPLICA_SECRET_FILE": "/s",
        "CKPT_REPLICA_JOB": "ns/j",
        "CKPT_NODE_NAME": "n2",
        "CKPT_REPLICA_RANK": "2",
        "CKPT_REPLICA_PEERS_DIR": str(tmp_path),
    }
    options = replica_options_from_env(env)
    assert options is not None and options.peers_file == str(tmp_path / "rank-2")
    peer = data["rank-2"]
    assert peer in {f"{HOSTS[0]}:7471", f"{HOSTS[1]}:7471"}  # zone a: the other zone


def test_a_job_without_a_uid_cannot_own_it() -> None:
    ranks = ScheduledRanks(HOSTS[:2], ("n0", "n1"), 7471, 1)
    with pytest.raises(ValueError, match="uid"):
        peer_map({"metadata": {"name": "j", "namespace": "ns"}}, PYTORCHJOB, ranks, {}, None)
