"""Parallel, in-place restore reads (torch-free): bit-exact, verified where used, bounded.

:mod:`ckpt_agent.format.parallel_read` and :mod:`ckpt_agent.format.chunkread`.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import blake3
import pytest
import zstandard

from ckpt_agent.errors import IntegrityError
from ckpt_agent.format import jsontree
from ckpt_agent.format.chunkread import Scratch, raw_check, read_chunk
from ckpt_agent.format.codec import CodecSpec
from ckpt_agent.format.entries import BlobEntry
from ckpt_agent.format.layout import DTYPE_ITEMSIZE, blob_key, sha256_hex
from ckpt_agent.format.manifest import CheckpointMeta, RankManifest
from ckpt_agent.format.parallel_read import Target, read_into, restore_workers
from ckpt_agent.format.readers import read_checkpoint, read_tensor_bytes
from ckpt_agent.format.shuffle import NUMPY_SHUFFLER
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import checkpoint_id
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"
CHUNK = 4096


def _payload(dtype: str, n: int, seed: int) -> bytes:
    """``n`` elements of ``dtype``: smooth values (compressible) from a SHA-256 stream."""
    size = n * DTYPE_ITEMSIZE[dtype]
    out = bytearray()
    block = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{block}".encode()).digest()[:8] + bytes(24)
        block += 1
    return bytes(out[:size])


#: dtype → element count: multi-chunk tensors (a partial last chunk), one small, one inline.
TENSORS = {
    "model/f32": ("float32", 5000),
    "model/bf16": ("bfloat16", 7001),
    "model/f16": ("float16", 3000),
    "model/f64": ("float64", 1500),
    "model/i64": ("int64", 900),
    "model/u8": ("uint8", 10000),
    "model/small": ("float32", 300),
    "model/tiny": ("float32", 4),
}


def _save(
    store: LocalStorage, codec: str, *, step: int = 1
) -> tuple[RankManifest, dict[str, bytes]]:
    data = {name: _payload(dt, n, i) for i, (name, (dt, n)) in enumerate(TENSORS.items())}
    srcs = [
        TensorSource(name, dt, (n,), memoryview(data[name])) for name, (dt, n) in TENSORS.items()
    ]
    policy = CodecPolicy(codec=codec, byte_shuffle=codec != "none", min_size_bytes=0)
    w = CheckpointWriter(store, RUN, codec=policy, chunk_bytes=CHUNK, inline_max_bytes=64)
    meta = CheckpointMeta(run_id=RUN, step=step, tier=Tier.PULSE, sections=("model",))
    state = {"model": {n.split("/", 1)[1]: {jsontree.TENSOR: n} for n in TENSORS}}
    w.commit(meta, [w.write_rank(meta, 0, state, srcs)])
    _, manifest = read_checkpoint(store, RUN, checkpoint_id(Tier.PULSE, step))
    return manifest, data


def _targets(manifest: RankManifest) -> dict[str, Target]:
    return {n: Target(n, e, memoryview(bytearray(e.nbytes))) for n, e in manifest.tensors.items()}


def test_workers_follow_the_usable_cpus() -> None:
    assert 1 <= restore_workers() <= 8


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("workers", [1, 4])
def test_every_dtype_and_chunking_is_restored_bit_exact(
    ck_store: LocalStorage, codec: str, workers: int
) -> None:
    manifest, data = _save(ck_store, codec)
    blobs = list(manifest.blobs.values())
    assert len(manifest.tensors["model/bf16"].chunks) == 4  # 14002 bytes in 4096-byte chunks
    assert manifest.tensors["model/tiny"].inline is not None
    if codec == "zstd":  # shuffled by element size, compressed
        assert {b.codec.shuffle for b in blobs} >= {2, 4, 8}
        assert all(b.size < b.raw_size for b in blobs if b.codec.codec == "zstd")
    targets = _targets(manifest)
    read_into(
        ck_store, RUN, manifest, list(targets.values()), shuffler=NUMPY_SHUFFLER, workers=workers
    )
    for name, t in targets.items():
        assert bytes(t.out) == data[name], name
        # the sequential reader agrees
        assert bytes(read_tensor_bytes(ck_store, RUN, manifest, t.entry, name)) == data[name]


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_corrupted_late_chunk_is_found_and_named(ck_store: LocalStorage, codec: str) -> None:
    manifest, _ = _save(ck_store, codec)
    entry = manifest.tensors["model/u8"]
    digest = entry.chunks[-1]  # the last chunk of a late tensor
    path = ck_store.root / blob_key(RUN, digest)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(
        IntegrityError, match=rf"'model/u8': blob {digest[:16]}… hashes to .*corrupted bytes"
    ):
        read_into(ck_store, RUN, manifest, list(_targets(manifest).values()), workers=3)


def test_a_missing_blob_is_an_integrity_error(ck_store: LocalStorage) -> None:
    manifest, _ = _save(ck_store, "zstd")
    digest = manifest.tensors["model/f32"].chunks[1]
    ck_store.delete(blob_key(RUN, digest))
    with pytest.raises(IntegrityError, match="is missing from storage"):
        read_into(ck_store, RUN, manifest, list(_targets(manifest).values()), workers=2)


def _blob(store: LocalStorage, stored: bytes, raw: bytes, spec: CodecSpec) -> BlobEntry:
    digest = sha256_hex(stored)
    store.write(blob_key(RUN, digest), stored)
    return BlobEntry(digest, len(stored), sha256_hex(raw), len(raw), spec)


def test_the_bytes_used_are_the_bytes_verified(ck_store: LocalStorage) -> None:
    """An intact blob (it hashes to its name) whose decoded bytes differ from the raw hash
    the manifest records is refused: the check is over the destination."""
    raw = bytes(range(256)) * 64
    stored = zstandard.ZstdCompressor(level=3).compress(raw)
    good = _blob(ck_store, stored, raw, CodecSpec("zstd", 3, 0))
    out = memoryview(bytearray(len(raw)))
    read_chunk(ck_store, RUN, good, "x", out, NUMPY_SHUFFLER, Scratch())
    assert bytes(out) == raw
    lying = BlobEntry(good.digest, good.size, sha256_hex(b"other"), good.raw_size, good.codec)
    with pytest.raises(IntegrityError, match="decodes to the wrong bytes"):
        read_chunk(ck_store, RUN, lying, "x", out, NUMPY_SHUFFLER, Scratch())


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_the_restore_checks_with_the_recorded_blake3(ck_store: LocalStorage, codec: str) -> None:
    """Where the writer recorded a BLAKE3 of the raw bytes, it is what the restore checks:
    a wrong one is refused even when the SHA-256 matches; without one, SHA-256 decides."""
    raw = bytes(range(256)) * 64
    spec = CodecSpec(codec, 3 if codec == "zstd" else 0, 0)
    stored = raw if codec == "none" else zstandard.ZstdCompressor(level=3).compress(raw)
    plain = _blob(ck_store, stored, raw, spec)
    assert raw_check(plain)[1] == plain.raw_sha256
    fast = replace(plain, raw_blake3=blake3.blake3(raw).hexdigest())
    assert raw_check(fast)[1] == fast.raw_blake3
    out = memoryview(bytearray(len(raw)))
    read_chunk(ck_store, RUN, fast, "x", out, NUMPY_SHUFFLER, Scratch())
    assert bytes(out) == raw
    lying = replace(plain, raw_blake3=blake3.blake3(b"other").hexdigest())
    with pytest.raises(IntegrityError, match="decodes to the wrong bytes"):
        read_chunk(ck_store, RUN, lying, "x", out, NUMPY_SHUFFLER, Scratch())
    flipped = bytearray(stored)
    flipped[len(flipped) // 2] ^= 1
    ck_store.write(blob_key(RUN, plain.digest), bytes(flipped))
    with pytest.raises(IntegrityError, match=r"corrupted bytes|corrupt zstd"):
        read_chunk(ck_store, RUN, fast, "x", out, NUMPY_SHUFFLER, Scratch())


def test_the_writer_records_the_blake3_of_every_new_chunk(ck_store: LocalStorage) -> None:
    manifest, data = _save(ck_store, "zstd")
    checked = 0
    for name, entry in manifest.tensors.items():
        for i, digest in enumerate(entry.chunks):
            raw = data[name][i * CHUNK : (i + 1) * CHUNK]
            assert manifest.blobs[digest].raw_blake3 == blake3.blake3(raw).hexdigest()
            checked += 1
    assert checked > 4


@pytest.mark.parametrize("content_size", [True, False])
def test_a_frame_larger_than_declared_never_writes_past_the_destination(
    ck_store: LocalStorage, content_size: bool
) -> None:
    raw = bytes(3000)
    stored = zstandard.ZstdCompressor(write_content_size=content_size).compress(raw)
    blob = _blob(ck_store, stored, raw[:1000], CodecSpec("zstd", 3, 0))
    buf = bytearray(1000 + 16)
    with pytest.raises(IntegrityError, match=r"declares 3000 bytes|more than 1000"):
        read_chunk(ck_store, RUN, blob, "x", memoryview(buf)[:1000], NUMPY_SHUFFLER, Scratch())
    assert buf[1000:] == bytes(16)


class _Slow(LocalStorage):
    """Counts blob reads; each takes a few milliseconds."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.reads = 0
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.reads += 1
        time.sleep(0.05)

    @contextlib.contextmanager
    def read_view(self, key: str) -> Iterator[memoryview]:
        self._count()
        with super().read_view(key) as view:
            yield view

    def read_into(self, key: str, out: memoryview, *args: Any, **kw: Any) -> int:
        self._count()  # raw blobs are read straight into their destination
        return super().read_into(key, out, *args, **kw)


def test_the_first_failure_stops_the_remaining_chunks(ck_store: LocalStorage) -> None:
    manifest, _ = _save(ck_store, "none")
    first = next(iter(manifest.tensors.values())).chunks[0]
    ck_store.delete(blob_key(RUN, first))
    slow = _Slow(ck_store.root)
    targets = list(_targets(manifest).values())
    total = sum(len(t.entry.chunks) for t in targets)
    assert total >= 20
    with pytest.raises(IntegrityError, match="is missing"):
        read_into(slow, RUN, manifest, targets, workers=2)
    assert 0 < slow.reads < total  # the rest were never started
