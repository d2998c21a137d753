"""Fixtures of the replica tests: a job scope, a store, a started server on 127.0.0.1, a
condition to wait for; :mod:`replica_helpers` importable from the tests."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.client import Peer
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore

HERE = os.path.dirname(__file__)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from replica_helpers import RUN, SECRET  # noqa: E402


@pytest.fixture
def scope() -> JobScope:
    return JobScope("team-a", "job-1", SECRET)


@pytest.fixture
def store(tmp_path: Path) -> ReplicaStore:
    return ReplicaStore(tmp_path / "shm-b", RUN)


@pytest.fixture
def serve(
    store: ReplicaStore, scope: JobScope
) -> Iterator[Callable[..., tuple[ReplicaServer, Peer]]]:
    """Start a server (over ``store`` and ``scope`` unless given) on 127.0.0.1."""
    started: list[ReplicaServer] = []

    def start(**kw: object) -> tuple[ReplicaServer, Peer]:
        st = kw.pop("store", store)
        sc = kw.pop("scope", scope)
        kw.setdefault("timeout_s", 5.0)
        server = ReplicaServer(st, sc, host="127.0.0.1", **kw).start()  # type: ignore[arg-type]
        started.append(server)
        host, port = server.address
        return server, Peer(host, port)

    yield start
    for server in started:
        server.close()


@pytest.fixture
def wait_for() -> Callable[[Callable[[], bool]], None]:
    """Wait until a condition holds (10 s at most, then fail: the condition never held)."""

    def wait(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
        deadline = time.monotonic() + limit_s
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError("the condition never held")
            time.sleep(0.01)

    return wait
