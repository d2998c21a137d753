"""``ckpt sidecar`` as the pod runs it (a process, the webhook's environment, real sockets)
switching peers when the operator's peer map appears, changes and turns malformed.

Node a's sidecar starts with the ring's peer b (``CKPT_REPLICA_PEERS``) and the peer map's
folder empty (the ConfigMap not published yet: an optional volume mounts empty). Then
``rank-0`` names c: the snapshot a pushed to b reaches c whole without a new snapshot, and
the next snapshot goes to c only. A malformed map sends the next snapshot to the ring
again, logged once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from replica_helpers import RUN, SECRET, make_snap, pattern, write_slot

from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SCOPE = JobScope("team-a", "job-1", SECRET)


def _held_seq(store: ReplicaStore) -> int | None:
    """The seq of node a's rank-0 replica that ``store`` holds (None: none)."""
    held = [r.desc.seq for r in store.replicas() if (r.source, r.rank) == ("node-a", 0)]
    return max(held) if held else None


def _wait(cond: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} never happened; sidecar log:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


@pytest.fixture
def peers(tmp_path: Path) -> Iterator[dict[str, tuple[ReplicaStore, str]]]:
    """Nodes b and c: a replica store and its server each, ``host:port``."""
    out: dict[str, tuple[ReplicaStore, str]] = {}
    servers = []
    for node in ("b", "c"):
        store = ReplicaStore(tmp_path / f"shm-{node}", RUN)
        server = ReplicaServer(store, SCOPE, host="127.0.0.1", timeout_s=5.0).start()
        servers.append(server)
        host, port = server.address
        out[node] = (store, f"{host}:{port}")
    yield out
    for server in servers:
        server.close()


def test_the_sidecar_process_follows_the_peer_map(
    tmp_path: Path, peers: dict[str, tuple[ReplicaStore, str]]
) -> None:
    (store_b, peer_b), (store_c, peer_c) = peers["b"], peers["c"]
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    shm, folder = tmp_path / "shm-a", tmp_path / "peer-map"
    folder.mkdir()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CKPT_")},
        "CKPT_RUN_ID": RUN,
        "CKPT_STORAGE_URL": (tmp_path / "store").as_uri(),
        "CKPT_SHM_DIR": str(shm),
        "CKPT_WORK_DIR": str(tmp_path / "work-a"),
        "CKPT_NODE_NAME": "node-a",
        "CKPT_REPLICA_PEERS": peer_b,
        "CKPT_REPLICA_SECRET_FILE": str(secret),
        "CKPT_REPLICA_JOB": "team-a/job-1",
        "CKPT_REPLICA_RANK": "0",
        "CKPT_REPLICA_PEERS_DIR": str(folder),
        "CKPT_REPLICA_PEERS_REFRESH_S": "0.1",
    }
    with socket.socket() as s:  # a free port for the sidecar's own server
        s.bind(("127.0.0.1", 0))
        env["CKPT_REPLICA_PORT"] = str(s.getsockname()[1])
    log = tmp_path / "sidecar.log"
    cmd = [sys.executable, "-m", "ckpt_agent.cli.main", "sidecar", "--metrics-port", "0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        snaps = [
            make_snap({"w": pattern(5000, i)}, seq=i, step=10 * i, world_size=1)
            for i in range(1, 4)
        ]
        write_slot(shm, snaps[0])
        _wait(lambda: _held_seq(store_b) == 1, "the ring's push to b", proc, log)
        assert _held_seq(store_c) is None

        (folder / "rank-0").write_text(f"{peer_c}\n")  # the operator's choice: c
        _wait(lambda: _held_seq(store_c) == 1, "the held snapshot's push to c", proc, log)
        write_slot(shm, snaps[1])
        _wait(lambda: _held_seq(store_c) == 2, "the next snapshot's push to c", proc, log)
        assert _held_seq(store_b) == 1  # b is no longer pushed to

        (folder / "rank-0").write_text("not a peer")  # malformed: back to the ring
        time.sleep(0.5)  # a few reads of the map
        write_slot(shm, snaps[2])
        _wait(lambda: _held_seq(store_b) == 3, "the push to the ring again", proc, log)
        assert _held_seq(store_c) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert text.count("the peer map is malformed") == 1, text[-4000:]
    assert "the operator's peer map" in text and "Traceback" not in text, text[-4000:]
