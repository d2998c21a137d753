"""The policy simulator: accounting by hand, the event-driven fixed replay, traces, the CLI."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.decide.benchmark import Case, gradient_false_positives, run_case, verdict
from ckpt_agent.decide.decision import Decision, SaveOutcome
from ckpt_agent.decide.sim_policies import FixedPolicy, OraclePolicy, SeedScheduler
from ckpt_agent.decide.simulate import Costs, replay, replay_fixed
from ckpt_agent.decide.traces import Alert, Trace, parse_trace, poisson_trace, training_curves
from ckpt_agent.policy.models import Tier
from ckpt_agent.policy.scheduler_models import RiskSpec, SchedulerSpec

CURVES = training_curves(40_000, seed=1)


@pytest.mark.parametrize(
    ("failure", "lost", "back"),
    [
        # 2 s steps, a save every 10 steps: step 10 ends at 20 s, stalls to 22, durable at 27;
        # step 20 ends at 42, stalls to 44, durable at 49
        (47.0, 1.0 + (21 - 10) * 2, 10),  # the step-20 save is not durable yet
        (50.0, 0.0 + (23 - 20) * 2, 20),  # step 23 ended at 50 s exactly
        (51.0, 1.0 + (23 - 20) * 2, 20),
        (10.0, 10.0, 0),  # before any save: back to the start
    ],
)
def test_lost_work_by_hand(failure: float, lost: float, back: int) -> None:
    trace = Trace("t", horizon=60.0, failures=(failure,))
    for res in (
        replay(trace, FixedPolicy("f", 10), CURVES, Costs()),
        replay_fixed(trace, 10, Costs()),
    ):
        assert res.failures == 1
        assert res.lost_s == pytest.approx(lost)
        assert res.restart_s == 30.0
        assert res.total == pytest.approx(res.stall_s + lost + 30.0)
    del back


@pytest.mark.parametrize("every", [1, 7, 50, 102, 333])
@pytest.mark.parametrize("seed", [1, 2])
def test_event_driven_fixed_replay_matches_the_step_loop(every: int, seed: int) -> None:
    trace = poisson_trace("p", mtbf=2000.0, horizon=60_000.0, warned=0.5, seed=seed)
    a = replay(trace, FixedPolicy("f", every), CURVES, Costs())
    b = replay_fixed(trace, every, Costs(), "f")
    assert (a.saves, a.failures) == (b.saves, b.failures)
    assert a.lost_s == pytest.approx(b.lost_s)
    assert a.stall_s == pytest.approx(b.stall_s)


def test_oracle_saves_at_a_warning_onset_and_often_while_it_holds() -> None:
    trace = Trace("t", horizon=400.0, failures=(), warnings=(Alert(100.0, 160.0, "node"),))
    res = replay(trace, OraclePolicy("o", calm=1000, alarm=5), CURVES, Costs())
    # onset at step 50 (t=100), then steps 55, 60, 65, 70 (12 s apart with the stall);
    # step 75 ends at t=160, when the warning no longer holds
    assert res.saves == 5


def test_poisson_traces_are_seeded_and_warn_the_asked_share() -> None:
    a = poisson_trace("a", mtbf=100.0, horizon=100_000.0, warned=0.5, seed=3)
    assert a == poisson_trace("a", mtbf=100.0, horizon=100_000.0, warned=0.5, seed=3)
    assert a != poisson_trace("a", mtbf=100.0, horizon=100_000.0, warned=0.5, seed=4)
    assert 900 < len(a.failures) < 1100
    assert 0.45 < a.warned_share < 0.55
    assert all(30.0 <= f - w.start <= 120.0 and w.end == f for w, f in _pairs(a))
    assert {w.kind for w in a.warnings} == {"latency", "node", "gpu"}


def _pairs(t: Trace) -> list[tuple[Alert, float]]:
    return [(w, w.end) for w in t.warnings]


@pytest.mark.parametrize(
    "text",
    [
        "[100, 300.5, 200]",
        '[{"time": 100}, {"time": 200, "warning_lead": 60}, {"time": 300.5}]',
        '{"failures": [100, {"time": 200, "warningLead": 60}, 300.5], "horizon": 1000}',
        "time,warning_lead\n100,\n200,60\n300.5,\n",
        "# failures\n300.5\n100\n200,60\n",
    ],
)
def test_parse_trace_json_and_csv(text: str) -> None:
    t = parse_trace(text)
    assert t.failures == (100.0, 200.0, 300.5)
    assert t.notes == {"checked": False}
    if "60" in text:
        assert [(w.start, w.end) for w in t.warnings] == [(140.0, 200.0)]
    if "horizon" in text:
        assert t.horizon == 1000.0
    else:
        assert t.horizon == pytest.approx(300.5 * 4 / 3)


@pytest.mark.parametrize("text", ["[-1]", '["soon"]', "[NaN]", "1e999\n"])
def test_parse_trace_rejects_bad_times(text: str) -> None:
    with pytest.raises(ValueError):
        parse_trace(text)


def test_seed_scheduler_keeps_the_seed_cap_rule() -> None:
    s = SeedScheduler(SchedulerSpec(risk=RiskSpec(mtbf_seconds=86_400.0)), start_time=0.0)
    s.record_step_time(1.0)
    s.settle(
        SaveOutcome.taken(Decision(0, True, Tier.PULSE), stall_seconds=0.5, persist_seconds=0.5)
    )
    assert s.interval_for(0.0) == (100, "base")  # τ = 415 steps only caps the base
    assert s.interval_for(0.0, hazard=25.0) == (100, "base")  # no hazard


def test_adaptive_beats_fixed_at_equal_io_when_most_failures_are_warned() -> None:
    cmp = run_case(Case(600.0, 0.9, seed=5, steps=40_000))
    assert cmp.results[0].policy == "adaptive"
    assert cmp.ratio("adaptive") < 0.75
    assert cmp.same_io["adaptive"].io == pytest.approx(cmp.results[0].io, rel=0.02)
    ok, lines = verdict([cmp])
    assert ok is lines[0].startswith("ok")
    assert "target ≤ 0.55" in lines[0]


def test_default_gradient_rule_is_quiet_on_stationary_noise() -> None:
    assert gradient_false_positives(3.0, samples=5000) <= 1
    # the design's ±1σ fires about once every 10-18 samples
    assert 5000 / 18 < gradient_false_positives(1.0, samples=5000) < 5000 / 10


def test_cli_simulate_replays_a_trace_file(tmp_path: Path) -> None:
    f = tmp_path / "failures.json"
    f.write_text(json.dumps([{"time": 3000}, {"time": 9000, "warning_lead": 90}, 15000]))
    r = CliRunner().invoke(app, ["simulate", "--trace", str(f), "--only-file", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    for word in ("adaptive", "fixed@IO", "young_daly", "oracle", "seed", "failures.json"):
        assert word in r.output
    bad = tmp_path / "bad.csv"
    bad.write_text("time\n-5\n")
    r = CliRunner().invoke(app, ["simulate", "--trace", str(bad), "--only-file"])
    assert r.exit_code == 2
    assert "cannot read failure times" in r.output


def test_unannounced_poisson_failures_cost_their_expected_lost_work() -> None:
    """∫ (work done − work at the last durable save) dt, by hand: steps 1-10 (0-20 s, work
    0→20), stall to 22 (save durable at 27), steps 11-20 (22-42 s), stall to 44 (durable at
    49), steps 21-28 (44-60 s): ∫ work = 200 + 40 + 600 + 80 + 768 = 1688; ∫ saved work =
    20·(49 − 27) + 40·(60 − 49) = 880; at rate 0.01 per s: 0.01 · 808."""
    trace = Trace("t", horizon=60.0, failures=(), unwarned_rate=0.01)
    for res in (
        replay(trace, FixedPolicy("f", 10), CURVES, Costs()),
        replay_fixed(trace, 10, Costs()),
    ):
        assert res.lost_s == pytest.approx(8.08)


def test_expected_lost_work_is_unbiased() -> None:
    """Over many traces the expectation matches the lost work as it falls, with far less
    spread (the replays differ only in how lost work is counted)."""
    expected, realized = [], []
    for seed in range(60):
        t = poisson_trace("p", mtbf=3000.0, horizon=150_000.0, warned=0.0, seed=seed)
        expected.append(replay_fixed(t, 30, Costs()).lost_s)
        realized.append(replay_fixed(replace(t, unwarned_rate=None), 30, Costs()).lost_s)
    err = statistics.pstdev(realized) / len(realized) ** 0.5
    assert abs(statistics.fmean(expected) - statistics.fmean(realized)) < 4 * err
    assert statistics.pstdev(expected) < statistics.pstdev(realized) / 5


def test_a_long_warning_holds_past_later_short_ones() -> None:
    # warnings sorted by start; the long one holds all the way (a save every 50 steps)
    trace = Trace(
        "t", horizon=1000.0, failures=(), warnings=(Alert(0.0, 1000.0), Alert(100.0, 150.0))
    )
    res = replay(trace, OraclePolicy("o", calm=10**6, alarm=50), CURVES, Costs())
    assert res.saves == 10  # steps 1, 51, ..., 451
    t = poisson_trace("p", mtbf=60.0, horizon=50_000.0, warned=0.9, seed=1)
    assert list(t.warnings) == sorted(t.warnings, key=lambda a: a.start)
