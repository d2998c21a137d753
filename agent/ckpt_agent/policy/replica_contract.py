"""Peer replication's contract between the webhook and ``ckpt sidecar`` (docs/replicas.md).

The operator's webhook sets these variables on the sidecar container of a job whose policy
has ``spec.agent.replicas.enabled``; the sidecar reads them into its replication options
(:mod:`ckpt_agent.flash.sidecar.replica_env`). One home for the names and defaults, so the
two sides cannot drift. Standard library only: the operator imports it.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DEFAULT_REPLICA_PORT",
    "ENV_REPLICA_JOB",
    "ENV_REPLICA_LISTEN_HOST",
    "ENV_REPLICA_PEERS",
    "ENV_REPLICA_PEERS_DIR",
    "ENV_REPLICA_PEERS_REFRESH_S",
    "ENV_REPLICA_PORT",
    "ENV_REPLICA_RANK",
    "ENV_REPLICA_SECRET_FILE",
    "MAX_REPLICA_PEERS",
    "REPLICA_PEERS_KEY_PREFIX",
    "REPLICA_SECRET_KEY",
    "peers_map_key",
]

#: The sidecar's replica port when the policy names none (``spec.agent.replicas.port``).
DEFAULT_REPLICA_PORT: Final = 7471
#: The most peers one node pushes to (``spec.agent.replicas.peers``).
MAX_REPLICA_PEERS: Final = 3

ENV_REPLICA_PORT: Final = "CKPT_REPLICA_PORT"
"""The port this sidecar serves its peers on (set: replication is on)."""
ENV_REPLICA_LISTEN_HOST: Final = "CKPT_REPLICA_LISTEN_HOST"
"""The address this sidecar serves its peers on (default ``0.0.0.0``, every address of the
pod; not set by the webhook: for a pod that shares its network with others, e.g. a test
harness running pods as local processes, each on its own loopback address)."""
ENV_REPLICA_PEERS: Final = "CKPT_REPLICA_PEERS"
"""Comma-separated ``host:port`` of the peers this sidecar pushes to (empty: serve only):
the ring the webhook chose at admission, used until the operator's peer map is there."""
ENV_REPLICA_RANK: Final = "CKPT_REPLICA_RANK"
"""This pod's place among the job's replicating pods (its key in the peer map)."""
ENV_REPLICA_PEERS_DIR: Final = "CKPT_REPLICA_PEERS_DIR"
"""Where the job's peer map (the ConfigMap ``ckpt-replica-peers-<job>``) is mounted: one
file per rank, :func:`peers_map_key`, holding that rank's peers as ``host:port,…``."""
ENV_REPLICA_PEERS_REFRESH_S: Final = "CKPT_REPLICA_PEERS_REFRESH_S"
"""Seconds between two reads of the peer map (default 10; not set by the webhook)."""
ENV_REPLICA_SECRET_FILE: Final = "CKPT_REPLICA_SECRET_FILE"
"""The mounted per-job secret (a file)."""
ENV_REPLICA_JOB: Final = "CKPT_REPLICA_JOB"
"""``namespace/job``: the job the connections are scoped to."""
#: The key of the per-job Secret that holds the replica secret.
REPLICA_SECRET_KEY: Final = "secret"
#: The peer map's keys: ``rank-<r>``.
REPLICA_PEERS_KEY_PREFIX: Final = "rank-"


def peers_map_key(rank: int) -> str:
    """The peer map's key (a file of the mounted ConfigMap) of pod rank ``rank``."""
    if rank < 0:
        raise ValueError(f"a rank is >= 0, not {rank}")
    return f"{REPLICA_PEERS_KEY_PREFIX}{rank}"
