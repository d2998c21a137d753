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
    "ENV_REPLICA_PEERS",
    "ENV_REPLICA_PORT",
    "ENV_REPLICA_SECRET_FILE",
    "MAX_REPLICA_PEERS",
    "REPLICA_SECRET_KEY",
]

#: The sidecar's replica port when the policy names none (``spec.agent.replicas.port``).
DEFAULT_REPLICA_PORT: Final = 7471
#: The most peers one node pushes to (``spec.agent.replicas.peers``).
MAX_REPLICA_PEERS: Final = 3

ENV_REPLICA_PORT: Final = "CKPT_REPLICA_PORT"
"""The port this sidecar serves its peers on (set: replication is on)."""
ENV_REPLICA_PEERS: Final = "CKPT_REPLICA_PEERS"
"""Comma-separated ``host:port`` of the peers this sidecar pushes to (empty: serve only)."""
ENV_REPLICA_SECRET_FILE: Final = "CKPT_REPLICA_SECRET_FILE"
"""The mounted per-job secret (a file)."""
ENV_REPLICA_JOB: Final = "CKPT_REPLICA_JOB"
"""``namespace/job``: the job the connections are scoped to."""
#: The key of the per-job Secret that holds the replica secret.
REPLICA_SECRET_KEY: Final = "secret"
