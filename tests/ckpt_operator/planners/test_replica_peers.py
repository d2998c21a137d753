"""Which peers a pod pushes its replicas to (planners.replica_peers): the ring, the stable
DNS names per job kind, and every reason replication stays off."""

from __future__ import annotations

from typing import Any

import pytest

from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.kinds.trainjob import TRAINJOB
from ckpt_operator.planners.replica_peers import ReplicaPeers, replica_peers, ring

# --------------------------------------------------------------------------- the ring


@pytest.mark.parametrize(
    ("rank", "world", "peers", "expected"),
    [
        (0, 1, 1, ()),
        (0, 1, 3, ()),
        (0, 2, 1, (1,)),
        (1, 2, 1, (0,)),
        (1, 2, 3, (0,)),  # capped at world - 1: never itself, never twice
        (0, 4, 1, (1,)),
        (3, 4, 1, (0,)),
        (2, 4, 2, (3, 0)),
        (3, 4, 3, (0, 1, 2)),
        (0, 3, 3, (1, 2)),
        (5, 8, 0, ()),
    ],
)
def test_ring(rank: int, world: int, peers: int, expected: tuple[int, ...]) -> None:
    assert ring(rank, world, peers) == expected


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("peers", [1, 2, 3])
def test_every_rank_is_held_by_the_next_k_ranks(world: int, peers: int) -> None:
    held_by: dict[int, list[int]] = {r: [] for r in range(world)}
    for r in range(world):
        targets = ring(r, world, peers)
        assert r not in targets and len(set(targets)) == len(targets)
        for t in targets:
            held_by[t].append(r)
    # every rank receives as many replicas as it sends: the memory is spread evenly
    assert all(len(v) == min(peers, world - 1) for v in held_by.values())


@pytest.mark.parametrize(("rank", "world", "peers"), [(1, 1, 1), (-1, 3, 1), (0, 0, 1), (0, 3, -1)])
def test_ring_refuses_what_is_not_a_ring(rank: int, world: int, peers: int) -> None:
    with pytest.raises(ValueError):
        ring(rank, world, peers)


# --------------------------------------------------------------------------- PyTorchJob


def _pytorchjob(masters: object = 1, workers: object = 3, **extra: Any) -> dict[str, Any]:
    specs: dict[str, Any] = {}
    if masters is not None:
        specs["Master"] = {"replicas": masters, "template": {}}
    if workers is not None:
        specs["Worker"] = {"replicas": workers, "template": {}}
    specs.update(extra)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "bert", "namespace": "team-a"},
        "spec": {"pytorchReplicaSpecs": specs},
    }


def _pt_pod(rtype: str | None, index: object) -> dict[str, Any]:
    labels: dict[str, Any] = {"training.kubeflow.org/job-name": "bert"}
    if rtype is not None:
        labels["training.kubeflow.org/replica-type"] = rtype
    if index is not None:
        labels["training.kubeflow.org/replica-index"] = index
    return {"metadata": {"name": f"bert-{rtype}-{index}", "labels": labels}, "spec": {}}


def _pt(
    rtype: str | None, index: object, job: dict[str, Any] | None = None, k: int = 1
) -> ReplicaPeers:
    return replica_peers(
        PYTORCHJOB, job or _pytorchjob(), _pt_pod(rtype, index), peers=k, port=7471
    )


def test_pytorchjob_master_then_workers_in_a_ring() -> None:
    assert _pt("master", "0") == ReplicaPeers(0, 4, ("bert-worker-0.team-a.svc:7471",))
    assert _pt("worker", "0").peers == ("bert-worker-1.team-a.svc:7471",)
    assert _pt("worker", "1").rank == 2
    last = _pt("worker", "2")
    assert (last.rank, last.world, last.peers) == (3, 4, ("bert-master-0.team-a.svc:7471",))
    assert last.on and last.off is None


def test_pytorchjob_k_peers() -> None:
    assert _pt("worker", "1", k=3).peers == (
        "bert-worker-2.team-a.svc:7471",
        "bert-master-0.team-a.svc:7471",
        "bert-worker-0.team-a.svc:7471",
    )
    # capped at the other ranks of a world of two
    two = _pytorchjob(workers=1)
    assert _pt("master", "0", two, k=3).peers == ("bert-worker-0.team-a.svc:7471",)


def test_pytorchjob_label_case_and_default_replicas() -> None:
    # the training-operator writes the type in lower case; a Master without replicas is one
    job = _pytorchjob(masters=None, workers=2)
    job["spec"]["pytorchReplicaSpecs"]["Master"] = {"template": {}}
    assert _pt("Master", "0", job).peers == ("bert-worker-0.team-a.svc:7471",)


def test_pytorchjob_workers_only() -> None:
    job = _pytorchjob(masters=None, workers=3)
    assert _pt("worker", "0", job) == ReplicaPeers(0, 3, ("bert-worker-1.team-a.svc:7471",))
    assert _pt("worker", "2", job).peers == ("bert-worker-0.team-a.svc:7471",)


def test_pytorchjob_the_port_and_namespace_given() -> None:
    got = replica_peers(
        PYTORCHJOB, _pytorchjob(), _pt_pod("master", "0"), peers=1, port=9000, namespace="ns2"
    )
    assert got.peers == ("bert-worker-0.ns2.svc:9000",)


def test_a_world_of_one_is_off_and_says_so() -> None:
    one = _pt("master", "0", _pytorchjob(workers=None))
    assert (one.rank, one.world, one.peers, one.on) == (0, 1, (), False)
    assert one.off is not None and "world of one" in one.off


@pytest.mark.parametrize(
    ("rtype", "index", "job", "why"),
    [
        (None, "0", None, "labels do not name a replica"),
        ("worker", None, None, "labels do not name a replica"),
        ("worker", "x", None, "labels do not name a replica"),
        ("worker", "-1", None, "labels do not name a replica"),
        ("launcher", "0", None, "labels do not name a replica"),
        ("worker", "3", None, "beyond the job's 3 replicas"),
        ("master", "0", _pytorchjob(masters="two"), "Master.replicas is not a count"),
        ("master", "0", _pytorchjob(masters=True), "Master.replicas is not a count"),
        ("master", "0", _pytorchjob(Launcher={"replicas": 1}), "Launcher (only Master and Worker)"),
        ("master", "0", _pytorchjob(masters=None), "labels do not name a replica"),
    ],
)
def test_pytorchjob_unknown_rank_is_off(
    rtype: str | None, index: object, job: dict[str, Any] | None, why: str
) -> None:
    got = _pt(rtype, index, job)
    assert got.peers == () and not got.on and got.rank is None
    assert (
        got.off is not None and got.off.startswith("the pod's rank is not known") and why in got.off
    )


def test_pytorchjob_without_replica_specs_is_off() -> None:
    job = {"metadata": {"name": "bert", "namespace": "a"}, "spec": {"pytorchReplicaSpecs": []}}
    got = _pt("master", "0", job)
    assert got.off is not None and "no spec.pytorchReplicaSpecs" in got.off


def test_no_namespace_is_off() -> None:
    job = _pytorchjob()
    del job["metadata"]["namespace"]
    got = _pt("master", "0", job)
    assert got.off == "the job's namespace is not known"
    # the pod's namespace serves when the job's body has none
    pod = _pt_pod("master", "0")
    pod["metadata"]["namespace"] = "team-b"
    assert replica_peers(PYTORCHJOB, job, pod, peers=1, port=1).peers == (
        "bert-worker-0.team-b.svc:1",
    )


# --------------------------------------------------------------------------- TrainJob


def _trainjob(nodes: object = 4) -> dict[str, Any]:
    trainer: dict[str, Any] = {} if nodes is None else {"numNodes": nodes}
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "llm", "namespace": "team-a"},
        "spec": {"trainer": trainer},
    }


def _tj_pod(
    index: object = "0",
    *,
    job_index: object = "0",
    as_annotation: bool = False,
    subdomain: str | None = None,
    nnodes: str | None = None,
) -> dict[str, Any]:
    labels: dict[str, Any] = {
        "jobset.sigs.k8s.io/jobset-name": "llm",
        "jobset.sigs.k8s.io/replicatedjob-name": "node",
    }
    if job_index is not None:
        labels["jobset.sigs.k8s.io/job-index"] = job_index
    annotations: dict[str, Any] = {}
    if index is not None:
        (annotations if as_annotation else labels)["batch.kubernetes.io/job-completion-index"] = (
            index
        )
    spec: dict[str, Any] = {"containers": [{"name": "node", "env": []}]}
    if subdomain:
        spec["subdomain"] = subdomain
    if nnodes is not None:
        spec["containers"][0]["env"].append({"name": "PET_NNODES", "value": nnodes})
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": spec}


def _tj(pod: dict[str, Any], job: dict[str, Any] | None = None, k: int = 1) -> ReplicaPeers:
    return replica_peers(TRAINJOB, job or _trainjob(), pod, peers=k, port=7471)


def test_trainjob_ranks_are_completion_indices_under_the_jobset_service() -> None:
    assert _tj(_tj_pod("0")) == ReplicaPeers(0, 4, ("llm-node-0-1.llm.team-a.svc:7471",))
    assert _tj(_tj_pod("3")).peers == ("llm-node-0-0.llm.team-a.svc:7471",)
    assert _tj(_tj_pod("2"), k=2).peers == (
        "llm-node-0-3.llm.team-a.svc:7471",
        "llm-node-0-0.llm.team-a.svc:7471",
    )


def test_trainjob_index_from_the_annotation_and_the_pods_subdomain() -> None:
    pod = _tj_pod("1", as_annotation=True, subdomain="llm-net")
    assert _tj(pod).peers == ("llm-node-0-2.llm-net.team-a.svc:7471",)


def test_trainjob_world_from_pet_nnodes_when_the_trainjob_has_none() -> None:
    assert _tj(_tj_pod("1", nnodes="2"), _trainjob(None)).peers == (
        "llm-node-0-0.llm.team-a.svc:7471",
    )
    assert _tj(_tj_pod("1", nnodes="3"), _trainjob(2)).world == 2  # the TrainJob wins


def test_trainjob_of_one_node_is_off() -> None:
    got = _tj(_tj_pod("0"), _trainjob(1))
    assert (got.rank, got.world, got.on) == (0, 1, False)
    assert got.off is not None and "world of one" in got.off


@pytest.mark.parametrize(
    ("pod", "job", "why"),
    [
        (_tj_pod(None), None, "not an Indexed Job pod of a JobSet"),
        (_tj_pod("x"), None, "not an Indexed Job pod of a JobSet"),
        (_tj_pod("0", job_index="1"), None, "more than one Job"),
        (_tj_pod("0", job_index="y"), None, "more than one Job"),
        (_tj_pod("0"), _trainjob(None), "no node count"),
        (_tj_pod("0", nnodes="many"), _trainjob(None), "no node count"),
        (_tj_pod("0"), _trainjob(0), "no node count"),
        (_tj_pod("4"), None, "completion index 4 is beyond the 4 nodes"),
    ],
)
def test_trainjob_unknown_rank_is_off(
    pod: dict[str, Any], job: dict[str, Any] | None, why: str
) -> None:
    got = _tj(pod, job)
    assert got.peers == () and got.rank is None
    assert got.off is not None and why in got.off


def test_trainjob_pod_without_the_replicated_job_label_is_off() -> None:
    pod = _tj_pod("0")
    del pod["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"]
    got = _tj(pod)
    assert got.off is not None and "replicatedjob-name" in got.off
