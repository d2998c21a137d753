"""The ``auto`` codec's measurements and per-blob encoding (fake clocks: no timing)."""

from __future__ import annotations

import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.decide.compression import AUTO, CodecChoice
from ckpt_agent.format.codec import CODEC_NONE, CODEC_ZSTD, decode, encode
from ckpt_agent.format.shuffle import NUMPY_SHUFFLER
from ckpt_agent.persist.encoding import SAMPLE_BYTES, BlobEncoder, CodecPolicy, WriteMeter
from ckpt_agent.persist.writer import CheckpointWriter
from ckpt_agent.policy.models import CompressionSpec
from ckpt_agent.storage.base import Storage
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.s3 import S3Storage
from ckpt_agent.tuning import ASSUMED_WRITE_BPS_LOCAL, ASSUMED_WRITE_BPS_REMOTE

KIB = 1 << 10
MIB = 1 << 20


class Clock:
    """A clock that moves only when told (``step``: seconds added by every reading)."""

    def __init__(self, step: float = 0.0) -> None:
        self.now = 0.0
        self.step = step
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.step
        return self.now


class ClockedStore:
    """A storage stand-in whose writes take ``seconds`` on the fake clock."""

    def __init__(self, clock: Clock, seconds: float = 0.0, fail: bool = False) -> None:
        self.clock = clock
        self.seconds = seconds
        self.fail = fail
        self.written: list[str] = []

    def write(self, key: str, data: Any) -> None:
        self.clock.now += self.seconds
        if self.fail:
            raise OSError("disk on fire")
        self.written.append(key)


def meter(clock: Clock, prior: float = 100.0, min_bytes: int = 1024) -> WriteMeter:
    return WriteMeter(prior, min_bytes=min_bytes, clock=clock)


# --------------------------------------------------------------------------- WriteMeter


def test_meter_answers_the_prior_until_a_write_is_timed() -> None:
    clock = Clock()
    m = meter(clock, prior=123.0)
    assert m.bps == 123.0 and not m.measured
    m.write(ClockedStore(clock, 1.0), "small", b"x" * 100)  # under min_bytes: not timed
    assert not m.measured
    m.write(ClockedStore(clock, 2.0), "big", b"x" * 4096)
    assert m.measured and m.bps == pytest.approx(2048.0)


def test_meter_counts_only_time_with_a_write_in_flight() -> None:
    clock = Clock()
    m = meter(clock)
    store = ClockedStore(clock, 1.0)
    m.write(store, "a", b"x" * 4000)
    clock.now += 50.0  # the writer was busy hashing: not the storage's time
    m.write(store, "b", b"x" * 4000)
    assert m.bps == pytest.approx(4000.0)  # each 4000 bytes in 1 s, whatever the decay


def test_meter_counts_overlapping_writes_once() -> None:
    """Two writes in flight together: the storage took their bytes in the union of their times."""
    clock = Clock()
    m = WriteMeter(1.0, min_bytes=1, clock=clock)
    started = {k: threading.Event() for k in "ab"}
    release = {k: threading.Event() for k in "ab"}

    class Blocking:
        def write(self, key: str, data: Any) -> None:
            started[key].set()
            assert release[key].wait(10)

    store = Blocking()
    threads = {k: threading.Thread(target=m.write, args=(store, k, b"x" * 1000)) for k in "ab"}
    threads["a"].start()  # t=0
    assert started["a"].wait(10)
    clock.now = 1.0
    threads["b"].start()  # t=1
    assert started["b"].wait(10)
    clock.now = 2.0
    release["a"].set()  # a done at t=2: 2 busy seconds so far
    threads["a"].join(10)
    clock.now = 4.0
    release["b"].set()  # b done at t=4: 2 more
    threads["b"].join(10)
    # 2000 bytes in 4 busy seconds (decayed: (1000·d + 1000) / (2·d + 2) = 500), not 2000 in
    # the 2 + 3 = 5 seconds the two writes each took
    assert m.bps == pytest.approx(500.0)


def test_meter_does_not_count_a_failed_write() -> None:
    clock = Clock()
    m = meter(clock, prior=7.0)
    with pytest.raises(OSError, match="fire"):
        m.write(ClockedStore(clock, 1.0, fail=True), "a", b"x" * 4096)
    assert not m.measured and m.bps == 7.0


def test_meter_follows_a_storage_that_slows_down() -> None:
    clock = Clock()
    m = meter(clock)
    for _ in range(5):
        m.write(ClockedStore(clock, 0.001), "fast", b"x" * 4096)
    fast = m.bps
    for _ in range(30):
        m.write(ClockedStore(clock, 1.0), "slow", b"x" * 4096)
    assert m.bps < fast / 100
    assert m.bps == pytest.approx(4096.0, rel=0.01)


# --------------------------------------------------------------------------- BlobEncoder


def floats(n: int, distinct: int = 97) -> memoryview:
    """``n`` bytes of float32 from a small set of values (compresses well)."""
    return memoryview(b"".join(struct.pack("<f", (i % distinct) * 0.25) for i in range(n // 4)))


def encoder(
    codec: str = AUTO,
    *,
    write_bps: float,
    step: float = 0.001,
    threads: int = 1,
    probe_every: int = 256,
    probe_bytes: int = 2 * MIB,
) -> tuple[BlobEncoder, Clock]:
    clock = Clock(step)  # every compression takes `step` seconds
    enc = BlobEncoder(
        CodecPolicy(codec, 3, True, 4096),
        WriteMeter(write_bps),
        shuffler=NUMPY_SHUFFLER,
        threads=threads,
        probe_every=probe_every,
        probe_bytes=probe_bytes,
        clock=clock,
    )
    return enc, clock


def roundtrip(enc_out: Any, raw: memoryview) -> bytes:
    return bytes(decode(enc_out.stored, enc_out.spec, len(raw), shuffler=NUMPY_SHUFFLER))


def test_auto_compresses_on_slow_storage() -> None:
    enc, _ = encoder(write_bps=1e6)  # 1 MB/s
    raw = floats(MIB)
    first = enc.encode(raw, "float32")  # the probe: compressed whole, kept (it pays)
    assert first.spec.codec == CODEC_ZSTD and first.spec.shuffle == 4
    assert first.seconds == pytest.approx(0.001)
    assert enc.compress_bps == pytest.approx(MIB / 0.001)  # from the whole blob
    assert roundtrip(first, raw) == bytes(raw)
    second = enc.encode(floats(MIB, 89), "float32")  # a sample, then the blob
    assert second.spec.codec == CODEC_ZSTD and second.seconds == pytest.approx(0.002)
    assert enc.compress_bps == pytest.approx(MIB / 0.001)  # samples do not count


def test_auto_stores_raw_on_fast_storage_and_stops_sampling() -> None:
    enc, clock = encoder(write_bps=1e12)  # far faster than any compressor
    raw = floats(MIB)
    first = enc.encode(raw, "float32")  # the probe: measured, does not pay
    assert first.spec.codec == CODEC_NONE and first.stored is raw
    assert first.seconds == pytest.approx(0.001)
    reads = clock.reads
    second = enc.encode(floats(MIB, 31), "float32")  # known to be hopeless: no sample
    assert second.spec.codec == CODEC_NONE and second.seconds == 0.0
    assert clock.reads == reads


def test_a_probe_of_a_large_blob_compresses_a_slice_of_it() -> None:
    enc, _ = encoder(write_bps=1e12, probe_bytes=256 * KIB)
    out = enc.encode(floats(MIB), "float32")
    assert out.spec.codec == CODEC_NONE and out.seconds == pytest.approx(0.001)
    assert enc.compress_bps == pytest.approx(256 * KIB / 0.001)  # the slice, timed
    slow, _ = encoder(write_bps=1e6, probe_bytes=256 * KIB)
    out = slow.encode(floats(MIB), "float32")  # pays: the slice, then the blob
    assert out.spec.codec == CODEC_ZSTD and out.seconds == pytest.approx(0.002)


def test_auto_probes_the_compressor_again_now_and_then() -> None:
    enc, clock = encoder(write_bps=1e12, probe_every=3)
    reads = []
    for i in range(8):
        enc.encode(floats(MIB, 50 + i), "float32")
        reads.append(clock.reads)
    # blobs 0 and 4 are probes (two clock readings each), the rest raw without a sample
    assert reads == [2, 2, 2, 2, 4, 4, 4, 4]


def test_one_probe_at_a_time() -> None:
    enc, _ = encoder(write_bps=1e6)
    assert enc._claim_probe()  # the first blob probes...
    assert not enc._claim_probe()  # ...the others meanwhile do not
    assert enc.choice(MIB, None) is CodecChoice.RAW  # (no speed yet: stored raw)


def test_auto_decides_per_blob() -> None:
    """Slow storage: the blobs that compress are compressed, the others stored raw."""
    enc, _ = encoder(write_bps=1e6)
    noise = memoryview(os.urandom(MIB))
    got = [enc.encode(b, "float32").spec.codec for b in (floats(MIB), noise, floats(MIB, 89))]
    assert got == [CODEC_ZSTD, CODEC_NONE, CODEC_ZSTD]
    assert enc.choice(MIB, 0.1) is CodecChoice.COMPRESS
    assert enc.choice(MIB, 0.99) is CodecChoice.RAW


def test_auto_compresses_a_small_blob_once() -> None:
    """A blob no larger than the sample: the sample is the blob, compressed once."""
    enc, clock = encoder(write_bps=1e6)
    enc.encode(floats(MIB), "float32")  # the probe
    reads = clock.reads
    raw = floats(SAMPLE_BYTES)
    out = enc.encode(raw, "float32")
    assert out.spec.codec == CODEC_ZSTD and clock.reads == reads + 2
    assert roundtrip(out, raw) == bytes(raw)


def test_auto_uses_the_speed_of_all_compressing_threads() -> None:
    one, _ = encoder(write_bps=1e6, threads=1)
    four, _ = encoder(write_bps=1e6, threads=4)
    for e in (one, four):
        e.encode(floats(MIB), "float32")
    assert one.compress_bps is not None and four.compress_bps is not None
    assert four.compress_bps == pytest.approx(4 * one.compress_bps)


def test_zstd_always_compresses_but_keeps_incompressible_blobs_raw() -> None:
    enc, _ = encoder("zstd", write_bps=1e12)
    raw = floats(MIB)
    assert enc.encode(raw, "float32").spec.codec == CODEC_ZSTD  # even on fast storage
    noise = memoryview(os.urandom(MIB))
    out = enc.encode(noise, "uint8")
    assert out.spec.codec == CODEC_NONE and out.stored is noise


@pytest.mark.parametrize("codec", [AUTO, "zstd", "none"])
def test_small_blobs_and_codec_none_are_never_touched(codec: str) -> None:
    enc, clock = encoder(codec, write_bps=1.0)
    small = floats(4092)  # under min_size_bytes
    assert enc.encode(small, "float32").spec.codec == CODEC_NONE
    if codec == "none":
        assert enc.encode(floats(MIB), "float32").spec.codec == CODEC_NONE
    assert clock.reads == 0  # nothing compressed, not even a sample


def test_codec_policy() -> None:
    assert CodecPolicy().codec == AUTO
    assert CodecPolicy.from_spec(CompressionSpec()).codec == AUTO
    assert CodecPolicy.from_spec(CompressionSpec(codec="none")).byte_shuffle is False
    assert CodecPolicy("auto").spec_for("float32", 1 << 20).shuffle == 4
    assert CodecPolicy("auto").spec_for("int64", 1 << 20).shuffle == 0
    assert CodecPolicy("zstd").spec_for("float32", 100).codec == CODEC_NONE  # too small
    with pytest.raises(ValueError, match="use auto, none or zstd"):
        CodecPolicy("lz4")


def test_encoder_refuses_bad_parameters() -> None:
    m = WriteMeter(1.0)
    with pytest.raises(ValueError, match="threads"):
        BlobEncoder(CodecPolicy(), m, threads=0)
    with pytest.raises(ValueError, match="sample_bytes"):
        BlobEncoder(CodecPolicy(), m, sample_bytes=100)


def test_blobs_compress_alike_on_many_threads() -> None:
    """Compression contexts are per thread: parallel encodes equal the sequential ones."""
    spec = CodecPolicy("zstd").spec_for("float32", MIB)
    blobs = [floats(MIB, 60 + i) for i in range(8)]
    sequential = [bytes(encode(b, spec, NUMPY_SHUFFLER)) for b in blobs]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda b: bytes(encode(b, spec, NUMPY_SHUFFLER)), blobs))
    assert parallel == sequential
    for b, stored in zip(blobs, parallel, strict=True):
        assert bytes(decode(stored, spec, len(b), shuffler=NUMPY_SHUFFLER)) == bytes(b)


def test_the_storage_says_what_to_assume_before_measuring(tmp_path: Path) -> None:
    """A local filesystem is assumed fast, any other backend (S3 included) slow."""
    local = LocalStorage(tmp_path / "store")
    assert local.assumed_write_bps == ASSUMED_WRITE_BPS_LOCAL
    assert Storage.assumed_write_bps == S3Storage.assumed_write_bps == ASSUMED_WRITE_BPS_REMOTE
    assert ASSUMED_WRITE_BPS_REMOTE < ASSUMED_WRITE_BPS_LOCAL
    w = CheckpointWriter(local, "run1")
    try:
        assert w.meter.bps == ASSUMED_WRITE_BPS_LOCAL and not w.meter.measured
        assert w.codec.codec == AUTO
    finally:
        w.close()
