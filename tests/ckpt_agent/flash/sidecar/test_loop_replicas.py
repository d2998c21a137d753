"""The sidecar's replication hook (flash.sidecar.loop with SidecarOptions.replicas): every
handled snapshot is pushed to the peer on a background thread; a dead peer is counted,
never fatal, and the snapshot is persisted all the same."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from replica_helpers import RUN, SECRET, make_snap, write_slot

from ckpt_agent.flash.area import ShmArea
from ckpt_agent.flash.protocol import (
    Descriptor,
)
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.fetch import open_local
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore
from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions

pytestmark = pytest.mark.timeout(120)


def _snapshot(shm: Path, payload: bytes) -> Descriptor:
    """A trainer's complete snapshot of one uint8 tensor in slot 0 of rank 0."""
    snap = make_snap(
        {"w": payload}, seq=1, step=5, world_size=1, slot_index=0, meta={"token": "t1"}
    )
    write_slot(shm, snap)
    return snap.desc


def _wait(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def test_a_handled_snapshot_is_replicated_to_the_peer(
    tmp_path: Path, sidecar_on: Callable[..., Sidecar]
) -> None:
    store = ReplicaStore(tmp_path / "shm-b", RUN)
    server = ReplicaServer(store, JobScope("team-a", "job-1", SECRET), host="127.0.0.1").start()
    try:
        host, port = server.address
        sidecar = sidecar_on("a", f"{host}:{port}")
        payload = bytes(range(256)) * 12
        desc = _snapshot(tmp_path / "shm-a", payload)
        assert sidecar.run_once() == 1
        replicator = sidecar.replicator
        assert replicator is not None
        _wait(lambda: replicator.pushed == 1 and replicator.idle())
        with open_local(store, "node-a", 0) as replica:
            assert replica.desc == desc and bytes(replica.tensor("w")) == payload
            del replica
        _, details = sidecar.health()
        replicas = details["replicas"]
        assert isinstance(replicas, dict) and replicas["pushed"] == 1
        metrics = _scrape(sidecar)
        assert metrics['ckpt_sidecar_replica_pushes_total{outcome="pushed"}'] == 1
        assert metrics['ckpt_sidecar_replica_pushes_total{outcome="failed"}'] == 0
        assert metrics["ckpt_sidecar_replica_bytes_sent_total"] == len(payload)
        assert metrics["ckpt_sidecar_replica_last_pushed_step"] == 5
        assert metrics["ckpt_sidecar_replica_lag_seconds"] >= 0
        assert metrics["ckpt_sidecar_replica_peers"] == 1
        assert metrics["ckpt_sidecar_replicas_held"] == 0  # node a holds nobody's
    finally:
        server.close()


def _scrape(sidecar: Sidecar) -> dict[str, float]:
    """The sidecar's metrics as Prometheus would read them: ``name{labels}`` → value."""
    text = generate_latest(sidecar.metrics.registry).decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_a_dead_peer_is_counted_and_the_snapshot_persisted_all_the_same(
    tmp_path: Path, sidecar_on: Callable[..., Sidecar]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    sidecar = sidecar_on("a", f"127.0.0.1:{dead}")
    _snapshot(tmp_path / "shm-a", b"\x07" * 3000)
    assert sidecar.run_once() == 1
    replicator = sidecar.replicator
    assert replicator is not None
    _wait(lambda: replicator.failed == 1 and replicator.idle())
    assert sidecar.persisted == 1 and sidecar.failed == 0
    metrics = _scrape(sidecar)
    assert metrics['ckpt_sidecar_replica_pushes_total{outcome="failed"}'] == 1
    assert metrics["ckpt_sidecar_replica_last_pushed_step"] == -1
    mark = ShmArea(tmp_path / "shm-a", RUN, 0).persisted()
    assert mark is not None and mark.ok and mark.committed


def test_replication_is_off_by_default() -> None:
    assert SidecarOptions().replicas is None


def test_a_replication_that_cannot_start_leaves_persisting_on(
    tmp_path: Path, sidecar_on: Callable[..., Sidecar]
) -> None:
    sidecar = sidecar_on("a", "127.0.0.1:9", secret_file=tmp_path / "no-such-secret")
    assert sidecar.replicator is None
    _snapshot(tmp_path / "shm-a", b"\x01" * 100)
    assert sidecar.run_once() == 1 and sidecar.persisted == 1
    events = (tmp_path / "work-a" / "sidecar.jsonl").read_text()
    assert '"replication_off"' in events and "cannot read the replica secret" in events
