"""``ckpt report`` streams the logs line by line with a per-line cap (issue #28): a huge
one-line log (600 MiB made ``MemoryError``) is skipped unread and counted, never held."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.report.data import LINE_MAX, Skip, iter_log, load_run
from ckpt_agent.storage.fs import LocalStorage

RealRun = Any  # the rp_run fixture (conftest.py)
HUGE = 40 << 20  # a few tens of MiB prove the streaming (600 MiB died before)
GOOD = json.dumps({"event": "decision", "step": 1, "score": 0.5, "time": 1.0}).encode() + b"\n"


def _huge_line(path: Path, size: int, *, newline: bool = True) -> None:
    block = b'{"event": "decision", "pad": "' + b"x" * ((1 << 20) - 30)
    with open(path, "ab") as f:
        for _ in range(size // len(block)):
            f.write(block)
        if newline:
            f.write(b'"}\n')


def test_an_over_long_line_is_skipped_unread_and_counted(tmp_path: Path) -> None:
    log = tmp_path / "decisions.rank0.jsonl"
    log.write_bytes(GOOD)
    _huge_line(log, HUGE)
    with open(log, "ab") as f:
        f.write(GOOD + b"x" * LINE_MAX + b"\n" + b"{not json\n" + GOOD)
    _huge_line(log, 3 << 20, newline=False)  # the last line, without a newline

    tracemalloc.start()
    try:
        got = list(iter_log(log))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    kinds = [g if isinstance(g, Skip) else "ok" for g in got]
    ok, long, bad = "ok", Skip.TOO_LONG, Skip.MALFORMED
    assert kinds == [ok, long, ok, bad, bad, ok, long]
    assert peak < 8 * LINE_MAX  # streamed: a line is never held whole
    data = load_run(LocalStorage(tmp_path / "store"), "run1", tmp_path)
    assert (data.skipped_lines, data.long_lines, len(data.events)) == (4, 2, 3)


def test_a_line_of_exactly_the_cap_is_read(tmp_path: Path) -> None:
    log = tmp_path / "decisions.rank0.jsonl"
    obj = {"event": "decision", "pad": ""}
    obj["pad"] = "y" * (LINE_MAX - len(json.dumps(obj)))
    line = json.dumps(obj).encode()
    assert len(line) == LINE_MAX
    log.write_bytes(line + b"\n" + line + b"x\n" + line)
    got = list(iter_log(log))
    assert got[0] == obj and got[1] is Skip.TOO_LONG and got[2] == obj


def test_the_report_says_how_many_lines_it_skipped(rp_run: RealRun, tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(rp_run.work, work)
    _huge_line(work / "decisions.rank0.jsonl", HUGE)
    args = ["report", "--storage", str(rp_run.store), "--run-id", rp_run.run_id]
    args += ["--work-dir", str(work)]
    res = CliRunner().invoke(app, [*args, "--json"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["skipped_lines"], doc["long_lines"]) == (1, 1)
    assert doc["saves"]  # the rest of the log was read
    assert "1 log line(s) skipped: 1 over the 1 MiB line limit" in res.stderr.replace("\n", " ")
    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, [*args, "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "1 log line(s) skipped: 1 longer than the line limit" in out.read_text()
