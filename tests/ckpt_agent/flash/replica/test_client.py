"""The sender's side (flash.replica.client): peer addresses, hashes computed when none were
recorded, a snapshot too short for its descriptor refused before connecting."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from replica_helpers import CHUNK, make_snap, pattern

from ckpt_agent.errors import ReplicaError
from ckpt_agent.flash.checksums import RecordedHashes
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.client import Peer, push
from ckpt_agent.flash.replica.fetch import fetch
from ckpt_agent.flash.replica.server import ReplicaServer

pytestmark = pytest.mark.timeout(60)

Serve = Callable[..., tuple[ReplicaServer, Peer]]


@pytest.mark.parametrize(
    ("text", "peer", "shown"),
    [
        ("node-b.ns.svc:7070", Peer("node-b.ns.svc", 7070), "node-b.ns.svc:7070"),
        ("10.0.0.2:1", Peer("10.0.0.2", 1), "10.0.0.2:1"),
        ("[fd00::2]:7070", Peer("fd00::2", 7070), "[fd00::2]:7070"),
    ],
)
def test_peer_addresses_parse_and_show(text: str, peer: Peer, shown: str) -> None:
    assert Peer.parse(text) == peer and str(peer) == shown


@pytest.mark.parametrize("text", ["node-b", ":7070", "node-b:0", "node-b:70000", "node-b:x"])
def test_a_bad_peer_address_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected host:port"):
        Peer.parse(text)


def test_hashes_are_computed_when_none_were_recorded(serve: Serve, scope: JobScope) -> None:
    snap = make_snap({"w": pattern(3 * CHUNK, 1)}, files={"meta.json": b"{}"})
    _, peer = serve()
    result = push(peer, scope, snap.desc, snap.view, None, source="node-a", chunk_bytes=CHUNK)
    assert result.chunks_sent == 4
    got = fetch(peer, scope, "node-a", 0)
    assert bytes(got.tensor("w")) == snap.tensor("w") and bytes(got.file("meta.json")) == b"{}"
    recorded = RecordedHashes(snap.hashes)
    again = push(peer, scope, snap.desc, snap.view, recorded, source="node-a", chunk_bytes=CHUNK)
    assert again.already  # the recorded hashes are the same digests


def test_a_view_shorter_than_the_snapshot_is_refused_before_connecting(scope: JobScope) -> None:
    snap = make_snap({"w": pattern(CHUNK, 1)})
    with pytest.raises(ReplicaError, match="bytes given for a"):
        push(
            Peer("127.0.0.1", 9),
            scope,
            snap.desc,
            snap.view[:100],
            snap.hashes,
            source="node-a",
            chunk_bytes=CHUNK,
        )
