"""The shared-memory snapshot checks: fast checksums, recorded hashes, checked copies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_agent.flash.checksums import (
    FAST_SCHEME,
    RecordedHashes,
    chunk_hashes,
    fast_checksum,
    fast_checksums,
)
from ckpt_agent.flash.reader import ShmReader, verify_views
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.shm.in_place import copy_snapshot, regions, shm_offers
from ckpt_agent.runtime.shm.writer import ShmWriter

RUN = "run1"


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 4096, 4097, 3 * 4096 + 5])
def test_every_single_bit_flip_and_length_change_is_caught(n: int) -> None:
    rng = random.Random(n)
    data = bytearray(rng.randbytes(n))
    ref = fast_checksum(bytes(data))
    assert fast_checksum(memoryview(data)) == ref
    for pos in {0, n // 2, max(n - 1, 0)} if n else set():
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert fast_checksum(bytes(data)) != ref, (pos, bit)
            data[pos] ^= 1 << bit
    assert fast_checksum(bytes(data) + b"\0") != ref  # zero padding is not invisible


def test_stale_or_swapped_pages_are_caught() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, 64 * 4096, dtype=np.uint8)
    ref = fast_checksum(a.tobytes())
    swapped = a.reshape(64, 4096)[[1, 0, *range(2, 64)]].reshape(-1)
    assert fast_checksum(swapped.tobytes()) != ref
    stale = a.copy()
    stale[4096 * 10 : 4096 * 11] = 0  # a page never written
    assert fast_checksum(stale.tobytes()) != ref


def test_chunked_checksums_follow_the_hash_chunks() -> None:
    data = memoryview(bytes(range(256)) * 10)
    assert fast_checksums(data, 1000) == [
        fast_checksum(data[i : i + 1000]) for i in (0, 1000, 2000)
    ]
    assert fast_checksums(memoryview(b""), 1000) == [fast_checksum(b"")]


def test_verify_views_prefers_the_fast_checksums_and_falls_back_to_sha256() -> None:
    views = {"a": memoryview(b"x" * 100), "b": memoryview(b"y" * 10)}
    sha = {k: chunk_hashes(v) for k, v in views.items()}
    fast = {k: fast_checksums(v) for k, v in views.items()}
    assert verify_views(views, RecordedHashes(sha, fast)) == []
    assert verify_views(views, RecordedHashes(sha)) == []
    bad_fast = {**fast, "b": fast_checksums(memoryview(b"z" * 10))}
    assert verify_views(views, RecordedHashes(sha, bad_fast)) == [
        "b: bytes differ from the recorded hash"
    ]
    assert verify_views(views, RecordedHashes({"a": sha["a"]})) == ["b: no recorded hash"]


def _state(v: float) -> dict[str, object]:
    return {
        "model": {"w": torch.full((300, 70), v), "b": torch.arange(70.0) + v},
        "optimizer": {"state": {0: {"exp_avg": torch.full((300, 70), -v)}}},
        "rng": {"torch_cpu": torch.get_rng_state()},
        "progress": {"step": 3},
    }


def _record(reader: ShmReader, slot: int, seq: int, *, fast: bool = True) -> None:
    """What the persister records (SHA-256 per chunk, and the fast checksums)."""
    desc = reader.descriptor(slot)
    assert desc is not None and desc.seq == seq
    with reader.open(desc) as snap:
        assert snap is not None
        views = {n: snap.tensor(n) for n in desc.tensors}
        sha = {n: chunk_hashes(v) for n, v in views.items()}
        fc = {n: fast_checksums(v) for n, v in views.items()} if fast else None
        del views
        reader.write_hashes(desc, sha, fc)


@pytest.mark.parametrize("fast", [True, False])
def test_a_checked_copy_equals_the_snapshot_and_does_not_alias_memory(
    tmp_path: Path, fast: bool
) -> None:
    writer = ShmWriter(tmp_path, RUN, 0)
    reader = ShmReader(tmp_path, RUN, 0)
    d = writer.write(3, Tier.PULSE, _state(2.0), meta={"token": "tok"})
    assert d is not None
    assert shm_offers(reader) == []  # no hashes recorded yet: not offered
    _record(reader, d.slot, d.seq, fast=fast)
    doc = json.loads(reader.hashes_path(d.slot).read_bytes())
    assert (doc.get("fast") or {}).get("scheme") == (FAST_SCHEME if fast else None)
    [o] = shm_offers(reader)
    assert (o.step, o.token, o.seq) == (3, "tok", d.seq)
    copy, why = copy_snapshot(reader, d)
    assert copy is not None, why
    assert len(copy.buffers) == len(regions(d)) == 3  # one buffer per section with tensors
    assert torch.equal(copy.arrays["model/w"], torch.full((300, 70), 2.0))
    assert torch.equal(copy.arrays["optimizer/state/0/exp_avg"], torch.full((300, 70), -2.0))
    # the trainer overwrites its slots later: the copy must not change with them
    assert writer.write(4, Tier.PULSE, _state(5.0), meta={"token": "t2"}) is not None
    assert writer.write(5, Tier.PULSE, _state(6.0), meta={"token": "t3"}) is not None
    assert torch.equal(copy.arrays["model/w"], torch.full((300, 70), 2.0))
    writer.close()


def test_a_flipped_byte_in_memory_is_refused(tmp_path: Path) -> None:
    writer = ShmWriter(tmp_path, RUN, 0)
    reader = ShmReader(tmp_path, RUN, 0)
    d = writer.write(3, Tier.PULSE, _state(2.0), meta={"token": "tok"})
    assert d is not None
    _record(reader, d.slot, d.seq)
    writer.close()
    t = d.tensors["optimizer/state/0/exp_avg"]
    with open(reader.data_path(d.slot), "r+b") as f:
        f.seek(t.offset + 1234)
        b = f.read(1)
        f.seek(t.offset + 1234)
        f.write(bytes([b[0] ^ 0x10]))
    copy, why = copy_snapshot(reader, d)
    assert copy is None and "optimizer/state/0/exp_avg: bytes differ" in why
