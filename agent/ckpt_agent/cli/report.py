"""``ckpt report``: one self-contained HTML page (or JSON) about a run's checkpointing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from ckpt_agent.cli.common import (
    ConfigOpt,
    RunOpt,
    StorageOpt,
    err,
    fail,
    guarded,
    load_policy,
    non_negative,
    open_store,
    plain,
    safe,
    say,
)
from ckpt_agent.format.layout import validate_run_id
from ckpt_agent.format.listing import list_runs
from ckpt_agent.report import (
    LOW_HEALTH,
    available,
    fleet_page,
    fleet_plot,
    fleet_summary,
    load_run,
    plot_all,
    run_page,
    run_summary,
)
from ckpt_agent.report.data import LINE_MAX
from ckpt_agent.storage import Storage

__all__ = ["report"]

WorkDirOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--work-dir",
        help="A pod's work directory with the decision logs (decisions.rank*.jsonl, "
        "sidecar*.jsonl); default CKPT_WORK_DIR. Repeat it to merge several pods' "
        "(each pod of the run, each restart). With --all: a folder with one such "
        "directory per run id (repeatable too).",
    ),
]


class _Progress:
    """Progress lines on stderr while reading (one task per file or listing)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, what: str, done: int, total: int) -> None:
        task = self.tasks.get(what)
        if task is None:
            task = self.tasks[what] = self.progress.add_task(f"reading {safe(what)}", total=total)
        self.progress.update(task, completed=done, total=total)


def _summary(store: Storage, run_id: str, work_dirs: list[Path], cb: _Progress) -> dict[str, Any]:
    data = load_run(store, run_id, work_dirs, cb)
    s = run_summary(run_id, data.records, data.events, data.audit)
    s["logs"] = data.logs
    s["skipped_lines"] = data.skipped_lines
    s["long_lines"] = data.long_lines
    return s


def _warn_skipped(summaries: list[dict[str, Any]]) -> None:
    """One warning line on stderr when log lines were skipped (the page says it too)."""
    skipped = sum(int(s.get("skipped_lines", 0)) for s in summaries)
    long = sum(int(s.get("long_lines", 0)) for s in summaries)
    if skipped:
        err.print(
            f"[yellow]warning:[/] {skipped} log line(s) skipped: {long} over the "
            f"{LINE_MAX // (1 << 20)} MiB line limit (not read), {skipped - long} not JSON "
            "objects (damaged or truncated)",
            soft_wrap=True,
        )


def _write(text: str, out: Path | None, default: str) -> Path | None:
    if out is None and default == "-":
        typer.echo(text, nl=False)
        return None
    path = out or Path(default)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise fail(f"cannot write {path}: {e.strerror} (pass --out to a writable file)") from None
    return path


@guarded
def report(
    storage: StorageOpt = "",
    run_id: RunOpt = "",
    config: ConfigOpt = None,
    work_dir: WorkDirOpt = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Report over every run of the storage root.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Output file (default ckpt-report-<run>.html; JSON goes to stdout)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Write the figures as JSON.")] = False,
    low: Annotated[
        float,
        typer.Option(
            "--low", callback=non_negative, help="--all: runs under this health score are 'low'."
        ),
    ] = LOW_HEALTH,
) -> None:
    """Report what the checkpointing did: one self-contained HTML file (no network to view).

    For one run: loss with checkpoint markers by tier, score and each layer's
    contribution, the dynamic interval and its rule, stall/persist time and
    bytes written against a full save per checkpoint, validation verdicts,
    retention actions, restarts (ladder rung, recovery time). The decision logs
    come from --work-dir (CKPT_WORK_DIR; repeat it to merge the logs of every pod
    the run had); checkpoints and verdicts from storage.
    With --all: health score, IO share and recovery success per run, and what
    the low-scoring runs have in common. --json writes the same figures as JSON.
    """
    store = open_store(storage, load_policy(config))
    work_dirs = list(work_dir or [])
    if not work_dirs and os.environ.get("CKPT_WORK_DIR"):
        work_dirs = [Path(os.environ["CKPT_WORK_DIR"])]
    for d in work_dirs:
        if not d.is_dir():
            raise fail(f"--work-dir {d} is not a directory (the pod's CKPT_WORK_DIR)")
    if not all_ and not run_id:
        raise fail("no run given: pass --run-id ID (or set CKPT_RUN_ID), or --all")
    if not all_:
        try:
            validate_run_id(run_id)
        except ValueError as e:
            raise fail(plain(e)) from None
    with Progress(
        TextColumn("{task.description}"), BarColumn(), console=err, transient=True
    ) as progress:
        cb = _Progress(progress)
        if all_:
            runs = list_runs(store)
            summaries = [_summary(store, r, [d / r for d in work_dirs], cb) for r in runs]
            result: dict[str, Any] = fleet_summary(summaries, low)
        else:
            result = _summary(store, run_id, work_dirs, cb)
            summaries = [result]
            if not result["saves"] and not result["has_log"]:
                raise fail(
                    f"run {run_id!r} has no checkpoints in {store.url} and no decision "
                    "log was given (--work-dir)"
                )
    _warn_skipped(summaries)
    name = "all" if all_ else run_id
    if as_json:
        _write(json.dumps(result, indent=2, default=str) + "\n", out, "-")
        return
    if not available():
        err.print(
            "[yellow]warning:[/] matplotlib is missing: the report has no plots "
            '(pip install "ckpt-operator\\[report]")'
        )
    if all_:
        page = fleet_page(result, fleet_plot(result) if available() else None)
    else:
        page = run_page(result, plot_all(result) if available() else {})
    path = _write(page, out, f"ckpt-report-{name}.html")
    say(f"report written to {safe(path)}")
