"""Does compressing a blob pay? The pure decision of the ``auto`` codec, as tables."""

from __future__ import annotations

import itertools
import math

import pytest

from ckpt_agent.decide.compression import (
    AUTO,
    MIN_SAVING,
    PROBE_EVERY,
    CodecChoice,
    RateEstimate,
    choose_codec,
    compression_pays,
    could_pay,
    probe_due,
)

MB = 1e6
INF = math.inf
NAN = math.nan


@pytest.mark.parametrize(
    ("write_bps", "compress_bps", "ratio", "pays"),
    [
        # W < C(1 - r): pays
        (10 * MB, 100 * MB, 0.5, True),  # S3-like: 0.1 s raw vs 0.01 + 0.05
        (40 * MB, 100 * MB, 0.5, True),  # 0.025 vs 0.01 + 0.0125
        (50 * MB, 100 * MB, 0.5, False),  # break-even is not a gain
        (60 * MB, 100 * MB, 0.5, False),
        (1000 * MB, 300 * MB, 0.85, False),  # local SSD, float weights
        (20 * MB, 300 * MB, 0.85, True),  # slow network storage, float weights
        (50 * MB, 300 * MB, 0.85, False),
        (1000 * MB, 3000 * MB, 0.01, True),  # zeros: compress even on a fast disk
        (3000 * MB, 3000 * MB, 0.0, False),  # the compressor no faster than the disk
        # never: nothing to save
        (1 * MB, 1000 * MB, 1 - MIN_SAVING + 1e-9, False),
        (1 * MB, 1000 * MB, 1.0, False),
        (1 * MB, 1000 * MB, 1.5, False),  # expands
        (1 * MB, 1000 * MB, 1 - MIN_SAVING, True),  # exactly the minimum saving
        # infinities
        (INF, 100 * MB, 0.1, False),  # free writes
        (10 * MB, INF, 0.5, True),  # free compression
        (INF, INF, 0.5, False),
        # nonsense never pays
        (0.0, 100 * MB, 0.5, False),
        (-1.0, 100 * MB, 0.5, False),
        (10 * MB, 0.0, 0.5, False),
        (10 * MB, -5.0, 0.5, False),
        (NAN, 100 * MB, 0.5, False),
        (10 * MB, NAN, 0.5, False),
        (10 * MB, 100 * MB, NAN, False),
        (10 * MB, 100 * MB, -0.1, False),
    ],
)
def test_compression_pays(write_bps: float, compress_bps: float, ratio: float, pays: bool) -> None:
    assert compression_pays(write_bps=write_bps, compress_bps=compress_bps, ratio=ratio) is pays


def test_compression_pays_is_the_serial_time_model_on_a_grid() -> None:
    """time(compress) + time(write compressed) < time(write raw), checked exhaustively."""
    speeds = [1 * MB, 10 * MB, 50 * MB, 200 * MB, 1000 * MB, 5000 * MB]
    ratios = [0.0, 0.05, 0.3, 0.5, 0.85, 0.96, 0.97, 0.99, 1.0, 1.2]
    for w, c, r in itertools.product(speeds, speeds, ratios):
        raw = 16 * 2**20
        serial = raw / c + raw * r / w < raw / w
        want = serial and r <= 1 - MIN_SAVING
        assert compression_pays(write_bps=w, compress_bps=c, ratio=r) is want, (w, c, r)
        # monotone: slower storage or a better ratio never turns a "pays" into "doesn't"
        if want:
            assert compression_pays(write_bps=w / 2, compress_bps=c, ratio=r)
            assert compression_pays(write_bps=w, compress_bps=c, ratio=r / 2)
            assert compression_pays(write_bps=w, compress_bps=c * 2, ratio=r)


def test_min_saving_is_a_parameter() -> None:
    assert compression_pays(write_bps=1 * MB, compress_bps=1000 * MB, ratio=0.9, min_saving=0.05)
    assert not compression_pays(write_bps=1 * MB, compress_bps=1000 * MB, ratio=0.9, min_saving=0.2)


@pytest.mark.parametrize(
    ("write_bps", "compress_bps", "could"),
    [
        (10 * MB, 100 * MB, True),
        (100 * MB, 100 * MB, False),  # even a ratio of 0 only breaks even
        (1000 * MB, 100 * MB, False),
        (INF, 100 * MB, False),
        (10 * MB, INF, True),
        (0.0, 100 * MB, False),
        (10 * MB, NAN, False),
    ],
)
def test_could_pay(write_bps: float, compress_bps: float, could: bool) -> None:
    assert could_pay(write_bps=write_bps, compress_bps=compress_bps) is could


R, C, S, P = CodecChoice.RAW, CodecChoice.COMPRESS, CodecChoice.SAMPLE, CodecChoice.PROBE
SLOW, FAST = 10 * MB, 2000 * MB
CSPEED = 200 * MB


@pytest.mark.parametrize(
    ("mode", "nbytes", "write_bps", "compress_bps", "ratio", "probe", "choice"),
    [
        # fixed settings ignore the measurements (and probes)
        ("none", 1 << 24, SLOW, CSPEED, 0.1, False, R),
        ("none", 1 << 24, SLOW, None, None, True, R),
        ("zstd", 1 << 24, FAST, CSPEED, 0.99, False, C),
        ("zstd", 1 << 24, FAST, None, None, True, C),
        # small blobs are never compressed, whatever the setting
        ("zstd", 4095, SLOW, CSPEED, 0.1, False, R),
        ("zstd", 4096, SLOW, CSPEED, 0.1, False, C),
        (AUTO, 4095, SLOW, CSPEED, 0.1, False, R),
        (AUTO, 4095, SLOW, None, None, True, R),
        (AUTO, 0, SLOW, None, None, False, R),
        # auto: a probe measures the compressor, whatever is known
        (AUTO, 1 << 24, SLOW, None, None, True, P),
        (AUTO, 1 << 24, FAST, CSPEED, 0.1, True, P),
        # auto: compressor speed unknown (a probe is measuring it) → raw
        (AUTO, 1 << 24, SLOW, None, None, False, R),
        (AUTO, 1 << 24, SLOW, None, 0.1, False, R),
        (AUTO, 1 << 24, FAST, None, None, False, R),
        # auto: storage faster than the compressor → raw, no sample needed
        (AUTO, 1 << 24, FAST, CSPEED, None, False, R),
        (AUTO, 1 << 24, INF, CSPEED, None, False, R),
        (AUTO, 1 << 24, CSPEED, CSPEED, None, False, R),
        # auto: compression could pay, this blob's ratio unknown → sample it
        (AUTO, 1 << 24, SLOW, CSPEED, None, False, S),
        (AUTO, 1 << 24, 150 * MB, CSPEED, None, False, S),
        # auto: measured → the time model
        (AUTO, 1 << 24, SLOW, CSPEED, 0.5, False, C),
        (AUTO, 1 << 24, SLOW, CSPEED, 0.99, False, R),  # saves < MIN_SAVING
        (AUTO, 1 << 24, 150 * MB, CSPEED, 0.5, False, R),  # 1/200 + 0.5/150 > 1/150
        (AUTO, 1 << 24, 50 * MB, CSPEED, 0.5, False, C),  # 1/200 + 0.5/50 < 1/50
        (AUTO, 1 << 24, 150 * MB, CSPEED, 0.1, False, C),  # compresses well: pays on faster storage
    ],
)
def test_choose_codec(
    mode: str,
    nbytes: int,
    write_bps: float,
    compress_bps: float | None,
    ratio: float | None,
    probe: bool,
    choice: CodecChoice,
) -> None:
    got = choose_codec(
        mode,
        nbytes,
        min_size=4096,
        write_bps=write_bps,
        compress_bps=compress_bps,
        ratio=ratio,
        probe=probe,
    )
    assert got is choice


@pytest.mark.parametrize(
    ("measured", "since", "probing", "every", "due"),
    [
        (False, 0, False, PROBE_EVERY, True),  # never measured
        (False, 0, True, PROBE_EVERY, False),  # one probe at a time
        (True, 0, False, PROBE_EVERY, False),
        (True, PROBE_EVERY - 1, False, PROBE_EVERY, False),
        (True, PROBE_EVERY, False, PROBE_EVERY, True),  # measured long ago
        (True, PROBE_EVERY + 5, True, PROBE_EVERY, False),
        (True, 1, False, 1, True),
        (True, 0, False, 1, False),
    ],
)
def test_probe_due(measured: bool, since: int, probing: bool, every: int, due: bool) -> None:
    assert probe_due(measured=measured, since_probe=since, probing=probing, every=every) is due


def test_probe_due_refuses_a_bad_period() -> None:
    with pytest.raises(ValueError, match="every"):
        probe_due(measured=True, since_probe=0, probing=False, every=0)


def test_choose_codec_agrees_with_compression_pays_once_measured() -> None:
    speeds = [1 * MB, 30 * MB, 300 * MB, 3000 * MB, INF]
    for w, c, r in itertools.product(speeds, speeds[:-1], [0.0, 0.2, 0.6, 0.9, 0.98, 1.1]):
        got = choose_codec(AUTO, 1 << 20, min_size=0, write_bps=w, compress_bps=c, ratio=r)
        pays = compression_pays(write_bps=w, compress_bps=c, ratio=r)
        assert got is (C if pays else R), (w, c, r)


def test_choose_codec_refuses_unknown_settings() -> None:
    with pytest.raises(ValueError, match="use auto, none or zstd"):
        choose_codec("lz4", 1 << 20, min_size=0, write_bps=SLOW, compress_bps=None, ratio=None)


def test_rate_estimate_answers_the_prior_until_measured() -> None:
    r = RateEstimate(prior=123.0)
    assert not r.measured and r.bps == 123.0
    assert r.add(0, 1.0) is r  # no bytes: no sample
    assert r.add(10, -1.0) is r and r.add(10, NAN) is r
    r = r.add(1000, 2.0)
    assert r.measured and r.bps == 500.0
    assert RateEstimate(prior=1.0).add(1000, 0.0).bps == INF  # too fast to time


def test_rate_estimate_weights_by_size_and_fades() -> None:
    r = RateEstimate(prior=1.0, decay=0.5).add(100, 1.0).add(300, 1.0)
    # (100·0.5 + 300) / (1·0.5 + 1) = 350 / 1.5
    assert r.bps == pytest.approx(350 / 1.5)
    for _ in range(40):  # the old rate fades: a new regime takes over
        r = r.add(10, 1.0)
    assert r.bps == pytest.approx(10.0, rel=1e-6)


@pytest.mark.parametrize(
    ("prior", "decay"), [(0.0, 0.5), (-1.0, 0.5), (NAN, 0.5), (1.0, 0.0), (1.0, 1.0)]
)
def test_rate_estimate_refuses_bad_parameters(prior: float, decay: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        RateEstimate(prior=prior, decay=decay)
