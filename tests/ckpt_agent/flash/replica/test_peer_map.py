"""The sidecar's peers (flash.replica.peer_map): the operator's peer map file over the
webhook's ring, re-read on a period; a missing or malformed map means the ring, logged once
per change, never an error; every peer ever named is remembered for a recreated rank."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ckpt_agent.flash.replica.client import Peer
from ckpt_agent.flash.replica.peer_map import MAX_MAP_BYTES, PeerMap, parse_peers

RING = (Peer("job-worker-1.ns.svc", 7471),)
B = Peer("job-worker-3.ns.svc", 7471)
C = Peer("job-worker-2.ns.svc", 7471)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_parse_peers() -> None:
    assert parse_peers(" a:1, [::1]:2 ,,b.c:65535", "X") == (
        Peer("a", 1),
        Peer("::1", 2),
        Peer("b.c", 65535),
    )
    assert parse_peers("", "X") == ()
    for bad, why in (("a", "is not host:port"), ("a:0", "is not host:port"), ("a:1,a:1", "twice")):
        with pytest.raises(ValueError, match=why) as e:
            parse_peers(bad, "CKPT_X")
        assert "CKPT_X" in str(e.value)


def test_no_map_file_is_the_ring_forever(tmp_path: Path) -> None:
    peers = PeerMap(RING)
    assert peers.peers == RING and peers.source == "ring" and peers.due_in() is None
    assert not peers.refresh(force=True)


def test_the_map_replaces_the_ring_once_it_is_there_and_is_read_on_its_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    file = tmp_path / "rank-0"
    with caplog.at_level(logging.INFO):
        peers = PeerMap(RING, file, refresh_s=10.0, clock=clock)
        assert peers.peers == RING and peers.source == "ring"
        assert peers.due_in() == 10.0
        clock.now += 5
        assert not peers.refresh()  # not due: the file is not read
        clock.now += 5
        assert peers.due_in() == 0 and not peers.refresh()  # due, still missing: no change
    assert caplog.text.count("no peer map") == 1  # once, not at every read
    file.write_text(f"{B},{C}\n")
    assert not peers.refresh()  # read 0 s ago
    clock.now += 10
    assert peers.refresh()
    assert peers.peers == (B, C) and peers.source == "map"
    assert peers.named == (B, C, *RING)
    clock.now += 10
    assert not peers.refresh()  # the same map: no change


@pytest.mark.parametrize(
    "content",
    [b"", b"  \n", b"not-a-peer", b"a:1,a:1", b"\xff\xfe", b"a:1," + b" " * MAX_MAP_BYTES],
    ids=["empty", "blank", "not-host-port", "twice", "not-utf8", "too-large"],
)
def test_a_malformed_map_means_the_ring_logged_once(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    file = tmp_path / "rank-0"
    file.write_text(str(B))
    peers = PeerMap(RING, file, refresh_s=1.0, clock=clock)
    assert peers.peers == (B,)
    file.write_bytes(content)
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            clock.now += 1
            peers.refresh()
    assert peers.peers == RING and peers.source == "ring"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "malformed" in errors[0].getMessage(), caplog.text
    assert peers.named == (*RING, B)  # B may still hold a replica: still named
    file.write_text(str(C))  # fixed: the map again
    clock.now += 1
    assert peers.refresh() and peers.peers == (C,)
    assert peers.named == (C, *RING, B)


def test_a_map_that_goes_away_means_the_ring_again(tmp_path: Path) -> None:
    clock = Clock()
    file = tmp_path / "rank-0"
    file.write_text(str(B))
    peers = PeerMap(RING, file, refresh_s=1.0, clock=clock)
    file.unlink()
    clock.now += 1
    assert peers.refresh() and peers.peers == RING and peers.named == (*RING, B)
