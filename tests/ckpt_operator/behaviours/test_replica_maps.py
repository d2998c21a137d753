"""The operator publishes a replicating job's peer map once its ranks are on nodes
(behaviours.replica_maps): pods injected by the real webhook path, nodes with zone (and
rack) labels; made once and never changed, also when a rank's pod is recreated on a node
of another zone (its peers keep its replicas)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from typing import Any

import pytest

from ckpt_operator.adapters.kube import ApiError
from ckpt_operator.behaviours.admission import inject_pod
from ckpt_operator.behaviours.replica_maps import publish_peer_map
from ckpt_operator.behaviours.state import PeerMaps
from ckpt_operator.model.jsonpatch import apply_patch

ZONE = "topology.kubernetes.io/zone"
RACK = "example.com/rack"
NAME = "ckpt-replica-peers-mnist-ddp"


def _job(fixture: Any, workers: int = 3) -> dict[str, Any]:
    job = fixture("pytorchjob_running.json")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = workers
    return job


def _pods(world: Any, fixture: Any, ranks: int) -> list[dict[str, Any]]:
    """The job's pods (master-0, worker-0 …) as the webhook injected them, not scheduled."""
    policy = world.api.policies[("ml-team", "llm-finetune")]
    policy["spec"].setdefault("agent", {}).update(
        {"sidecar": True, "image": "ghcr.io/x/agent:0.1.0", "replicas": {"enabled": True}}
    )
    template = fixture("admission_review_pod.json")["request"]["object"]
    out = []
    for rank in range(ranks):
        rtype, index = ("master", 0) if rank == 0 else ("worker", rank - 1)
        pod = copy.deepcopy(template)
        pod["metadata"]["name"] = f"mnist-ddp-{rtype}-{index}"
        pod["metadata"]["uid"] = f"uid-{rank}"
        pod["metadata"]["labels"]["training.kubeflow.org/replica-type"] = rtype
        pod["metadata"]["labels"]["training.kubeflow.org/replica-index"] = str(index)
        answer = asyncio.run(inject_pod(world.deps, pod, "ml-team", dryrun=True))
        assert answer.result == "injected"
        out.append(apply_patch(pod, answer.ops))
    return out


def _node(world: Any, name: str, zone: str | None, rack: str | None = None) -> None:
    labels = {"kubernetes.io/hostname": name}
    labels.update({ZONE: zone} if zone else {})
    labels.update({RACK: rack} if rack else {})
    world.api.nodes[name] = {"metadata": {"name": name, "labels": labels}}


def _schedule(world: Any, pod: dict[str, Any], node: str) -> str:
    pod["spec"]["nodeName"] = node
    world.deps.pods.upsert(pod)
    return asyncio.run(publish_peer_map(world.deps, pod))


def _map(world: Any) -> dict[str, str]:
    return dict(world.api.config_maps[("ml-team", NAME)]["data"])


@pytest.fixture
def four(world: Any, fixture: Any) -> list[dict[str, Any]]:
    """A job of four ranks; nodes n0, n1 in zone a, n2, n3 in zone b."""
    world.api.add_job(_job(fixture))
    for i, zone in enumerate("aabb"):
        _node(world, f"n{i}", zone)
    return _pods(world, fixture, 4)


def test_the_map_is_made_once_every_rank_is_on_a_node_with_peers_in_the_other_zone(
    world: Any, four: list[dict[str, Any]]
) -> None:
    for rank in range(3):
        assert _schedule(world, four[rank], f"n{rank}").startswith("waiting: rank(s) ")
    assert ("ml-team", NAME) not in world.api.config_maps
    assert _schedule(world, four[3], "n3") == "created"
    data = _map(world)
    host = "mnist-ddp-{}.ml-team.svc:7471".format
    zone_of = {"master-0": "a", "worker-0": "a", "worker-1": "b", "worker-2": "b"}
    for rank, me in enumerate(zone_of):
        (peer,) = data[f"rank-{rank}"].split(",")  # one peer (the policy's default)
        other = peer.split(".")[0].removeprefix("mnist-ddp-")
        assert peer == host(other) and zone_of[other] != zone_of[me], data
    plan = json.loads(data["plan.json"])
    assert [r["apart"] for r in plan["ranks"]] == [["zone"]] * 4
    assert [r["node"] for r in plan["ranks"]] == ["n0", "n1", "n2", "n3"]
    body = world.api.config_maps[("ml-team", NAME)]
    (owner,) = body["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "PyTorchJob",
        "mnist-ddp",
        "5f0c6a7e-3b1d-4c9a-9e2f-8d7b6a5c4e31",
    )
    assert body["metadata"]["labels"]["ckpt.dev/replica-peers"] == "chosen"
    (event,) = [e for e in world.events.events if e.reason == "ReplicaPeersChosen"]
    assert "4 of 4 in another zone" in event.message, event.message
    # the nodes' labels were read once each, then remembered
    assert sorted(n for call, n in world.api.calls if call == "get_node") == [
        "n0",
        "n1",
        "n2",
        "n3",
    ]


def test_the_map_is_never_changed_when_a_rank_moves_to_another_zone(
    world: Any, four: list[dict[str, Any]]
) -> None:
    """Rank 1's node (zone a) lost; its pod recreated on n4 in zone b. Its peer keeps its
    replica only if the map stays: it does, also after an operator restart."""
    for rank in range(4):
        _schedule(world, four[rank], f"n{rank}")
    before = _map(world)
    world.deps.pods.remove(four[1])
    _node(world, "n4", "b")
    moved = copy.deepcopy(four[1])
    moved["metadata"]["uid"] = "uid-1-again"
    assert _schedule(world, moved, "n4") == "done already"
    world.deps.peer_maps = PeerMaps()  # an operator restart: the map is found, kept
    assert _schedule(world, moved, "n4") == "exists"
    assert _map(world) == before
    assert [c for c, _ in world.api.calls].count("create_config_map") == 2
    assert len([e for e in world.events.events if e.reason == "ReplicaPeersChosen"]) == 1


def test_a_pod_ending_or_gone_does_not_count_as_its_rank(
    world: Any, four: list[dict[str, Any]]
) -> None:
    for rank in range(3):
        _schedule(world, four[rank], f"n{rank}")
    ending = copy.deepcopy(four[3])
    ending["metadata"]["deletionTimestamp"] = "2024-05-02T09:00:00Z"
    assert _schedule(world, ending, "n3") == "waiting: rank(s) 3 of 4 not on a node yet"
    failed = copy.deepcopy(four[3])
    failed["status"] = {"phase": "Failed"}
    assert _schedule(world, failed, "n3").startswith("waiting")
    assert _schedule(world, four[3], "n3") == "created"


def test_racks_are_used_with_the_operators_rack_label(world: Any, fixture: Any) -> None:
    world.deps.config = dataclasses.replace(world.deps.config, replica_rack_label=RACK)
    world.api.add_job(_job(fixture))
    for i, rack in enumerate(["r1", "r1", "r2", "r2"]):
        _node(world, f"n{i}", "a", rack)
    pods = _pods(world, fixture, 4)
    for rank in range(4):
        _schedule(world, pods[rank], f"n{rank}")
    plan = json.loads(_map(world)["plan.json"])
    assert [r["apart"] for r in plan["ranks"]] == [["rack"]] * 4
    assert plan["rackLabel"] == RACK
    assert [r["rack"] for r in plan["ranks"]] == ["r1", "r1", "r2", "r2"]


def test_no_labels_gives_the_ring_and_a_failure_is_retried(world: Any, fixture: Any) -> None:
    world.api.add_job(_job(fixture))
    pods = _pods(world, fixture, 4)
    ring = {f"rank-{r}": p["spec"]["initContainers"] for r, p in enumerate(pods)}
    for rank in range(3):
        _schedule(world, pods[rank], f"gone-{rank}")  # nodes the API does not know

    async def refused(body: dict[str, Any]) -> bool:
        raise ApiError(403, "configmaps is forbidden")

    create = world.api.create_config_map
    world.api.create_config_map = refused
    assert _schedule(world, pods[3], "gone-3").startswith("failed: 403")
    world.api.create_config_map = create
    assert asyncio.run(publish_peer_map(world.deps, pods[3])) == "created"
    data = _map(world)
    for rank, containers in ring.items():  # the webhook's ring, peer for peer
        sidecar = next(c for c in containers if c["name"] == "ckpt-agent")
        env = {e["name"]: e.get("value") for e in sidecar["env"]}
        assert data[rank] == env["CKPT_REPLICA_PEERS"], (rank, data)


def test_a_pod_that_does_not_replicate_is_ignored(world: Any, fixture: Any) -> None:
    world.api.add_job(_job(fixture))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["spec"]["nodeName"] = "n0"
    assert asyncio.run(publish_peer_map(world.deps, pod)) == "not replicating"
    assert not world.api.calls or all(c != "get_node" for c, _ in world.api.calls)
