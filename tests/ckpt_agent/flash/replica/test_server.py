"""The receiving server (flash.replica.server): a bounded number of connections, and a
close that cuts pushes in flight without publishing them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from replica_helpers import CHUNK, make_snap, pattern

from ckpt_agent.errors import ReplicaError
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.client import Peer, open_connection
from ckpt_agent.flash.replica.fetch import list_replicas
from ckpt_agent.flash.replica.plan import Offer
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore

pytestmark = pytest.mark.timeout(60)

Serve = Callable[..., tuple[ReplicaServer, Peer]]


def test_connections_beyond_the_bound_are_refused(
    serve: Serve, scope: JobScope, wait_for: Callable[..., None]
) -> None:
    server, peer = serve(max_connections=1)
    held = open_connection(peer, scope)  # authenticated, holds the only slot
    try:
        with pytest.raises(ReplicaError, match="too many replica connections"):
            list_replicas(peer, scope)
        wait_for(lambda: server.stats.refused == 1)
    finally:
        held.close()
    wait_for(lambda: server.stats.failed == 1)  # the held one ended without a request
    assert list_replicas(peer, scope) == []


def test_close_cuts_a_push_in_flight_and_publishes_nothing(
    serve: Serve, scope: JobScope, store: ReplicaStore
) -> None:
    server, peer = serve()
    snap = make_snap({"w": pattern(3 * CHUNK, 1)})
    conn = open_connection(peer, scope)
    try:
        conn.send(Offer("node-a", snap.desc, snap.hashes, CHUNK).to_header())
        assert conn.expect("need").header["chunks"] == [0, 1, 2]
        assert len(store.folders("node-a", 0)) == 1  # being received
        server.close()
    finally:
        conn.close()
    assert store.folders("node-a", 0) == [] and store.replicas() == []
    assert server.stats.stored == 0 and server.stats.failed == 1


def test_an_unknown_request_is_refused(serve: Serve, scope: JobScope) -> None:
    _, peer = serve()
    conn = open_connection(peer, scope)
    try:
        conn.send({"t": "delete-everything"})
        with pytest.raises(ReplicaError, match="unknown replica request 'delete-everything'"):
            conn.expect("ok")
    finally:
        conn.close()
