"""A replicating job's peer map: the ConfigMap ``ckpt-replica-peers-<job>``. Pure.

The webhook gives every replicating pod its rank (``CKPT_REPLICA_RANK``) and the ring's
peers (``CKPT_REPLICA_PEERS``), and mounts this ConfigMap (optional) into its sidecar at
:data:`~ckpt_operator.planners.replica_injection.PEERS_MAP_DIR`. Once every rank has a pod
on a node (:func:`scheduled_ranks`), the operator
(:mod:`ckpt_operator.behaviours.replica_maps`) chooses the peers from the nodes' zone and
rack labels (:func:`~ckpt_operator.planners.replica_topology.choose_peers`) and creates
the ConfigMap (:func:`peer_map`):

* ``rank-<r>``: rank ``r``'s peers, ``host:port,…`` by the same stable names as the ring
  (the sidecar's file, :func:`~ckpt_agent.policy.replica_contract.peers_map_key`);
* ``plan.json``: for people: each rank's node, zone, rack, peer ranks and how far each
  peer is (``zone``, ``rack``, ``node``, ``same-node``);

labelled :data:`PEER_MAP_LABEL`, owned by the job (deleted with it). It is made once and
never changed: a rank whose pod is recreated on another node keeps its peers, which hold
its replicas (its sidecar asks them when it starts), and the ranks that pushed to it push
to its new node under the same name. A restart ``J-r<k>`` is a new job with its own map.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ckpt_agent.policy.replica_contract import (
    ENV_REPLICA_PEERS,
    ENV_REPLICA_PORT,
    ENV_REPLICA_RANK,
    peers_map_key,
)
from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.names import derived_name
from ckpt_operator.planners.replica_topology import (
    Placement,
    Separation,
    choose_peers,
    separation,
)

__all__ = [
    "PEER_MAP_LABEL",
    "PLAN_KEY",
    "ReplicatingPod",
    "ScheduledRanks",
    "peer_map",
    "replica_peers_map_name",
    "replicating_pod",
    "scheduled_ranks",
]

PEER_MAP_LABEL: Final = "ckpt.dev/replica-peers"
"""Label of the peer maps the operator makes (value ``chosen``)."""
PLAN_KEY: Final = "plan.json"
_SEPARATION_NAMES: Final = {
    Separation.ZONE: "zone",
    Separation.RACK: "rack",
    Separation.NODE: "node",
    Separation.SAME_NODE: "same-node",
}


def replica_peers_map_name(job_name: str) -> str:
    """``ckpt-replica-peers-<job>`` (a digest keeps a long name within 253 characters, as
    the replica Secret's)."""
    return derived_name("ckpt-replica-peers-", job_name)


@dataclass(frozen=True)
class ReplicatingPod:
    """What the webhook gave a pod's sidecar, and where the pod runs."""

    rank: int
    port: int
    peers: int
    """How many peers the ring names (the policy's ``peers``, capped at the world - 1)."""
    node: str | None


def _count(value: object) -> int | None:
    return int(value) if isinstance(value, str) and value.isdigit() else None


def replicating_pod(pod: Mapping[str, Any]) -> ReplicatingPod | None:
    """The pod's replication as its sidecar's env says (None: it does not replicate, or
    that env is not the webhook's)."""
    spec = Body(pod).spec
    for ctr in [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]:
        env = {
            e.get("name"): e.get("value")
            for e in (ctr.get("env") or () if isinstance(ctr, Mapping) else ())
            if isinstance(e, Mapping)
        }
        rank, port = _count(env.get(ENV_REPLICA_RANK)), _count(env.get(ENV_REPLICA_PORT))
        if rank is None or port is None:
            continue
        ring = str(env.get(ENV_REPLICA_PEERS) or "")
        node = spec.get("nodeName")
        return ReplicatingPod(
            rank,
            port,
            len([p for p in ring.split(",") if p.strip()]),
            node if isinstance(node, str) and node else None,
        )
    return None


def _live(pod: Mapping[str, Any]) -> bool:
    phase = Body(pod).status.get("phase")
    return meta_of(pod).deletion_timestamp is None and phase not in ("Succeeded", "Failed")


@dataclass(frozen=True)
class ScheduledRanks:
    """Every rank of a job with its pod's node: the peer map can be chosen."""

    hosts: tuple[str, ...]
    """``hosts[r]``: rank ``r``'s stable name (as in the ring)."""
    nodes: tuple[str, ...]
    port: int
    peers: int


def scheduled_ranks(
    hosts: Sequence[str], pods: Sequence[Mapping[str, Any]]
) -> ScheduledRanks | str:
    """The job's ranks on their nodes, from its pods (those ending or gone left out), for
    a world of ``len(hosts)`` ranks; else why not yet (a rank without a pod or a node)."""
    found: dict[int, ReplicatingPod] = {}
    for pod in pods:
        got = replicating_pod(pod) if _live(pod) else None
        if got is not None and 0 <= got.rank < len(hosts) and got.node is not None:
            found[got.rank] = got
    missing = [r for r in range(len(hosts)) if r not in found]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", …" if len(missing) > 8 else "")
        return f"rank(s) {shown} of {len(hosts)} not on a node yet"
    if len(hosts) < 2:
        return "a world of one node has no peer"
    ports = {p.port for p in found.values()}
    if len(ports) != 1:
        return f"the pods serve replicas on different ports ({sorted(ports)})"
    return ScheduledRanks(
        tuple(hosts),
        tuple(str(found[r].node) for r in range(len(hosts))),
        ports.pop(),
        max(p.peers for p in found.values()),
    )


def peer_map(
    job: Mapping[str, Any],
    kind: JobKind,
    ranks: ScheduledRanks,
    node_labels: Mapping[str, Mapping[str, Any]],
    rack_label: str | None,
) -> tuple[dict[str, Any], str]:
    """The ConfigMap of ``job`` (see the module doc) for ``ranks``, the nodes' labels
    (``node_labels[node]``; a node missing: no labels) and the operator's rack label; and
    a one-line summary (how many peers are how far from their rank).

    Raises ValueError when the job has no name, namespace or uid (an owner needs them)."""
    meta = meta_of(job)
    name, namespace, uid = meta.name, meta.namespace, meta.uid
    if not (name and namespace and uid):
        raise ValueError("the job needs a name, a namespace and a uid to own its peer map")
    place = [Placement.of(n, node_labels.get(n) or {}, rack_label) for n in ranks.nodes]
    chosen = choose_peers(place, ranks.peers)
    data = {
        peers_map_key(r): ",".join(f"{ranks.hosts[p]}:{ranks.port}" for p in peers)
        for r, peers in enumerate(chosen)
    }
    seps = Counter(separation(place[r], place[p]) for r, peers in enumerate(chosen) for p in peers)
    plan = {
        "world": len(place),
        "peers": ranks.peers,
        "zoneLabel": "topology.kubernetes.io/zone",
        "rackLabel": rack_label or None,
        "ranks": [
            {
                "rank": r,
                "node": pl.node,
                "zone": pl.zone,
                "rack": pl.rack,
                "peers": list(chosen[r]),
                "apart": [_SEPARATION_NAMES[separation(pl, place[p])] for p in chosen[r]],
            }
            for r, pl in enumerate(place)
        ],
    }
    data[PLAN_KEY] = json.dumps(plan, indent=1, sort_keys=True)
    total = sum(seps.values())
    summary = f"{len(place)} ranks, {ranks.peers} peer(s) each: " + ", ".join(
        f"{seps[s]} of {total} in another {_SEPARATION_NAMES[s]}"
        if s is not Separation.SAME_NODE
        else f"{seps[s]} of {total} on the same node"
        for s in sorted(seps, reverse=True)
    )
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": replica_peers_map_name(str(name)),
            "namespace": str(namespace),
            "labels": {PEER_MAP_LABEL: "chosen", "app.kubernetes.io/managed-by": "ckpt-operator"},
            "ownerReferences": [
                {
                    "apiVersion": kind.api_version,
                    "kind": kind.kind,
                    "name": str(name),
                    "uid": str(uid),
                }
            ],
        },
        "data": data,
    }
    return body, summary
