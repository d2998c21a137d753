"""Storage-aware compression: does compressing a blob pay? (pure, no I/O)

The policy's ``compression.codec`` is ``none`` (never compress), ``zstd``
(always, kept only when it saves at least :data:`MIN_SAVING`) or ``auto``
(the default): compress a blob only where it makes the persist faster::

    time(compress) + time(write compressed) < time(write raw)
    ⇔  1/C + r/W < 1/W      (per raw byte)
    ⇔  W < C · (1 − r)

with ``W`` the storage's write throughput (stored bytes per second, all
uploads together, fsync included), ``C`` the compressor's throughput (raw
bytes per second, all compressing threads together) and ``r`` the ratio
stored/raw on this blob's data. The model is serial (compressing a blob and
writing it one after the other) and so conservative: it ignores that other
blobs are written while one compresses, because the cores that compress are
the cores that hash, and the trainer's. On a local SSD (``W`` ≈ 0.3–3 GB/s)
zstd on float weights (``r`` ≈ 0.85–0.9) never pays; on S3 or a network
filesystem, or on data that compresses well (zeros, masks, integer
tables), it does.

The persisting side (:mod:`ckpt_agent.persist.encoding`) measures ``W`` from
its own recent writes (:class:`RateEstimate`, a decayed bytes/busy-seconds
ratio; before the first write the backend's prior: local filesystem fast,
S3 and unknown backends slow), ``C`` from the whole blobs it compresses (a
*probe*: the first blob that could be compressed, then one in every
:data:`PROBE_EVERY`, is compressed whole to measure it — small samples run
from the CPU cache, several times faster than a 16 MiB blob, and would
overstate ``C``), and ``r`` per blob by compressing a small sample of it
(:func:`choose_codec` says when a sample is worth taking: never when no
ratio could make compression pay).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Final

__all__ = [
    "AUTO",
    "MIN_SAVING",
    "PROBE_EVERY",
    "CodecChoice",
    "RateEstimate",
    "choose_codec",
    "compression_pays",
    "could_pay",
    "probe_due",
]

#: The policy's codec setting that decides per blob (the others name a codec).
AUTO: Final = "auto"
#: Keep a compressed blob only when it saves at least this fraction of the raw size.
MIN_SAVING: Final = 0.03
#: One blob in this many (of those ``auto`` may compress) is compressed whole to measure
#: the compressor's speed again (the machine's load changes).
PROBE_EVERY: Final = 256


class CodecChoice(enum.Enum):
    """What to do with one blob."""

    RAW = "raw"
    """Store the raw bytes."""
    COMPRESS = "compress"
    """Compress it (kept only when it saves at least :data:`MIN_SAVING`)."""
    SAMPLE = "sample"
    """Compress a small sample of it first to learn its ratio, then ask again with it."""
    PROBE = "probe"
    """Compress all of it to measure the compressor's speed (and its ratio); keep the
    compressed form only if, measured, compressing pays."""


def _positive(x: float) -> bool:
    return x > 0 and not math.isnan(x)


def compression_pays(
    *, write_bps: float, compress_bps: float, ratio: float, min_saving: float = MIN_SAVING
) -> bool:
    """Whether ``time(compress) + time(write compressed) < time(write raw)`` (module doc).

    ``write_bps``: stored bytes per second the storage takes; ``compress_bps``: raw
    bytes per second the compressor takes (``inf`` allowed for both); ``ratio``:
    stored/raw size. A ratio above ``1 − min_saving`` never pays (the blob would be
    stored raw anyway); nonsense inputs (NaN, ≤ 0, a negative ratio) never pay.
    """
    if not (_positive(write_bps) and _positive(compress_bps)):
        return False
    if math.isnan(ratio) or ratio < 0 or ratio > 1 - min_saving:
        return False
    if math.isinf(write_bps):
        return False  # writing costs nothing: nothing to save
    return 1 / compress_bps + ratio / write_bps < 1 / write_bps


def could_pay(*, write_bps: float, compress_bps: float) -> bool:
    """Whether compression could pay for *some* data (a ratio of 0): else no sample is
    worth taking."""
    return compression_pays(write_bps=write_bps, compress_bps=compress_bps, ratio=0.0)


def probe_due(*, measured: bool, since_probe: int, probing: bool, every: int = PROBE_EVERY) -> bool:
    """Whether this blob should be a speed probe: the compressor's speed was never
    measured, or ``every`` blobs went by since the last measurement; one probe at a
    time (``probing``: one is running)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    return not probing and (not measured or since_probe >= every)


def choose_codec(
    mode: str,
    nbytes: int,
    *,
    min_size: int,
    write_bps: float,
    compress_bps: float | None,
    ratio: float | None,
    probe: bool = False,
) -> CodecChoice:
    """The choice for one blob of ``nbytes`` raw bytes under the policy's ``mode``.

    ``none`` and blobs under ``min_size`` → RAW; ``zstd`` → COMPRESS. ``auto``:
    PROBE when ``probe`` (:func:`probe_due`); RAW while the compressor's speed is
    unknown (a probe is measuring it), or when compression cannot pay even for
    perfectly compressible data at that speed; SAMPLE while this blob's ``ratio``
    is unknown; else COMPRESS iff :func:`compression_pays`.
    """
    if mode not in (AUTO, "none", "zstd"):
        raise ValueError(f"unknown codec setting {mode!r}: use auto, none or zstd")
    if mode == "none" or nbytes < max(min_size, 1):
        return CodecChoice.RAW
    if mode == "zstd":
        return CodecChoice.COMPRESS
    if probe:
        return CodecChoice.PROBE
    if compress_bps is None or not could_pay(write_bps=write_bps, compress_bps=compress_bps):
        return CodecChoice.RAW
    if ratio is None:
        return CodecChoice.SAMPLE
    pays = compression_pays(write_bps=write_bps, compress_bps=compress_bps, ratio=ratio)
    return CodecChoice.COMPRESS if pays else CodecChoice.RAW


@dataclass(frozen=True)
class RateEstimate:
    """A throughput from decayed sums: ``bytes / seconds`` with older samples fading.

    Each :meth:`add` multiplies both sums by ``decay`` before adding the sample, so
    a sample's weight is its size (a large write counts more than a small one) times
    ``decay`` per newer sample. ``prior`` answers until there is a sample.
    """

    prior: float
    decay: float = 0.75
    nbytes: float = 0.0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must be within (0, 1), got {self.decay}")
        if not _positive(self.prior):
            raise ValueError(f"prior must be > 0, got {self.prior}")

    def add(self, nbytes: int, seconds: float) -> RateEstimate:
        """With one more sample (``nbytes`` in ``seconds``); a sample of no bytes or a
        negative/NaN duration changes nothing."""
        if nbytes <= 0 or not seconds >= 0:
            return self
        d = self.decay
        return RateEstimate(
            self.prior, d, self.nbytes * d + nbytes, self.seconds * d + max(seconds, 0.0)
        )

    @property
    def measured(self) -> bool:
        return self.nbytes > 0

    @property
    def bps(self) -> float:
        """Bytes per second (``inf`` when the samples took no measurable time)."""
        if not self.measured:
            return self.prior
        return self.nbytes / self.seconds if self.seconds > 0 else math.inf
