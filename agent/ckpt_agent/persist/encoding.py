"""Which codec each blob gets, and the measurements ``auto`` decides from.

:class:`CodecPolicy` is the policy's ``compression`` section. With ``codec:
auto`` (the default) :class:`BlobEncoder` compresses a blob only where it
pays (:mod:`ckpt_agent.decide.compression`), from three measurements:

* the storage's write throughput: :class:`WriteMeter` times the writer's own
  blob writes (fsync included) and keeps a decayed bytes / busy-seconds ratio
  over the time at least one write was in flight, so parallel uploads are not
  counted twice and time the writer spent hashing or compressing (no write in
  flight) is not blamed on the storage. Before the first measured write it
  answers the backend's prior, :attr:`Storage.assumed_write_bps
  <ckpt_agent.storage.base.Storage.assumed_write_bps>` (a local filesystem is
  assumed fast, S3 and unknown backends slow);
* the compressor's throughput on this run's data: raw bytes per second per
  thread over the whole blobs it compressed (decayed like the storage's),
  times the threads that compress in parallel, measured on whole blobs and on
  *probes*: the first blob that could be compressed, and then one in every
  :data:`~ckpt_agent.decide.compression.PROBE_EVERY`, has :data:`PROBE_BYTES` of
  it compressed to measure the speed (and its ratio);
* this blob's ratio: a sample of it (:data:`SAMPLE_BYTES` from its middle)
  compressed first, unless compression cannot pay even for perfectly
  compressible data at the known speeds (then no sample is taken). When the
  sample is the whole blob, its compressed form is used as is.

Whatever the setting, a compressed blob is kept only when it saves at least
:data:`~ckpt_agent.decide.compression.MIN_SAVING` of its raw size; each blob
records its codec, so readers never need to know the setting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ckpt_agent.decide.compression import (
    AUTO,
    MIN_SAVING,
    PROBE_EVERY,
    CodecChoice,
    RateEstimate,
    choose_codec,
    probe_due,
)
from ckpt_agent.format.codec import (
    CODEC_NONE,
    CODEC_ZSTD,
    PY_SHUFFLER,
    CodecSpec,
    Shuffler,
    encode,
    none_spec,
)
from ckpt_agent.format.layout import DTYPE_ITEMSIZE, FLOAT_DTYPES
from ckpt_agent.policy.models import CompressionSpec
from ckpt_agent.storage.base import Storage

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer as Buffer

__all__ = ["PROBE_BYTES", "SAMPLE_BYTES", "BlobEncoder", "CodecPolicy", "Encoded", "WriteMeter"]

#: Raw bytes of a blob compressed to learn its ratio (``auto``).
SAMPLE_BYTES: Final = 128 * 1024
#: Raw bytes of a blob compressed to measure the compressor's speed (a probe): large
#: enough not to run from the CPU cache (a 128 KiB sample compresses several times
#: faster than a 16 MiB blob; 1–2 MiB run at the blob's speed).
PROBE_BYTES: Final = 2 * 1024 * 1024
#: Writes smaller than this are not timed (their latency, not the throughput, dominates;
#: the writer passes a quarter of its chunk size).
MEASURE_MIN_BYTES: Final = 256 * 1024

Clock = Callable[[], float]


@dataclass(frozen=True)
class CodecPolicy:
    """Which codec each blob gets (from the policy's ``compression`` section)."""

    codec: str = AUTO
    """``auto`` (compress where it pays), ``none`` or ``zstd``."""
    level: int = 3
    byte_shuffle: bool = True
    min_size_bytes: int = 4096

    def __post_init__(self) -> None:
        if self.codec not in (AUTO, CODEC_NONE, CODEC_ZSTD):
            raise ValueError(f"unknown codec setting {self.codec!r}: use auto, none or zstd")

    @classmethod
    def from_spec(cls, spec: CompressionSpec) -> CodecPolicy:
        """The codec policy a policy's ``compression`` section asks for."""
        return cls(
            codec=spec.codec,
            level=spec.level,
            byte_shuffle=spec.byte_shuffle and spec.codec != CODEC_NONE,
            min_size_bytes=spec.min_size_bytes,
        )

    def spec_for(self, dtype: str, nbytes: int) -> CodecSpec:
        """The encoding a blob gets when it is compressed (``none`` when it never is)."""
        if self.codec == CODEC_NONE or nbytes < self.min_size_bytes:
            return none_spec()
        itemsize = DTYPE_ITEMSIZE[dtype]
        shuffle = itemsize if self.byte_shuffle and dtype in FLOAT_DTYPES and itemsize > 1 else 0
        return CodecSpec(CODEC_ZSTD, self.level, shuffle)


class WriteMeter:
    """The storage's write throughput, from the writes it times (thread-safe; module doc)."""

    def __init__(
        self,
        prior_bps: float,
        *,
        min_bytes: int = MEASURE_MIN_BYTES,
        clock: Clock = time.perf_counter,
    ) -> None:
        self._rate = RateEstimate(prior_bps)
        self._min_bytes = min_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._mark = 0.0
        self._busy = 0.0
        """Busy seconds (≥ 1 timed write in flight) not yet paired with a finished write."""

    @property
    def bps(self) -> float:
        """Stored bytes per second (the prior until a write was timed)."""
        with self._lock:
            return self._rate.bps

    @property
    def measured(self) -> bool:
        with self._lock:
            return self._rate.measured

    def _advance(self) -> None:
        now = self._clock()
        if self._in_flight:
            self._busy += now - self._mark
        self._mark = now

    def write(self, storage: Storage, key: str, data: Buffer) -> None:
        """``storage.write(key, data)``, timed (writes under ``min_bytes`` are not)."""
        view = memoryview(data)
        if view.nbytes < self._min_bytes:
            storage.write(key, view)
            return
        with self._lock:
            self._advance()
            self._in_flight += 1
        ok = False
        try:
            storage.write(key, view)
            ok = True
        finally:
            with self._lock:
                self._advance()
                self._in_flight -= 1
                if ok:
                    self._rate = self._rate.add(view.nbytes, self._busy)
                    self._busy = 0.0


@dataclass(frozen=True)
class Encoded:
    """One blob as it will be stored."""

    spec: CodecSpec
    stored: Buffer
    seconds: float
    """Time spent compressing it (samples included)."""


class BlobEncoder:
    """Encodes blobs under a :class:`CodecPolicy`; with ``auto`` decides per blob.

    Thread-safe: the writer encodes blobs on several threads at once.
    ``threads`` is how many of them compress in parallel (the compressor's
    throughput is its per-thread speed times that).
    """

    def __init__(
        self,
        policy: CodecPolicy,
        meter: WriteMeter,
        *,
        shuffler: Shuffler = PY_SHUFFLER,
        threads: int = 1,
        sample_bytes: int = SAMPLE_BYTES,
        probe_bytes: int = PROBE_BYTES,
        probe_every: int = PROBE_EVERY,
        clock: Clock = time.perf_counter,
    ) -> None:
        if threads < 1 or min(sample_bytes, probe_bytes) < 16 or (sample_bytes | probe_bytes) % 16:
            raise ValueError(
                "threads must be >= 1, sample_bytes and probe_bytes positive multiples of 16"
            )
        self.policy = policy
        self.meter = meter
        self.shuffler = shuffler
        self.threads = threads
        self.sample_bytes = sample_bytes
        self.probe_bytes = probe_bytes
        self.probe_every = probe_every
        self._clock = clock
        self._lock = threading.Lock()
        self._speed = RateEstimate(1.0)
        """Raw bytes per second one thread compresses (blobs and probes; the prior is unused)."""
        self._since_probe = 0
        self._probing = False

    @property
    def compress_bps(self) -> float | None:
        """Raw bytes per second all compressing threads together (None: unmeasured)."""
        with self._lock:
            return self._speed.bps * self.threads if self._speed.measured else None

    def _compress(self, data: memoryview, spec: CodecSpec, *, timed: bool) -> tuple[Buffer, float]:
        t0 = self._clock()
        stored = encode(data, spec, self.shuffler)
        seconds = self._clock() - t0
        if timed:
            with self._lock:
                self._speed = self._speed.add(len(data), seconds)
                self._since_probe = 0
        return stored, seconds

    def _trial(
        self, part: memoryview, spec: CodecSpec, size: int
    ) -> tuple[float, Buffer | None, float]:
        """Compress ``size`` bytes from the middle of ``part``: (ratio, the compressed blob
        when that was all of it, seconds). A small sample is not timed: it runs from the
        CPU cache, faster than a blob."""
        n = len(part)
        if n <= size:
            stored, seconds = self._compress(part, spec, timed=True)
            return len(memoryview(stored)) / n, stored, seconds
        start = (n - size) // 2 // 16 * 16  # element-aligned for the shuffle
        piece = part[start : start + size]
        stored, seconds = self._compress(piece, spec, timed=size >= self.probe_bytes)
        return len(memoryview(stored)) / size, None, seconds

    def _claim_probe(self) -> bool:
        """Whether this blob is the speed probe (claimed: the others do not probe)."""
        with self._lock:
            due = probe_due(
                measured=self._speed.measured,
                since_probe=self._since_probe,
                probing=self._probing,
                every=self.probe_every,
            )
            if due:
                self._probing = True
            else:
                self._since_probe += 1
            return due

    def choice(self, nbytes: int, ratio: float | None, *, probe: bool = False) -> CodecChoice:
        """The decision for a blob of ``nbytes`` with the measurements known now."""
        return choose_codec(
            self.policy.codec,
            nbytes,
            min_size=self.policy.min_size_bytes,
            write_bps=self.meter.bps,
            compress_bps=self.compress_bps,
            ratio=ratio,
            probe=probe,
        )

    def encode(self, part: memoryview, dtype: str) -> Encoded:
        """``part`` (one chunk of a ``dtype`` tensor) as it will be stored."""
        n = len(part)
        spec = self.policy.spec_for(dtype, n)
        if spec.codec == CODEC_NONE:
            return Encoded(spec, part, 0.0)
        auto = self.policy.codec == AUTO
        choice = self.choice(n, None, probe=auto and self._claim_probe())
        seconds = 0.0
        stored: Buffer | None = None
        if choice is CodecChoice.PROBE:
            try:
                ratio, stored, seconds = self._trial(part, spec, self.probe_bytes)
            finally:
                with self._lock:
                    self._probing = False
            choice = self.choice(n, ratio)
        elif choice is CodecChoice.SAMPLE:
            ratio, stored, seconds = self._trial(part, spec, self.sample_bytes)
            choice = self.choice(n, ratio)
        if choice is not CodecChoice.COMPRESS:
            return Encoded(none_spec(), part, seconds)
        if stored is None:
            stored, took = self._compress(part, spec, timed=True)
            seconds += took
        if len(memoryview(stored)) > n * (1 - MIN_SAVING):
            return Encoded(none_spec(), part, seconds)  # incompressible: raw (faster to load)
        return Encoded(spec, stored, seconds)
