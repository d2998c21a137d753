"""The sidecar tests share the replica tests' helpers (small snapshots, the job's secret)
and :func:`sidecar_on`: a node's replicating sidecar."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPLICA_TESTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "replica")
if REPLICA_TESTS not in sys.path:
    sys.path.insert(0, REPLICA_TESTS)

from replica_helpers import CHUNK, RUN, SECRET  # noqa: E402

from ckpt_agent.flash.replica.replicator import ReplicaOptions  # noqa: E402
from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions  # noqa: E402
from ckpt_agent.policy import AgentConfig  # noqa: E402


@pytest.fixture
def sidecar_on(tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    """``sidecar_on(node, *peers)``: node ``node``'s sidecar (shared memory ``shm-<node>``,
    work dir ``work-<node>`` under ``tmp_path``) replicating with ``peers`` (``host:port``;
    ``replicating=False``: no replication; ``secret_file``: another secret). Closed after
    the test; other keywords: more :class:`ReplicaOptions`)."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    made: list[Sidecar] = []

    def build(
        node: str,
        *peers: str,
        replicating: bool = True,
        secret_file: Path = secret,
        **replica_kw: Any,
    ) -> Sidecar:
        config = AgentConfig.model_validate(
            {
                "runId": RUN,
                "storageUrl": (tmp_path / "store").as_uri(),
                "shmDir": str(tmp_path / f"shm-{node}"),
                "workDir": str(tmp_path / f"work-{node}"),
                "validation": {"loadInSubprocess": False},
            }
        )
        options = ReplicaOptions(
            node=f"node-{node}",
            namespace="team-a",
            job_id="job-1",
            secret_file=str(secret_file),
            peers=peers,
            timeout_s=5.0,
            chunk_bytes=CHUNK,
            **replica_kw,
        )
        sidecar = Sidecar(
            config, SidecarOptions(metrics_port=0, replicas=options if replicating else None)
        )
        made.append(sidecar)
        return sidecar

    yield build
    for s in made:
        s.close()
