"""``ckpt report`` on a real run: the figures, the HTML page, the JSON twin and ``--all``."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord
from ckpt_agent.report import fleet_summary, load_run, plot_all, run_page, run_summary, traits_of
from ckpt_agent.report.data import iter_log
from ckpt_agent.storage.fs import LocalStorage

RealRun = Any  # the rp_run fixture (conftest.py)
runner = CliRunner()
PLOTS = ("loss", "score", "interval", "time", "bytes")


def _invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, ["report", *args], env={"COLUMNS": "200"})
    return res.exit_code, res.output


def _report(run: RealRun, *extra: str, work: Path | None = None, log: bool = True) -> str:
    """``ckpt report`` of ``run`` (with its decision log, or ``work``'s; none unless ``log``)."""
    args = ["--storage", str(run.store), "--run-id", run.run_id, *extra]
    if log:
        args += ["--work-dir", str(work or run.work)]
    code, text = _invoke(*args)
    assert code == 0, text
    return text


def _summary(run: RealRun) -> dict[str, Any]:
    data = load_run(LocalStorage(run.store), run.run_id, run.work)
    return run_summary(run.run_id, data.records, data.events, data.audit)


def test_summary_of_a_real_run(rp_run: RealRun) -> None:
    s = _summary(rp_run)
    steps = [p[0] for p in s["series"]["loss"]]
    assert steps[0] == 0 and steps[-1] == 69 and len(steps) >= 70  # loss of every step
    assert all(len(p[2]) >= 3 for p in s["series"]["score"])  # each layer's contribution
    assert {c["rule"] for c in s["series"]["interval_changes"]} >= {"base"}
    tiers = {r["tier"] for r in s["saves"]}
    assert tiers == {"pulse", "full"}
    committed = [r for r in s["saves"] if r["persist_s"] is not None]
    assert committed and all(r["stall_s"] is not None for r in committed)
    assert all(0 < r["bytes_written"] <= r["bytes_full"] for r in committed)
    assert all(r["bytes_raw"] > 0 for r in committed)  # raw_bytes of the `committed` events
    assert s["bytes_raw"] > 0 and s["compression_share"] == pytest.approx(
        sum(r["bytes_full"] for r in committed) / sum(r["bytes_raw"] for r in committed)
    )
    # the flipped checkpoint: corrupted verdict (from the resume), deleted by retention
    bad = next(r for r in s["saves"] if r["checkpoint"] == rp_run.rejected)
    assert bad["status"] == "corrupted" and "corrupted bytes" in bad["reason"]
    # (a checkpoint sharing the flipped blob, if any, is corrupted too)
    assert s["verdicts"]["corrupted"] >= 1 and s["verdicts"]["valid"] >= 5
    assert any(rp_run.rejected in r["deleted"] for r in s["retention"])
    # two starts: fresh, then a resume past the rejected newest checkpoint (rung 2, or
    # further when the scheduler's timing put the flipped blob into a second checkpoint)
    first, second = s["restarts"]
    assert first["action"] == "fresh" and first["rung"] is None
    assert second["action"] == "resume" and second["rung"] >= 2
    assert second["rung"] == len(second["rejected"]) + 1
    assert rp_run.rejected in second["rejected"][0]
    assert second["seconds"] > 0  # the fresh start is a start too: under load it can be the slower
    assert s["recovery"]["max_s"] == max(first["seconds"], second["seconds"])
    assert s["recovery"]["success_rate"] == 1.0
    assert 0 < s["io_share"] < 1 and s["stall_s"] > 0 and s["persist_s"] > 0
    # health: one corrupted verdict of the judged ones, times (1 - IO share)
    valid, judged = s["verdicts"]["valid"], s["verdicts"]["valid"] + s["verdicts"]["corrupted"]
    expected = 100 * valid / judged * (1 - s["io_share"])
    assert s["health"] == pytest.approx(expected, abs=0.01)
    assert "corrupted checkpoints" in traits_of(s) and "restarted" in traits_of(s)


def test_flash_mode_run_reports_persists_verdicts_retention_and_bytes(
    rp_flash_run: RealRun,
) -> None:
    assert (rp_flash_run.work / "sidecar.jsonl").is_file()
    assert not any(e["event"] == "committed" for e in rp_flash_run.events())
    s = _summary(rp_flash_run)
    saves = s["saves"]
    assert len(saves) >= 6 and {r["tier"] for r in saves} == {"pulse", "full"}
    for r in saves:  # every save: persist time (persisted), stall (snapshot, by step+tier)
        assert r["persist_s"] is not None and r["stall_s"] is not None, r
        assert 0 < r["bytes_written"] <= r["bytes_full"] and r["bytes_raw"] > 0, r
        assert r["status"] == "valid" and r["validation_s"] is not None, r  # sidecar verdicts
    assert s["persist_s"] > 0 and s["stall_s"] > 0 and s["bytes_raw"] > 0
    # retention from the persister's log; what it deleted is still listed, not stored
    deleted = {cid for r in s["retention"] for cid in r["deleted"]}
    assert deleted and deleted <= {r["checkpoint"] for r in saves if not r["stored"]}
    # the persister's own start/stop are not the run's: one (fresh) start
    assert [r["action"] for r in s["restarts"]] == ["fresh"]
    assert s["recovery"]["starts"] == 1


def test_unknown_bytes_read_n_a_not_zero() -> None:
    """A persisted event without byte counts (an older persister) and a stored record with
    no log: what is not known is None / "n/a", never 0 B (which would read as 100 % dedup)."""
    events = [
        {"event": "snapshot", "step": 5, "tier": "pulse", "stall_s": 0.01, "time": 1.0},
        {"event": "persisted", "checkpoint": "pulse_step_000000000005", "step": 5,
         "committed": True, "persist_s": 0.2, "time": 2.0},
        {"event": "persisted", "checkpoint": "pulse_step_000000000007", "step": 7,
         "committed": False, "persist_s": 0.2, "time": 3.0},  # another rank's part only
    ]  # fmt: skip
    stored = CheckpointRecord(id="full_step_000000000009", step=9, tier=Tier.FULL, size_bytes=4096)
    s = run_summary("r", [stored], events)
    first, last = s["saves"]
    assert first["checkpoint"] == "pulse_step_000000000005" and first["tier"] == "pulse"
    assert first["stall_s"] == 0.01 and first["persist_s"] == 0.2
    assert first["bytes_written"] is None and first["bytes_full"] is None
    assert last["bytes_written"] == 4096 and last["bytes_full"] is None  # size_bytes: written
    assert s["bytes_written"] == 4096 and s["bytes_full"] is None and s["bytes_raw"] is None
    assert s["dedup_share"] is None and s["compression_share"] is None
    page = run_page(s, {})
    assert "4.0 KiB / n/a / n/a" in page and "0 B" not in page


def test_restarts_say_where_the_state_came_from() -> None:
    """An in-place restart from this node's memory, a rank rehydrated from a peer's replica,
    and one sent to storage: each restart's line says which (#31)."""
    events = [
        {"event": "inplace_restore", "rank": 0, "outcome": "memory", "step": 14, "time": 1.0},
        {"event": "start", "rank": 0, "action": "resume_shm", "next_step": 15, "time": 1.5},
        {"event": "rehydrate", "rank": 1, "found": True, "step": 14, "source": "n1", "time": 1.0},
        {"event": "inplace_restore", "rank": 1, "outcome": "memory", "step": 14, "time": 1.1},
        {"event": "start", "rank": 1, "action": "resume_shm", "next_step": 15, "time": 1.6},
        {"event": "inplace_restore", "rank": 0, "outcome": "storage", "time": 5.0,
         "reason": "no shared-memory snapshot usable: ranks [1] have none"},
        {"event": "start", "rank": 0, "action": "resume", "next_step": 11, "time": 5.5},
        {"event": "start", "rank": 0, "action": "fresh", "time": 0.1},  # before any
    ]  # fmt: skip
    s = run_summary("r", [], events)
    assert [(r["action"], r["source"]) for r in s["restarts"]] == [
        ("fresh", ""),
        ("resume_shm", "shared memory (in place)"),
        ("resume_shm", "peer replica from n1 (step 14)"),
        ("resume", "storage: no shared-memory snapshot usable: ranks [1] have none"),
    ]
    assert "peer replica from n1 (step 14)" in run_page(s, {})


def test_html_report_is_self_contained(rp_run: RealRun, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    text = _report(rp_run, "--out", str(out))
    assert str(out) in text.replace("\n", "")
    page = out.read_text()
    for name in PLOTS:
        assert f'id="plot-{name}"><svg' in page
    assert "<script" not in page.lower()
    # nothing is fetched at view time: no src, no href but in-page (#id) ones of the SVGs
    assert not re.search(r"\b(src|href)\s*=\s*\"(?!#)", page)
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", page))
    assert all(u.startswith("http://www.w3.org/") for u in urls), urls
    assert "Content-Security-Policy" in page
    assert rp_run.rejected in page and "ladder rung" in page


def test_json_twin(rp_run: RealRun) -> None:
    doc = json.loads(_report(rp_run, "--json"))
    assert doc == json.loads(
        json.dumps(_summary(rp_run) | {"logs": doc["logs"], "skipped_lines": 0, "long_lines": 0})
    )
    assert doc["logs"] == [str(rp_run.work / "decisions.rank0.jsonl")]


def test_work_dir_repeats_to_merge_pods_logs(rp_flash_run: RealRun, tmp_path: Path) -> None:
    """One --work-dir per pod (here: the trainer's log and the persister's apart), merged."""
    trainer, persister = tmp_path / "pod-a" / "flash1", tmp_path / "pod-b" / "flash1"
    for d, name in ((trainer, "decisions.rank0.jsonl"), (persister, "sidecar.jsonl")):
        d.mkdir(parents=True)
        shutil.copy(rp_flash_run.work / name, d / name)
    doc = json.loads(_report(rp_flash_run, "--json", "--work-dir", str(persister), work=trainer))
    assert sorted(doc["logs"]) == [
        str(trainer / "decisions.rank0.jsonl"),
        str(persister / "sidecar.jsonl"),
    ]
    assert doc["saves"] == json.loads(json.dumps(_summary(rp_flash_run)["saves"]))
    # --all: each --work-dir a folder of per-run directories
    code, text = _invoke(
        "--storage", str(rp_flash_run.store), "--all", "--json",
        "--work-dir", str(trainer.parent), "--work-dir", str(persister.parent),
    )  # fmt: skip
    assert code == 0, text
    (run,) = json.loads(text)["runs"]
    assert run["run_id"] == "flash1" and "no decision log" not in run["traits"]
    assert run["checkpoints"] == len(doc["saves"])


def test_without_a_decision_log_storage_still_tells(rp_run: RealRun, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    _report(rp_run, "--out", str(out), log=False)
    page = out.read_text()
    assert "No decision log was read" in page and "full_step_000000000069" in page


def test_all_runs_and_what_low_runs_share(
    rp_run: RealRun, rp_clean_run: RealRun, tmp_path: Path
) -> None:
    store, work = tmp_path / "store", tmp_path / "work"
    for run in (rp_run, rp_clean_run):  # one storage root, one work dir per run id
        shutil.copytree(run.store / run.run_id, store / run.run_id)
        shutil.copytree(run.work, work / run.run_id)
    # health includes the IO share of wall time, which depends on the machine's load:
    # read both scores first, then draw the "low" line between them
    code, text = _invoke("--storage", str(store), "--all", "--work-dir", str(work), "--json")
    assert code == 0, text
    health = {r["run_id"]: r["health"] for r in json.loads(text)["runs"]}
    assert health["run1"] < health["run2"]  # the run with a corrupted checkpoint scores lower
    low = f"{(health['run1'] + health['run2']) / 2:.4f}"
    code, text = _invoke(
        "--storage", str(store), "--all", "--work-dir", str(work), "--json", "--low", low
    )
    assert code == 0, text
    doc = json.loads(text)
    assert [r["run_id"] for r in doc["runs"]] == ["run1", "run2"]
    assert doc["low_runs"] == ["run1"]
    common = {c["trait"]: c for c in doc["common_traits"]}
    assert common["corrupted checkpoints"]["low_share"] == 1.0
    assert common["corrupted checkpoints"]["other_share"] == 0.0
    assert "restarted" not in common  # both runs restarted: nothing special about low runs
    assert doc["recovery_success_rate"] == 1.0
    out = tmp_path / "all.html"
    code, text = _invoke(
        "--storage", str(store), "--all", "--work-dir", str(work), "--out", str(out), "--low", low
    )
    assert code == 0, text
    page = out.read_text()
    assert 'id="plot-fleet"><svg' in page and "corrupted checkpoints" in page


def test_fleet_summary_recovery_rate_over_runs() -> None:
    def run(name: str, starts: int, ok: int, corrupted: int) -> dict[str, Any]:
        return {
            "run_id": name,
            "health": 100.0 * ok / starts * (0.5 if corrupted else 1.0),
            "mean_score": 0.1,
            "io_share": 0.01,
            "checkpoints": 4,
            "verdicts": {"valid": 3, "corrupted": corrupted},
            "recovery": {"starts": starts, "succeeded": ok, "success_rate": ok / starts},
            "backpressure": {},
            "anomalies": [],
            "emergency_saves": 0,
            "manual_recoveries": [],
            "has_log": True,
        }

    f = fleet_summary([run("a", 4, 4, 0), run("b", 2, 1, 1), run("c", 3, 2, 0)], low=80)
    assert f["recovery_success_rate"] == pytest.approx(7 / 9)
    assert f["low_runs"] == ["b", "c"]
    common = {c["trait"]: c for c in f["common_traits"]}
    assert common["failed starts"]["low_runs"] == 2 and common["failed starts"]["other_share"] == 0
    assert common["corrupted checkpoints"]["low_share"] == 0.5  # at least half: listed
    assert fleet_summary([])["mean_health"] is None


def test_hostile_log_is_escaped_and_damaged_lines_skipped(rp_run: RealRun, tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(rp_run.work, work)
    log = work / "decisions.rank0.jsonl"
    evil = '<script>alert(1)</script><img src="http://evil.example/x">'
    lines = log.read_text().splitlines()
    for i, line in enumerate(lines):
        e = json.loads(line)
        if e["event"] == "decision":
            e["interval_rule"] = evil + "$\\frac{1}{0}$"
        if e["event"] == "start":
            e["reason"] = evil
        lines[i] = json.dumps(e)
    log.write_text("\n".join([*lines, "{not json", "[1,2]", '{"event": 3}', "\x00\xff"]) + "\n")
    data = load_run(LocalStorage(rp_run.store), rp_run.run_id, work)
    assert data.skipped_lines == 4
    out = tmp_path / "r.html"
    _report(rp_run, "--out", str(out), work=work)
    page = out.read_text()
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_progress_while_reading_a_large_log(tmp_path: Path) -> None:
    log = tmp_path / "decisions.rank0.jsonl"
    line = json.dumps({"event": "decision", "step": 1, "score": 0.1, "time": 1.0}) + "\n"
    log.write_text(line * 20000)
    seen: list[tuple[str, int, int]] = []
    n = sum(1 for _ in iter_log(log, lambda *a: seen.append(a)))
    assert n == 20000
    assert len(seen) >= 5 and seen[-1] == (log.name, log.stat().st_size, log.stat().st_size)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)


def test_usage_errors_say_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    code, text = _invoke("--storage", str(tmp_path / "store"))
    assert code == 2 and "--run-id" in text
    code, text = _invoke(
        "--storage", str(tmp_path / "store"), "--run-id", "r", "--work-dir", str(tmp_path / "nope")
    )
    assert code == 2 and "CKPT_WORK_DIR" in text
    code, text = _invoke("--storage", str(tmp_path / "store"), "--run-id", "../etc")
    assert code == 2 and "run id" in text.lower()
    code, text = _invoke("--storage", str(tmp_path / "store"), "--all", "--low", "nan")
    assert code == 2


def test_plots_without_data_still_render() -> None:
    s = run_summary("empty", [], [])
    assert s["health"] == 100.0 and s["io_share"] is None and not s["has_log"]
    svgs = plot_all(s)
    assert set(svgs) == set(PLOTS) and all(v.startswith("<svg") for v in svgs.values())
    assert "no decisions in the decision log" in svgs["score"]


def test_emergency_saves_count_each_save_once() -> None:
    """A SIGTERM logs ``sigterm`` and ``save_now`` for one save; a save-now signal file is
    an emergency decision of the scheduler (no ``save_now`` event): each counts once."""
    events = [
        {"event": "decision", "step": 10, "emergency": True, "save": True, "time": 1.0},
        {"event": "decision", "step": 11, "emergency": False, "save": False, "time": 2.0},
        {"event": "sigterm", "step": 33, "time": 3.0},
        {"event": "save_now", "step": 33, "tier": "full", "reason": "SIGTERM", "time": 3.0},
        {"event": "decision", "step": 33, "emergency": True, "save": True, "time": 3.0},
    ]
    assert run_summary("r", [], events)["emergency_saves"] == 2
    assert run_summary("r", [], [])["emergency_saves"] == 0
