"""The Llama-3-scale failure trace with failure kinds (#31): rate, causes, peers, seeds."""

from __future__ import annotations

import math
import statistics

import pytest

from ckpt_agent.decide.fault_traces import (
    LLAMA3_CAUSES,
    LLAMA3_DAYS,
    LLAMA3_GPUS,
    LLAMA3_INTERRUPTIONS,
    NODE,
    ONE,
    PROCESS,
    RACK,
    WIDE,
    kind_shares,
    llama3_rate,
    llama3_trace,
)
from ckpt_agent.decide.traces import LLAMA3_MTBF_S


def test_the_cause_table_is_the_papers_419_interruptions() -> None:
    assert sum(c.count for c in LLAMA3_CAUSES) == LLAMA3_INTERRUPTIONS == 419
    by_name = {c.name: c for c in LLAMA3_CAUSES}
    assert (by_name["Faulty GPU"].count, by_name["GPU HBM3 memory"].count) == (148, 72)
    assert (by_name["Software bug"].kind, by_name["Software bug"].scope) == (PROCESS, WIDE)
    assert (by_name["NCCL watchdog timeouts"].kind, by_name["NCCL watchdog timeouts"].scope) == (
        PROCESS,
        ONE,
    )
    assert by_name["Network switch/cable"].scope == RACK
    assert all(c.kind in (PROCESS, NODE) and c.scope in (ONE, WIDE, RACK) for c in LLAMA3_CAUSES)
    shares = kind_shares()
    assert shares[PROCESS] == pytest.approx(63 / 419)
    assert shares[NODE] == pytest.approx(356 / 419)
    assert shares[ONE] + shares[WIDE] + shares[RACK] == pytest.approx(1.0)
    assert shares[RACK] == pytest.approx(35 / 419)


def test_the_rate_is_419_in_54_days_at_16384_gpus_scaled_by_size() -> None:
    assert llama3_rate() == pytest.approx(419 / (54 * 86_400))
    assert 1 / llama3_rate() == pytest.approx(LLAMA3_MTBF_S)
    assert llama3_rate(2048) == pytest.approx(llama3_rate() / 8)
    assert llama3_rate(131_072) == pytest.approx(llama3_rate() * 8)
    assert llama3_trace(gpus=4096, days=1).mtbf == pytest.approx(4 / llama3_rate())


@pytest.mark.parametrize(("gpus", "days"), [(LLAMA3_GPUS, LLAMA3_DAYS), (2048, 8 * LLAMA3_DAYS)])
def test_generated_traces_average_419_failures_per_54_days_at_scale(gpus: int, days: float) -> None:
    counts = [len(llama3_trace(gpus=gpus, days=days, seed=s).faults) for s in range(30)]
    # Poisson(419): the mean of 30 has a standard deviation of sqrt(419 / 30) ~ 3.7
    assert statistics.mean(counts) == pytest.approx(419, abs=4 * math.sqrt(419 / 30))
    assert statistics.pstdev(counts) == pytest.approx(math.sqrt(419), rel=0.4)


def test_causes_are_drawn_with_the_tables_weights() -> None:
    faults = llama3_trace(days=20 * LLAMA3_DAYS, seed=7).faults  # ~8,400 failures
    n = len(faults)
    for key, share in kind_shares().items():
        got = sum(key in (f.kind, f.scope) for f in faults) / n
        assert got == pytest.approx(share, abs=4 * math.sqrt(share * (1 - share) / n))
    names = {f.cause for f in faults}
    assert names == {c.name for c in LLAMA3_CAUSES}


def test_peer_loss_probabilities_follow_kind_and_scope() -> None:
    faults = llama3_trace(days=200, seed=2, peer_loss=0.1, same_rack=0.5).faults
    for f in faults:
        if f.kind == PROCESS:
            assert f.peer_q == 0.0 and not f.peers_lost(1)
        elif f.scope == RACK:
            assert f.peer_q == pytest.approx(0.6)
        else:
            assert f.peer_q == pytest.approx(0.1)
        assert 0.0 <= f.draw < 1.0
        assert f.jit_possible == (f.scope == ONE)
    capped = llama3_trace(days=200, seed=2, peer_loss=0.8, same_rack=0.8).faults
    assert max(f.peer_q for f in capped) == 1.0
    lost = sum(f.peers_lost(1) for f in faults if f.kind == NODE and f.scope == ONE)
    ones = sum(f.kind == NODE and f.scope == ONE for f in faults)
    assert lost / ones == pytest.approx(0.1, abs=4 * math.sqrt(0.09 / ones))


def test_a_trace_is_reproducible_by_seed_and_sorted() -> None:
    a, b = llama3_trace(days=10, seed=5), llama3_trace(days=10, seed=5)
    assert a == b
    assert a.faults != llama3_trace(days=10, seed=6).faults
    assert list(a.times) == sorted(a.times) and all(0 <= t < a.horizon for t in a.times)
    assert a.horizon == 10 * 86_400
    assert "16,384 GPUs" in a.name and "seed 5" in a.name


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpus": 0},
        {"days": 0.0},
        {"peer_loss": -0.1},
        {"same_rack": 1.5},
    ],
)
def test_bad_trace_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="got"):
        llama3_trace(**kwargs)  # type: ignore[arg-type]
