"""A snapshot's chunks and the offer (flash.replica.plan): exact coverage, checked fields."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from replica_helpers import CHUNK, make_snap, pattern

from ckpt_agent.errors import ReplicaError
from ckpt_agent.flash.checksums import fast_checksum
from ckpt_agent.flash.replica.plan import (
    Offer,
    check_disjoint,
    hashes_doc,
    parse_hashes_doc,
    plan_chunks,
)


def test_chunks_cover_every_tensor_and_file_exactly() -> None:
    snap = make_snap(
        {"w": pattern(2 * CHUNK + 10, 1), "a": pattern(CHUNK, 2), "z": b""},
        files={"f.json": b"{}"},
    )
    chunks = plan_chunks(snap.desc, snap.hashes, CHUNK)
    assert [(c.name, c.part, c.length) for c in chunks] == [
        ("a", 0, CHUNK),
        ("w", 0, CHUNK),
        ("w", 1, CHUNK),
        ("w", 2, 10),
        ("z", 0, 0),
        ("f.json", 0, 2),
    ]
    assert [c.index for c in chunks] == list(range(6))
    w = snap.desc.tensors["w"]
    assert [c.offset for c in chunks if c.name == "w"] == [
        w.offset,
        w.offset + CHUNK,
        w.offset + 2 * CHUNK,
    ]
    for c in chunks:
        assert c.ok(snap.view[c.offset : c.offset + c.length])
    assert not chunks[1].ok(b"\0" * CHUNK) and not chunks[1].ok(b"")


def test_hashes_at_another_chunk_size_are_refused() -> None:
    snap = make_snap({"w": pattern(3 * CHUNK, 1)})
    with pytest.raises(ReplicaError, match="another chunk size"):
        plan_chunks(snap.desc, snap.hashes, 2 * CHUNK)
    with pytest.raises(ReplicaError, match="must be positive"):
        plan_chunks(snap.desc, snap.hashes, 0)


def test_hashes_that_miss_a_name_name_an_extra_one_or_are_malformed_are_refused() -> None:
    snap = make_snap({"w": pattern(CHUNK, 1), "b": pattern(CHUNK, 2)})
    with pytest.raises(ReplicaError, match="'b'"):
        plan_chunks(snap.desc, {"w": snap.hashes["w"]}, CHUNK)
    with pytest.raises(ReplicaError, match="does not hold"):
        plan_chunks(snap.desc, {**snap.hashes, "ghost": ["0" * 64]}, CHUNK)
    with pytest.raises(ReplicaError, match="is not a SHA-256"):
        plan_chunks(snap.desc, {**snap.hashes, "w": ["XYZ"]}, CHUNK)


def test_an_offer_survives_its_header_and_a_tampered_one_is_refused() -> None:
    snap = make_snap({"w": pattern(2 * CHUNK, 1)})
    offer = Offer("node-a", snap.desc, snap.hashes, CHUNK)
    back = Offer.from_header(offer.to_header())
    assert back == offer
    header = offer.to_header()
    for key, value, words in [
        ("descriptor", 7, "no descriptor"),
        ("descriptor", "{}", "not a snapshot descriptor"),
        ("hashes", {"w": "abc"}, "hashes are not lists"),
        ("chunk_bytes", "1024", "not an integer"),
        ("source", "../etc", "invalid run id"),
    ]:
        with pytest.raises(ReplicaError, match=words):
            Offer.from_header({**header, key: value})
    with pytest.raises(ReplicaError, match="chunk digests"):
        Offer.from_header({**header, "hashes": {"w": snap.hashes["w"][:1]}})


def test_the_stored_hash_list_round_trips() -> None:
    snap = make_snap({"w": pattern(2 * CHUNK, 1)})
    offer = Offer("node-a", snap.desc, snap.hashes, CHUNK)
    chunks = offer.chunks()
    stored = parse_hashes_doc(hashes_doc(offer), "x")
    assert (stored.chunk_bytes, stored.sha256, stored.fast) == (CHUNK, snap.hashes, None)
    fast = {"w": [fast_checksum(snap.view[c.offset : c.offset + c.length]) for c in chunks]}
    assert parse_hashes_doc(hashes_doc(offer, fast), "x").fast == fast
    # fast checksums that do not cover every chunk, or of another scheme: not used
    doc = json.loads(hashes_doc(offer, {"w": fast["w"][:1]}))
    assert parse_hashes_doc(json.dumps(doc).encode(), "x").fast is None
    doc = json.loads(hashes_doc(offer, fast)) | {"fast_scheme": "crc32"}
    assert parse_hashes_doc(json.dumps(doc).encode(), "x").fast is None
    with pytest.raises(ValueError, match="x: "):
        parse_hashes_doc(b'{"format": "other"}', "x")


def test_overlapping_chunks_are_refused() -> None:
    snap = make_snap({"a": pattern(2 * CHUNK, 1), "b": pattern(CHUNK, 2), "e": b""})
    check_disjoint(plan_chunks(snap.desc, snap.hashes, CHUNK))  # a writer's layout
    a = snap.desc.tensors["a"]
    b = snap.desc.tensors["b"]
    over = replace(snap.desc, tensors={**snap.desc.tensors, "b": replace(b, offset=a.offset + 8)})
    with pytest.raises(ReplicaError, match="overlap"):
        check_disjoint(plan_chunks(over, snap.hashes, CHUNK))
