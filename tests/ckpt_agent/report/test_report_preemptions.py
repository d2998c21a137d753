"""``ckpt report``'s Kueue preemptions: the run figure, the HTML section, the fleet column.

A real run (``rp_preempted_run``, conftest.py) is drained (a save-now that is no
preemption), then preempted by Kueue (the operator's signal, SIGTERM) and resumed;
``rp_run`` was never preempted. The decision-log-only cases (no resume in the log, a
fresh start, several ranks, a SIGTERM alone) are built from events in the same shape.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.report import fleet_page, fleet_summary, load_run, run_page, run_summary
from ckpt_agent.report.preemptions import kueue_reason, preemptions
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.text import is_clean
from ckpt_operator.model import constants as c
from ckpt_operator.planners.disruption_signals import preemption_disruption, save_now_patch
from ckpt_operator.planners.workload import Eviction
from tests.ckpt_agent.report.conftest import (
    DRAIN_AT,
    DRAIN_REQUEST,
    EVICTED_LAST,
    PREEMPT_AT,
    SIGTERM_AT,
)

RealRun = Any  # the conftest fixtures' RealRun
runner = CliRunner()


def _summary(run: RealRun, work: Path | None = None) -> dict[str, Any]:
    data = load_run(LocalStorage(run.store), run.run_id, work or run.work)
    return run_summary(run.run_id, data.records, data.events, data.audit)


def _section(page: str) -> str:
    """The HTML of the Kueue preemptions section."""
    start = page.index("<h2>Kueue preemptions</h2>")
    return page[start : page.index("<h2>", start + 5)]


def test_a_run_never_preempted_has_none(rp_run: RealRun) -> None:
    s = _summary(rp_run)
    p = s["preemptions"]
    assert p == {"count": 0, "steps_lost": None, "lost_unknown": 0, "saved": 0, "rows": []}
    assert "preempted" not in fleet_summary([s])["runs"][0]["traits"]
    assert "none" in _section(run_page(s, {}))


def test_one_preemption_saved_then_resumed_with_steps_lost(rp_preempted_run: RealRun) -> None:
    s = _summary(rp_preempted_run)
    (row,) = s["preemptions"]["rows"]  # the drain before it is not one
    assert row["request"].startswith("Preemption-") and row["time"] is not None
    assert row["reason"] is None  # the agent logs the request id only
    # the signal's emergency save, then SIGTERM's: both committed and valid
    assert [(v["trigger"], v["step"], v["status"]) for v in row["saves"]] == [
        ("save-now", PREEMPT_AT, "valid"),
        ("SIGTERM", SIGTERM_AT, "valid"),
    ]
    assert row["step_saved"] == SIGTERM_AT
    assert row["checkpoint"] == f"full_step_{SIGTERM_AT:012d}"
    # the pod trained on to EVICTED_LAST; the re-admitted run resumed from SIGTERM's save
    assert row["last_step"] == EVICTED_LAST
    assert row["resume_action"] == "resume" and row["resume_checkpoint"] == row["checkpoint"]
    assert row["resumed_from"] == SIGTERM_AT
    assert row["steps_lost"] == EVICTED_LAST - SIGTERM_AT == 3
    p = s["preemptions"]
    assert (p["count"], p["steps_lost"], p["lost_unknown"], p["saved"]) == (1, 3, 0, 1)
    section = _section(run_page(s, {}))
    assert row["request"] in section and "not in the log" in section
    assert f"{SIGTERM_AT} (full_step_{SIGTERM_AT:012d})" in section
    assert f"save-now step {PREEMPT_AT} valid; SIGTERM step {SIGTERM_AT} valid" in section
    assert "1 preemption(s), 3 step(s) lost in all." in section
    assert "Kueue preemptions (steps lost)<b>1 (3)</b>" in run_page(s, {})


def test_a_drain_save_now_is_not_a_preemption(rp_preempted_run: RealRun) -> None:
    """The drain's signal took an emergency save like the preemption's, and is not counted."""
    events = rp_preempted_run.events()
    signals = [e["request"] for e in events if e["event"] == "signal"]
    assert DRAIN_REQUEST in signals and len(signals) == 2
    drained = [e for e in events if e["event"] == "decision" and e["step"] == DRAIN_AT]
    assert drained[0]["emergency"] and DRAIN_REQUEST in drained[0]["reason"]
    s = _summary(rp_preempted_run)
    assert f"full_step_{DRAIN_AT:012d}" in {r["checkpoint"] for r in s["saves"]}
    assert s["preemptions"]["count"] == 1
    assert all(v["step"] != DRAIN_AT for r in s["preemptions"]["rows"] for v in r["saves"])
    # without the preemption's signal nothing is one: the SIGTERM alone is not Kueue's
    only_drain = [
        e for e in events if not (e["event"] == "signal" and e["request"] != DRAIN_REQUEST)
    ]
    assert preemptions(only_drain, s["saves"]) == []


def test_without_the_evicted_pods_logs_storage_still_tells(rp_preempted_run: RealRun) -> None:
    """The evicted pod's work directory went with it: the signal's emergency checkpoint
    names the request in its stored reason; the steps lost are unknown."""
    data = load_run(LocalStorage(rp_preempted_run.store), rp_preempted_run.run_id, None)
    assert not data.events
    s = run_summary(rp_preempted_run.run_id, data.records, data.events, data.audit)
    (row,) = s["preemptions"]["rows"]
    assert row["request"] == _summary(rp_preempted_run)["preemptions"]["rows"][0]["request"]
    assert row["saves"] == [
        {
            "step": PREEMPT_AT,
            "trigger": "save-now",
            "checkpoint": f"full_step_{PREEMPT_AT:012d}",
            "status": "valid",
        }
    ]
    assert row["step_saved"] == PREEMPT_AT and row["time"] is not None
    assert row["steps_lost"] is None and s["preemptions"]["lost_unknown"] == 1
    assert "preempted" in fleet_summary([s])["runs"][0]["traits"]
    # the drain's emergency checkpoint names its own request: not a preemption
    drained = next(r for r in data.records if r.step == DRAIN_AT)
    assert drained.emergency and DRAIN_REQUEST in drained.reason


def test_fleet_view_has_a_preemptions_column_and_trait(
    rp_run: RealRun, rp_preempted_run: RealRun, tmp_path: Path
) -> None:
    store, work = tmp_path / "store", tmp_path / "work"
    for run in (rp_run, rp_preempted_run):
        shutil.copytree(run.store / run.run_id, store / run.run_id)
        shutil.copytree(run.work, work / run.run_id)
    args = ["report", "--storage", str(store), "--all", "--work-dir", str(work)]
    res = runner.invoke(app, [*args, "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    runs = {r["run_id"]: r for r in json.loads(res.output)["runs"]}
    assert runs["pre1"]["preemptions"] == 1 and runs["pre1"]["preemption_steps_lost"] == 3
    assert "preempted" in runs["pre1"]["traits"]
    assert runs["run1"]["preemptions"] == 0 and "preempted" not in runs["run1"]["traits"]
    out = tmp_path / "all.html"
    res = runner.invoke(app, [*args, "--out", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "<th>preemptions (steps lost)</th>" in page and "<td>1 (3)</td>" in page


def test_an_odd_reason_is_cleaned_and_escaped(rp_preempted_run: RealRun, tmp_path: Path) -> None:
    """The operator's reason text, when a log carries it, names Kueue's reason; a hostile
    one (control and bidi characters, markup) is cleaned in the summary, escaped in HTML."""
    work = tmp_path / "work"
    shutil.copytree(rp_preempted_run.work, work)
    log = work / "decisions.rank0.jsonl"
    evil = "Pre\x1b[31mempted\u202e<img src=x>"
    lines = []
    for line in log.read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "signal" and e["request"].startswith("Preemption-"):
            e["request"] = e["request"] + "\x07<script>"
            e["reason"] = f"Preemption: Kueue evicted the job's Workload ({evil}): \x00"
        lines.append(json.dumps(e))
    log.write_text("\n".join(lines) + "\n")
    s = _summary(rp_preempted_run, work)
    # storage still holds the true request id (the signal save's reason): a row of its own
    row, stored = s["preemptions"]["rows"]  # by time: the signal, then the checkpoint
    assert row["request"] == stored["request"] + "\\x07<script>"
    assert is_clean(row["reason"]) and is_clean(row["request"]) and is_clean(row["message"])
    assert row["reason"] == "Pre\\x1b[31mempted\\u202e<img src=x>"
    assert row["request"].endswith("\\x07<script>") and "\\x00" in row["message"]
    assert row["steps_lost"] == 3  # the rest still reads
    page = run_page(s, {})
    assert "<img" not in page and "<script" not in page
    assert "Pre\\x1b[31mempted\\u202e&lt;img src=x&gt;" in _section(page)
    # a reason that is not text is no reason, and breaks nothing
    e = {"event": "signal", "request": "Preemption-1", "kind": "save", "reason": {"a": 1}}
    (odd,) = preemptions([e])
    assert odd["reason"] is None and odd["message"] == "" and odd["steps_lost"] is None


def test_kueue_reason_from_the_operators_text() -> None:
    """The text the operator writes (``ckpt.dev/save-now-reason``) names Kueue's reason."""
    for reason in ("Preempted", "PodsReadyTimeout", "ClusterQueueStopped"):
        disruption = preemption_disruption(Eviction(reason, "to fit a workload", "t0", "u"))
        pod = {"metadata": {"labels": {c.LABEL_INJECTED: "true"}}}
        patch = save_now_patch(pod, disruption)
        assert patch is not None
        text = patch["metadata"]["annotations"][c.ANN_SAVE_NOW_REASON]
        assert kueue_reason(text) == reason
        e = {"event": "signal", "request": disruption.signal, "kind": "save", "reason": text}
        (row,) = preemptions([e])
        assert row["reason"] == reason and row["request"] == disruption.request_id
    assert kueue_reason("node n1 is cordoned (spec.unschedulable)") is None


def _ev(event: str, time: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "time": time, **fields}


def _decisions(first: int, last: int, t0: float) -> list[dict[str, Any]]:
    return [
        _ev("decision", t0 + i, step=s, save=False) for i, s in enumerate(range(first, last + 1))
    ]


def test_without_a_resume_in_the_log_the_loss_is_unknown() -> None:
    events = [
        _ev("start", 0.0, action="fresh", checkpoint=None, next_step=0),
        *_decisions(0, 7, 1.0),
        _ev("signal", 9.0, request="Preemption-abc", kind="save"),
        _ev("decision", 10.0, step=8, save=True, emergency=True, tier="full"),
    ]
    saves = [{"checkpoint": "full_step_000000000008", "step": 8, "tier": "full", "status": "valid"}]
    s = run_summary("r", [], [*events, _ev("committed", 11.0, checkpoint=saves[0]["checkpoint"],
                                            step=8, tier="full", persist_s=0.1)])  # fmt: skip
    p = s["preemptions"]
    assert (p["count"], p["steps_lost"], p["lost_unknown"], p["saved"]) == (1, None, 1, 1)
    (row,) = p["rows"]
    assert row["step_saved"] == 8 and row["last_step"] == 8 and row["steps_lost"] is None
    section = _section(run_page(s, {}))
    assert "not in the log" in section and "unknown" in section
    assert fleet_summary([s])["runs"][0]["preemption_steps_lost"] is None
    assert "<td>1 (unknown)</td>" in fleet_page(fleet_summary([s]), None)


def test_a_save_that_did_not_commit_and_a_fresh_start_after_it() -> None:
    """The emergency save never committed (the grace ran out) and nothing else was in
    storage: the re-admitted run started fresh, every trained step lost."""
    events = [
        *_decisions(0, 4, 1.0),
        _ev("signal", 9.0, request="Preemption-abc", kind="save"),
        _ev("decision", 10.0, step=5, save=True, emergency=True, tier="full"),
        _ev("start", 20.0, action="fresh", checkpoint=None, next_step=0),
        *_decisions(0, 2, 21.0),
    ]
    (row,) = preemptions(events)
    assert row["saves"] == [{"step": 5, "trigger": "save-now", "checkpoint": None, "status": ""}]
    assert row["step_saved"] is None and row["checkpoint"] is None
    assert row["resumed_from"] == -1 and row["steps_lost"] == 6  # steps 0..5
    section = _section(run_page(run_summary("r", [], events), {}))
    assert "not committed" in section and "fresh: nothing kept" in section


def test_several_ranks_and_two_preemptions() -> None:
    """Every rank logs the signal, its SIGTERM and its start: one preemption per request
    id, each closed by the first start after it; a repeated id is the same preemption."""
    events: list[dict[str, Any]] = [*_decisions(0, 9, 0.0)]
    for rank in (0, 1):
        events += [
            _ev("signal", 10.0 + rank / 10, request="Preemption-one", kind="save", rank=rank),
            _ev("sigterm", 12.0 + rank / 10, step=11, rank=rank),
        ]
    events += [
        _ev("decision", 11.0, step=10, save=True, emergency=True, tier="full"),
        _ev("decision", 12.5, step=11, save=True, emergency=True, tier="full"),
        _ev("decision", 13.0, step=12, save=False),
        _ev("start", 20.0, action="resume", checkpoint="full_step_000000000011", next_step=12,
            rank=0),
        _ev("start", 20.1, action="resume", checkpoint="full_step_000000000011", next_step=12,
            rank=1),
        *_decisions(12, 20, 21.0),
        _ev("signal", 31.0, request="Preemption-two warning x", kind="warning"),  # not a save
        _ev("signal", 32.0, request="Preemption-two", kind="save"),
        _ev("signal", 32.5, request="Preemption-two", kind="save", rank=1),
        _ev("decision", 33.0, step=21, save=True, emergency=True, tier="full"),
        *_decisions(22, 23, 34.0),
        _ev("start", 40.0, action="resume", checkpoint="full_step_000000000021", next_step=22),
        _ev("signal", 41.0, request="Preemption-one", kind="save", source="sidecar"),
    ]  # fmt: skip
    saves = [
        {"checkpoint": f"full_step_{s:012d}", "step": s, "tier": "full", "status": "valid"}
        for s in (10, 11, 21)
    ]
    first, second = preemptions(events, saves)
    assert first["request"] == "Preemption-one" and first["time"] == 10.0
    assert [(v["trigger"], v["step"]) for v in first["saves"]] == [
        ("save-now", 10),
        ("SIGTERM", 11),
    ]
    assert first["step_saved"] == 11 and first["last_step"] == 12 and first["steps_lost"] == 1
    assert second["request"] == "Preemption-two" and second["step_saved"] == 21
    assert second["last_step"] == 23 and second["resumed_from"] == 21
    assert second["steps_lost"] == 2


@pytest.mark.parametrize("request_", ["", "   ", None, 7, "preemption-abc", "Preempted"])
def test_requests_that_do_not_name_a_preemption(request_: object) -> None:
    e = {"event": "signal", "request": request_, "kind": "save", "time": 1.0}
    assert preemptions([e, _ev("sigterm", 2.0, step=3)]) == []
