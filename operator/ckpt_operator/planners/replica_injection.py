"""The webhook's part of peer replication (docs/replicas.md): what the sidecar gets. Pure.

Called by :func:`ckpt_operator.planners.injection.build_pod_patch` once it built the native
sidecar, and only when the policy has ``spec.agent.replicas.enabled`` (otherwise nothing
changes). For a pod whose rank and peers are known (:mod:`ckpt_operator.planners.replica_peers`)
the sidecar gets:

* env: ``CKPT_REPLICA_PORT``, ``CKPT_REPLICA_PEERS`` (``host:port,…``: the ring),
  ``CKPT_REPLICA_SECRET_FILE``, ``CKPT_REPLICA_JOB`` (``namespace/job``),
  ``CKPT_REPLICA_RANK`` (its rank) and ``CKPT_REPLICA_PEERS_DIR``; ``CKPT_NODE_NAME``
  (the downward API's ``spec.nodeName``) it already has
  (:mod:`ckpt_agent.policy.replica_contract`, read by ``ckpt sidecar``);
* the job's peer map, the ConfigMap
  :func:`~ckpt_operator.planners.replica_peer_map.replica_peers_map_name`, at
  :data:`PEERS_MAP_DIR` (read-only, the whole ConfigMap: no ``subPath``, so the kubelet
  refreshes it; ``optional: true``: the operator makes it once every rank is scheduled,
  :mod:`ckpt_operator.behaviours.replica_maps`, and the sidecar uses the ring until then);
* a ``ckpt-replica`` container port;
* the job's Secret :func:`replica_secret_name` (key ``secret``) as a read-only file, mounted
  in the sidecar only. The operator issues it when it may (``--issue-replica-secrets``:
  :mod:`ckpt_operator.behaviours.replica_secrets`, before the pod is stored), else it is
  made by hand (docs/replicas.md). ``optional: true``, on purpose: a required one would
  leave every pod of a job without it stuck in ``ContainerCreating``; without the file the
  sidecar logs ``peer replication is off: cannot read the replica secret …`` and persists
  as usual (never unauthenticated: no secret, no replication).

When replication cannot be set up for the pod (a world of one, a rank the operator cannot
tell, the volume name or the port already taken in the pod) the pod is injected without it
and a note says why (the ``Injected`` Event and an admission warning).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_agent.policy.replica_contract import (
    ENV_REPLICA_JOB,
    ENV_REPLICA_PEERS,
    ENV_REPLICA_PEERS_DIR,
    ENV_REPLICA_PORT,
    ENV_REPLICA_RANK,
    ENV_REPLICA_SECRET_FILE,
    REPLICA_SECRET_KEY,
)
from ckpt_operator.kinds.registry import kind_of
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jsonpatch import JSONPatchOp, add
from ckpt_operator.model.names import derived_name
from ckpt_operator.planners.replica_peer_map import replica_peers_map_name
from ckpt_operator.planners.replica_peers import replica_peers

__all__ = [
    "PEERS_MAP_DIR",
    "REPLICA_PORT_NAME",
    "REPLICA_SECRET_DIR",
    "REPLICA_SECRET_PATH",
    "VOL_REPLICA",
    "VOL_REPLICA_PEERS",
    "add_replication",
    "mounts_replica_secret",
    "replica_secret_name",
]

VOL_REPLICA: Final = "ckpt-replica"
REPLICA_PORT_NAME: Final = "ckpt-replica"
REPLICA_SECRET_DIR: Final = "/etc/ckpt-replica"
REPLICA_SECRET_PATH: Final = f"{REPLICA_SECRET_DIR}/{REPLICA_SECRET_KEY}"
VOL_REPLICA_PEERS: Final = "ckpt-replica-peers"
PEERS_MAP_DIR: Final = "/etc/ckpt-replica-peers"


def replica_secret_name(job_name: str) -> str:
    """The per-job Secret holding the replica secret: ``ckpt-replica-<job>`` (a digest
    keeps a long name within 253 characters)."""
    return derived_name("ckpt-replica-", job_name)


def mounts_replica_secret(ops: Sequence[JSONPatchOp]) -> bool:
    """A pod patch mounts the job's replica Secret: the pod replicates."""
    return any(
        op["op"] == "add"
        and op["path"] == "/spec/volumes/-"
        and isinstance(op.get("value"), Mapping)
        and op["value"].get("name") == VOL_REPLICA
        for op in ops
    )


def _taken(pod_spec: Mapping[str, Any], port: int) -> str | None:
    for vol in pod_spec.get("volumes") or ():
        if vol.get("name") in (VOL_REPLICA, VOL_REPLICA_PEERS):
            return f"the pod already has a volume named {vol.get('name')!r}"
    for ctr in [*(pod_spec.get("containers") or ()), *(pod_spec.get("initContainers") or ())]:
        for p in ctr.get("ports") or ():
            if p.get("containerPort") == port or p.get("name") == REPLICA_PORT_NAME:
                return (
                    f"container {ctr.get('name')!r} already declares port {port} or "
                    f"{REPLICA_PORT_NAME!r} (choose another spec.agent.replicas.port)"
                )
    return None


def add_replication(
    ops: list[JSONPatchOp],
    sidecar: dict[str, Any],
    pod: Mapping[str, Any],
    spec: CheckpointPolicySpec,
    job: Mapping[str, Any] | None,
) -> list[str]:
    """Switch the injected ``sidecar`` (changed in place, before its op is made) to
    replicate, adding the Secret's volume to ``ops`` (after the pod's volumes were
    added); returns the notes (why a pod asked for replication does not get it)."""
    replicas = spec.agent.replicas
    if not replicas.enabled:
        return []
    if job is None:
        return ["peer replication off for this pod: its job is not known"]
    taken = _taken(Body(pod).spec, replicas.port)
    if taken:
        return [f"peer replication off for this pod: {taken}"]
    job_name = str(meta_of(job).name)
    ns = str(meta_of(job).namespace or meta_of(pod).namespace or "")
    plan = replica_peers(
        kind_of(job), job, pod, peers=replicas.peers, port=replicas.port, namespace=ns
    )
    if not plan.on:
        return [f"peer replication off for this pod: {plan.off}"]
    sidecar["env"] = [
        *sidecar["env"],
        {"name": ENV_REPLICA_PORT, "value": str(replicas.port)},
        {"name": ENV_REPLICA_PEERS, "value": ",".join(plan.peers)},
        {"name": ENV_REPLICA_SECRET_FILE, "value": REPLICA_SECRET_PATH},
        {"name": ENV_REPLICA_JOB, "value": f"{ns}/{job_name}"},
        {"name": ENV_REPLICA_RANK, "value": str(plan.rank)},
        {"name": ENV_REPLICA_PEERS_DIR, "value": PEERS_MAP_DIR},
    ]
    sidecar["ports"] = [
        *sidecar["ports"],
        {"name": REPLICA_PORT_NAME, "containerPort": replicas.port, "protocol": "TCP"},
    ]
    sidecar["volumeMounts"] = [
        *sidecar["volumeMounts"],
        {"name": VOL_REPLICA, "mountPath": REPLICA_SECRET_DIR, "readOnly": True},
        {"name": VOL_REPLICA_PEERS, "mountPath": PEERS_MAP_DIR, "readOnly": True},
    ]
    volume = {
        "name": VOL_REPLICA,
        "secret": {
            "secretName": replica_secret_name(job_name),
            "items": [{"key": REPLICA_SECRET_KEY, "path": REPLICA_SECRET_KEY}],
            "optional": True,
        },
    }
    ops.append(add("/spec/volumes/-", volume))
    peer_map = {
        "name": VOL_REPLICA_PEERS,
        "configMap": {"name": replica_peers_map_name(job_name), "optional": True},
    }
    ops.append(add("/spec/volumes/-", peer_map))
    return []
