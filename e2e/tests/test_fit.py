"""The FIT suite under pytest (marker ``fit``): every registered scenario and a 20-trial
random-crash campaign (issue #14). ``ckpt-fit`` runs the same code from the command line.

Scenarios whose needs this machine lacks are skipped with the reason; scenarios that need
the control plane share the e2e session's ``stack`` (and its cluster). The JSON report and
the table go to ``$CKPT_FIT_REPORT_DIR`` (default ``.cache/fit/``) as ``pytest-fit.json``
and ``pytest-fit.json.txt``, kept as CI artifacts.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_e2e.fit import faults
from ckpt_e2e.fit.__main__ import main as fit_main
from ckpt_e2e.fit.campaign import run_campaign
from ckpt_e2e.fit.core import Outcome, restart_may_resume
from ckpt_e2e.fit.runner import (
    DEFAULT_REPORT_DIR,
    REPORT_DIR_ENV,
    Report,
    Row,
    Shared,
    available_needs,
    load_registry,
    run_one,
    table,
    write_report,
)

pytestmark = [pytest.mark.fit, pytest.mark.slow, pytest.mark.timeout(600)]

REGISTRY, MISSING = load_registry()
#: Trials of the campaign CI runs (``ckpt-fit --campaign 200`` for the full figures).
CI_TRIALS = int(os.environ.get("CKPT_FIT_CI_TRIALS", "20"))


@pytest.fixture(scope="session")
def fit_report() -> Iterator[Report]:
    """Every row of this session, written as the FIT report when the session ends."""
    report = Report(seed=int(os.environ.get("CKPT_FIT_SEED", time.time_ns() % 1_000_000)))
    yield report
    folder = Path(os.environ.get(REPORT_DIR_ENV) or DEFAULT_REPORT_DIR)
    write_report(report, folder / "pytest-fit.json")


@pytest.fixture(scope="session")
def fit_shared() -> Iterator[Shared]:
    shared = Shared()
    yield shared
    shared.close()


@pytest.mark.parametrize("name", list(REGISTRY))
def test_scenario(
    name: str,
    fit_report: Report,
    fit_shared: Shared,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    sc = REGISTRY[name]
    lacking = sorted(sc.needs - available_needs())
    if lacking:
        fit_report.rows.append(Row(name, sc.title, "skip", reason=f"needs {', '.join(lacking)}"))
        pytest.skip(f"FIT scenario {name} needs {', '.join(lacking)} (not available here)")
    if "cluster" in sc.needs:  # share the e2e session's control plane and operator
        fit_shared.services.setdefault("stack", request.getfixturevalue("stack"))
    outcome = run_one(sc, tmp_path / name, fit_report.seed, print, fit_shared)
    fit_report.rows.append(Row(name, sc.title, "pass" if outcome.passed else "FAIL", outcome))
    failed = [f"{c.name}: {c.detail}" for c in outcome.checks if not c.ok]
    assert outcome.passed, (
        f"FIT scenario {name} failed (seed {fit_report.seed}): "
        + "; ".join(failed + ([outcome.error] if outcome.error else []))
        + ("\n" + "\n".join(outcome.notes) if outcome.notes else "")
    )


def test_random_crash_campaign(fit_report: Report, tmp_path: Path) -> None:
    result = run_campaign(CI_TRIALS, tmp_path / "campaign", seed=fit_report.seed)
    fit_report.campaign = result
    assert result["passed"], result["summary"]
    assert result["corrupt_marked_valid"] == 0
    assert result["acknowledged_lost"] == 0
    assert result["resume_not_exact"] == 0


def test_scenario_modules_are_there() -> None:
    """Both scenario modules import (a missing one would silently drop scenarios)."""
    assert not MISSING, f"FIT scenario modules missing: {MISSING}"


# --------------------------------------------------------------------------- the harness itself
def test_table_report_and_skips(tmp_path: Path) -> None:
    """The table has the issue's columns, skips say why, the JSON and .txt are written."""
    ok = Outcome("a", injected_at="step 3", recovered_from="pulse_step_2", steps_lost=1)
    ok.check_recovery_time(0.5)
    ok.check_losses({1: 0.5, 2: 0.25}, {1: 0.5, 2: 0.25}, exact=True)
    bad = Outcome("b")
    bad.check("no corrupt checkpoint marked valid", False, "['x']")
    report = Report(rows=[Row("a", "A", "pass", ok), Row("b", "B", "FAIL", bad)])
    report.rows.append(Row("c", "C", "skip", reason="needs cluster"))
    text = table(report.rows)
    head = text.splitlines()[0].split()
    assert head[:2] == ["scenario", "injected"] and head[-1] == "verdict"
    assert "PASS" in text and "FAIL" in text and "skip: needs cluster" in text
    path = write_report(report, tmp_path / "r.json")
    data = json.loads(path.read_text())
    assert data["passed"] is False and [r["status"] for r in data["scenarios"]] == [
        "pass",
        "FAIL",
        "skip",
    ]
    assert Path(f"{path}.txt").read_text().startswith("scenario")


def _ck(cid: str, step: int, tier: str, status: str, **kw: Any) -> CheckpointRecord:
    return CheckpointRecord(cid, step, Tier(tier), CheckpointStatus(status), **kw)


#: What storage held when the trainer was killed under load: the validator had checked
#: the full at 84; the pulses at 150 and 153 were committed, still pending.
AT_KILL = [
    _ck("pulse_step_070", 70, "pulse", "valid"),
    _ck("full_step_084", 84, "full", "valid"),
    _ck("pulse_step_084", 84, "pulse", "valid"),
    _ck("pulse_step_150", 150, "pulse", "pending"),
    _ck("pulse_step_153", 153, "pulse", "pending"),
    _ck("pulse_step_160", 160, "pulse", "pending", lightweight=True),
    _ck("pulse_step_140", 140, "pulse", "corrupted"),
    _ck("heartbeat_step_161", 161, "heartbeat", "valid"),
]


@pytest.mark.parametrize(
    ("resumed", "rejected", "corrupted", "ok"),
    [
        ("pulse_step_153", (), (), True),  # the newest committed one, verified at restart
        ("full_step_084", (), (), False),  # passed newer committed ones over unverified
        ("full_step_084", ("pulse_step_150", "pulse_step_153"), (), True),  # both failed
        ("pulse_step_150", (), ("pulse_step_153",), True),  # 153 was found corrupt
        ("pulse_step_150", (), (), False),  # 153 skipped without a verdict
        ("pulse_step_084", ("pulse_step_150", "pulse_step_153"), (), False),  # older than valid
        ("pulse_step_070", ("pulse_step_150", "pulse_step_153"), (), False),
        ("pulse_step_160", (), (), False),  # lightweight: not a resume candidate
        ("pulse_step_140", (), (), False),  # corrupted
        ("pulse_step_170", (), (), False),  # committed after the kill
        (None, (), (), False),  # a fresh start while checkpoints exist
    ],
)
def test_which_checkpoint_a_restart_may_resume(
    resumed: str | None, rejected: tuple[str, ...], corrupted: tuple[str, ...], ok: bool
) -> None:
    """The shared criterion: the newest valid at the kill or a newer committed (pending)
    one the restart verified; newer ones passed over only with a verdict."""
    assert [r.id for r in restart_may_resume(AT_KILL)] == [
        "pulse_step_153",
        "pulse_step_150",
        "full_step_084",
    ]
    outcome = Outcome("x")
    got = outcome.check_resume_choice(resumed, AT_KILL, rejected=rejected, corrupted_now=corrupted)
    assert got is ok and outcome.passed is ok, outcome.checks


def test_a_restart_with_nothing_committed_starts_fresh() -> None:
    pending_only = [_ck("pulse_step_10", 10, "pulse", "pending")]
    assert [r.id for r in restart_may_resume(pending_only)] == ["pulse_step_10"]
    (first, *_) = restart_may_resume(AT_KILL, avoid={"pulse_step_153"})
    assert first.id == "pulse_step_150"
    assert Outcome("x").check_resume_choice(None, [], rejected=(), corrupted_now=())
    assert not Outcome("x").check_resume_choice("full_1", [], rejected=(), corrupted_now=())


def test_cli_usage(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_FIT_NEEDS", "")
    assert fit_main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "trainer-sigkill" in listed and "skipped here: needs cluster" in listed
    assert fit_main(["--scenario", "no-such-scenario"]) == 2
    assert "ckpt-fit --list" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        fit_main([])
    assert e.value.code == 2
    assert available_needs() == set()
    monkeypatch.setenv("CKPT_FIT_NEEDS", "cluster, s3")
    assert available_needs() == {"cluster", "s3"}


def test_transient_errno_rule(tmp_path: Path) -> None:
    """A ``times`` rule fails the first N calls per name, then lets them through."""
    flag = tmp_path / "on"
    rule = faults._Rule({"errno": "EIO", "op": "read", "names": ["abc"], "times": 1})
    assert rule.hits("read", "xabcx") and not rule.hits("read", "xabcx")
    assert not rule.hits("write", "abc") and not rule.hits("read", "other")
    switched = faults._Rule({"errno": "ENOSPC", "op": "write", "while_file": str(flag)})
    assert not switched.hits("write", "any")
    flag.touch()
    assert switched.hits("write", "any")
    assert switched.error("any").errno == errno.ENOSPC
