"""The parallel checkpoint writer: storage-aware codec, repeats, failures, bounded work in flight."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ckpt_agent.format.codec import CODEC_NONE, CODEC_ZSTD
from ckpt_agent.format.layout import rank_manifest_key
from ckpt_agent.format.manifest import CheckpointMeta, RankManifest
from ckpt_agent.format.readers import read_checkpoint, read_tensor_bytes
from ckpt_agent.format.shuffle import NUMPY_SHUFFLER
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.validate import Validator
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier, ValidationSpec
from ckpt_agent.records import checkpoint_id
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions

RUN = "run1"
KIB = 1024
CHUNK = 64 * KIB


class Throttled(LocalStorage):
    """A slow link: blob writes share ``bps`` bytes per second (one at a time, sleeping)."""

    def __init__(self, root: Path, bps: float) -> None:
        super().__init__(root, StorageOptions(fsync=False))
        self.bps = bps
        self._link = threading.Lock()

    def write(self, key: str, data: bytes | memoryview) -> None:
        with self._link:
            time.sleep(memoryview(data).nbytes / self.bps)
        super().write(key, data)


class Watched(LocalStorage):
    """Counts concurrent blob writes; fails the ``fail_at``-th one."""

    def __init__(self, root: Path, fail_at: int = 0) -> None:
        super().__init__(root, StorageOptions(fsync=False))
        self.fail_at = fail_at
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def write(self, key: str, data: bytes | memoryview) -> None:
        with self._lock:
            self.calls += 1
            n = self.calls
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(0.005)  # long enough for the others to pile up
            if n == self.fail_at:
                raise OSError(28, "No space left on device")
            super().write(key, data)
        finally:
            with self._lock:
                self.in_flight -= 1


def compressible(nbytes: int, seed: int) -> bytes:
    """float32 from a small set of values (zstd + shuffle: a few times smaller)."""
    return b"".join(struct.pack("<f", ((i * 7 + seed) % 97) * 0.25) for i in range(nbytes // 4))


def model_like(nbytes: int, seed: int) -> bytes:
    """float32 like trained weights (normal noise: zstd gains ~10 %)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(nbytes // 4, dtype=np.float32) * 0.02).tobytes()


def write(w: CheckpointWriter, step: int, tensors: dict[str, tuple[str, bytes]]) -> RankManifest:
    srcs = [
        TensorSource(f"model/{name}", dtype, shape(dtype, data), memoryview(data))
        for name, (dtype, data) in tensors.items()
    ]
    state = {"model": {name: {"__tensor__": f"model/{name}"} for name in tensors}}
    meta = CheckpointMeta(run_id=RUN, step=step, tier=Tier.PULSE, sections=("model",))
    w.commit(meta, [w.write_rank(meta, 0, state, srcs)])
    return read_checkpoint(w.storage, RUN, checkpoint_id(Tier.PULSE, step))[1]


def shape(dtype: str, data: bytes) -> tuple[int, ...]:
    return (len(data) // np.dtype(dtype).itemsize,)


def writer(
    storage: LocalStorage, codec: str = "auto", chunk_bytes: int = CHUNK, **kw: int
) -> CheckpointWriter:
    return CheckpointWriter(
        storage,
        RUN,
        codec=CodecPolicy(codec, 3, True, 0),
        shuffler=NUMPY_SHUFFLER,
        chunk_bytes=chunk_bytes,
        inline_max_bytes=64,
        **kw,
    )


def codecs(m: RankManifest, name: str) -> list[str]:
    return [m.blobs[d].codec.codec for d in m.tensors[f"model/{name}"].chunks]


def restored(storage: LocalStorage, m: RankManifest, name: str) -> bytes:
    entry = m.tensors[f"model/{name}"]
    return bytes(read_tensor_bytes(storage, RUN, m, entry, name, shuffler=NUMPY_SHUFFLER))


def test_auto_compresses_on_a_slow_backend(tmp_path: Path) -> None:
    """1 MB/s: once the writer has timed its writes, even model-like data is compressed."""
    store = Throttled(tmp_path / "store", bps=1e6)
    w = writer(store)
    try:
        # a local filesystem is assumed fast: the first blobs go raw, and are timed
        first = write(w, 1, {"w": ("float32", model_like(8 * CHUNK, 1))})
        assert codecs(first, "w")[0] == CODEC_NONE
        assert w.meter.measured and w.meter.bps < 2e6
        m = write(w, 2, {"w": ("float32", model_like(8 * CHUNK, 2))})
    finally:
        w.close()
    assert codecs(m, "w") == [CODEC_ZSTD] * 8
    assert restored(store, m, "w") == model_like(8 * CHUNK, 2)


def test_auto_stores_raw_on_fast_local_storage(tmp_path: Path) -> None:
    """A local disk (page cache) takes model-like data faster than zstd could shrink it
    (1 MiB blobs: per-file costs do not dominate the measured write speed)."""
    store = LocalStorage(tmp_path / "store", StorageOptions(fsync=False))
    w = writer(store, chunk_bytes=1 << 20)
    try:
        for step in (1, 2):
            m = write(w, step, {"w": ("float32", model_like(12 << 20, step))})
            assert codecs(m, "w") == [CODEC_NONE] * 12
    finally:
        w.close()
    assert w.meter.measured


def test_mixed_codec_checkpoint_restores_bit_exact(tmp_path: Path) -> None:
    store = Throttled(tmp_path / "store", bps=1e6)
    w = writer(store)
    noise = os.urandom(6 * CHUNK)
    tensors = {
        "weights": ("float32", model_like(6 * CHUNK, 3)),
        "table": ("float32", compressible(3 * CHUNK, 3)),
        "noise": ("uint8", noise),
        "mask": ("float32", bytes(4 * CHUNK)),
        "tail": ("float32", compressible(CHUNK + 12, 5)),  # a partial last chunk
    }
    try:
        write(w, 1, {"warmup": ("float32", model_like(8 * CHUNK, 9))})  # learns: 1 MB/s
        m = write(w, 2, tensors)
    finally:
        w.close()
    assert set(codecs(m, "weights")) == set(codecs(m, "table")) == {CODEC_ZSTD}
    assert set(codecs(m, "noise")) == {CODEC_NONE}  # sampled: incompressible
    assert {b.codec.codec for b in m.blobs.values()} == {CODEC_NONE, CODEC_ZSTD}
    for name, (_, data) in tensors.items():
        assert restored(store, m, name) == data, name
    v = Validator(store, RUN, ValidationSpec(load_in_subprocess=False), timeout_s=60)
    try:
        expected = {f"model/{n}": (d, shape(d, b)) for n, (d, b) in tensors.items()}
        out = v.validate(m.checkpoint_id, expected)
    finally:
        v.close()
    assert out.valid, out.reason


def test_repeated_chunks_are_stored_once(tmp_path: Path) -> None:
    store = Watched(tmp_path / "store")
    w = writer(store, "none")
    block = os.urandom(CHUNK)
    other = os.urandom(CHUNK)
    tensors = {
        "a": ("uint8", block * 6 + other),  # six chunks alike, in flight together
        "b": ("uint8", block + other),  # the same again in another tensor
    }
    try:
        m = write(w, 1, tensors)
    finally:
        w.close()
    assert len(m.blobs) == 2 and store.calls == 2
    assert m.tensors["model/a"].chunks[:6] == (m.tensors["model/b"].chunks[0],) * 6
    assert m.stats["blobs_new"] == 2 and m.stats["bytes_new"] == 2 * CHUNK
    for name, (_, data) in tensors.items():
        assert restored(store, m, name) == data


def test_chunks_in_flight_are_bounded(tmp_path: Path) -> None:
    store = Watched(tmp_path / "store")
    w = writer(store, "zstd", parallel_writes=3)
    try:
        m = write(w, 1, {"w": ("float32", model_like(40 * CHUNK, 1))})
    finally:
        w.close()
    assert len(m.tensors["model/w"].chunks) == 40
    assert 1 < store.max_in_flight <= 3


def test_a_failed_blob_fails_the_rank_after_every_write_returned(tmp_path: Path) -> None:
    store = Watched(tmp_path / "store", fail_at=3)
    w = writer(store, "none")
    meta = CheckpointMeta(run_id=RUN, step=1, tier=Tier.PULSE, sections=("model",))
    data = os.urandom(40 * CHUNK)
    src = TensorSource("w", "uint8", (len(data),), memoryview(data))
    try:
        with pytest.raises(OSError, match="No space left"):
            w.write_rank(meta, 0, {"model": {"w": {"__tensor__": "w"}}}, [src])
        assert store.in_flight == 0  # nothing still reads the caller's buffers
        assert store.calls < 40  # stopped submitting after the failure
        assert not store.exists(rank_manifest_key(RUN, meta.checkpoint_id, 0))
    finally:
        w.close()


def test_timings_report_the_measured_throughputs(tmp_path: Path) -> None:
    store = Throttled(tmp_path / "store", bps=4e6)
    w = writer(store)
    meta = CheckpointMeta(run_id=RUN, step=1, tier=Tier.PULSE, sections=("model",))
    data = compressible(8 * CHUNK, 1)
    try:
        out = w.write_rank(
            meta, 0, {}, [TensorSource("w", "float32", (len(data) // 4,), memoryview(data))]
        )
    finally:
        w.close()
    assert {"hash_s", "encode_s", "write_s", "total_s", "write_mib_s", "compress_mib_s"} <= set(
        out.timings
    )
    assert out.blobs_compressed <= out.blobs_new == 8


def test_raw_chunks_of_aligned_buffers_are_written_direct_on_parallel_threads(
    tmp_path: Path,
) -> None:
    """Every byte of a page-aligned tensor's raw chunks goes out with O_DIRECT, whichever
    upload thread writes it (the tail shorter than a page through the page cache)."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    store = LocalStorage(tmp_path / "store")
    w = CheckpointWriter(store, RUN, codec=CodecPolicy(codec=CODEC_NONE), chunk_bytes=1 << 20)
    nbytes = 12 * (1 << 20) + 100
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    data = raw[-raw.ctypes.data % 4096 :][:nbytes]
    data[:] = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
    meta = CheckpointMeta(run_id=RUN, step=1, tier=Tier.PULSE, sections=("model",))
    try:
        out = w.write_rank(meta, 0, {}, [TensorSource("w", "uint8", (nbytes,), data.data)])
    finally:
        w.close()
    assert out.blobs_new == 13
    assert store.direct_io.bytes_written == 12 * (1 << 20)  # the 100-byte tail: buffered
    manifest = out.manifest
    got = bytearray(nbytes)
    read_tensor_bytes(store, RUN, manifest, manifest.tensors["w"], "w", out=memoryview(got))
    assert got == data.tobytes()
