"""Publishing each replicating job's rack/zone-aware peer map (docs/replicas.md, "Peers").

A pod event of a replicating pod (its sidecar has ``CKPT_REPLICA_RANK``,
:func:`~ckpt_operator.planners.replica_peer_map.replicating_pod`) on a node: once every
rank of its job has a live pod on a node
(:func:`~ckpt_operator.planners.replica_peer_map.scheduled_ranks`), :func:`publish_peer_map`
reads the nodes' zone and rack labels (the node watch's :class:`~.state.NodeLabels`, one
API read per node it has not seen), chooses the peers
(:mod:`ckpt_operator.planners.replica_topology`, in a worker thread: about a second for a
thousand ranks) and creates the ConfigMap ``ckpt-replica-peers-<job>``, owned by the job,
with a ``ReplicaPeersChosen`` Event saying how far the peers are.

Made once, never changed (a ConfigMap of that name that exists, made by an operator before
a restart or by hand, is left as it is): a rank recreated on another node keeps the peers
that hold its replicas. A failure is logged and retried at the job's next pod event; the
sidecars push to the ring meanwhile, so nothing waits for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from ckpt_operator.adapters.kube import ApiError
from ckpt_operator.behaviours.deps import Deps, cached_job
from ckpt_operator.kinds.registry import owner_of
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.planners.replica_peer_map import (
    ScheduledRanks,
    peer_map,
    replicating_pod,
    scheduled_ranks,
)
from ckpt_operator.planners.replica_peers import layout
from ckpt_operator.planners.replica_topology import ZONE_LABEL

__all__ = ["publish_peer_map"]

log = logging.getLogger(__name__)


async def _labels(deps: Deps, nodes: set[str], keys: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """The zone and rack labels of ``nodes``: from the node watch, else one read each (a
    node gone: no labels)."""
    out: dict[str, dict[str, str]] = {}
    for name in sorted(nodes):
        got = deps.node_labels.get(name)
        if got is None:
            node = await deps.api.get_node(name)
            labels = meta_of(node).labels if node is not None else {}
            deps.node_labels.note(name, labels, keys)
            got = deps.node_labels.get(name) or {}
        out[name] = got
    return out


async def publish_peer_map(deps: Deps, pod: Mapping[str, Any]) -> str:
    """Make the peer map of ``pod``'s job when it is due (see the module doc); what was
    done, for the log and the tests: ``not replicating``, ``done already``, ``waiting: …``,
    ``created``, ``exists`` or ``failed: …``."""
    mine = replicating_pod(pod)
    owner = owner_of(pod)
    if mine is None or mine.node is None or owner is None:
        return "not replicating"
    kind, job_name = owner
    namespace = str(meta_of(pod).namespace or "")
    job = await cached_job(deps, namespace, job_name, kind=kind)
    uid = str(meta_of(job).uid or "") if job is not None else ""
    if job is None or not uid:
        return "waiting: the job is not known"
    if deps.peer_maps.done(uid):
        return "done already"
    hosts = layout(kind, job, pod, namespace).hosts
    ranks = scheduled_ranks(hosts, deps.pod_index(kind).of_job(namespace, job_name))
    if not isinstance(ranks, ScheduledRanks):
        return f"waiting: {ranks}"
    rack = deps.config.replica_rack_label or None
    keys = (ZONE_LABEL, rack) if rack else (ZONE_LABEL,)
    try:
        labels = await _labels(deps, set(ranks.nodes), keys)
        body, summary = await asyncio.to_thread(peer_map, job, kind, ranks, labels, rack)
        created = await deps.api.create_config_map(body)
    except (ApiError, ValueError) as e:
        log.warning("the replica peer map of %s/%s is not made: %s", namespace, job_name, e)
        return f"failed: {e}"
    deps.peer_maps.mark(uid)
    name = body["metadata"]["name"]
    if not created:
        return "exists"
    deps.events.emit(
        job,
        "Normal",
        "ReplicaPeersChosen",
        f"ConfigMap {name}: replica peers chosen from the nodes' zones and racks ({summary})",
    )
    return "created"
