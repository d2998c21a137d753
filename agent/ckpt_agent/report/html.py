"""A run summary (or a fleet summary) as one self-contained HTML page.

Inline CSS and inline SVG only: no script, no external resource (a
Content-Security-Policy forbids loading any), so the file views the same offline
and a hostile stored string can neither run code nor call out: every stored
value goes through :func:`html.escape`.
"""

from __future__ import annotations

import datetime
import html
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["fleet_page", "run_page"]

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222;
 padding:0 16px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12.5px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4}.num{text-align:right}.bad{color:#b00020;font-weight:600}
.ok{color:#1b7f2a}.kpi{display:inline-block;margin:4px 18px 4px 0}
.kpi b{display:block;font-size:20px}.plot svg{max-width:100%;height:auto}
.muted{color:#777}
"""
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_ROWS_MAX = 500


def _e(v: object) -> str:
    return html.escape("" if v is None else str(v), quote=True)


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def _sec(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f} s"


def _size(v: float | None) -> str:
    if v is None:
        return "n/a"
    n = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(t: float | None) -> str:
    if t is None:
        return ""
    try:
        return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "?"


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], *, raw: bool = False) -> str:
    """A table; cells are escaped unless ``raw`` (cells we built from escaped parts)."""
    out = ["<table><tr>", *(f"<th>{_e(h)}</th>" for h in head), "</tr>"]
    n = 0
    for row in rows:
        n += 1
        if n > _ROWS_MAX:
            out.append(
                f'<tr><td colspan="{len(head)}" class="muted">… more rows in --json</td></tr>'
            )
            break
        out.append("<tr>" + "".join(f"<td>{c if raw else _e(c)}</td>" for c in row) + "</tr>")
    if n == 0:
        out.append(f'<tr><td colspan="{len(head)}" class="muted">none</td></tr>')
    out.append("</table>")
    return "".join(out)


def _kpis(items: Sequence[tuple[str, str]]) -> str:
    return "".join(f'<span class="kpi">{_e(k)}<b>{_e(v)}</b></span>' for k, v in items)


def _page(title: str, body: Sequence[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )


def _plot(name: str, svgs: dict[str, str]) -> str:
    svg = svgs.get(name)
    if svg is None:
        return '<p class="muted">plots need matplotlib: pip install "ckpt-operator[report]"</p>'
    return f'<div class="plot" id="plot-{_e(name)}">{svg}</div>'


def _status(v: str) -> str:
    cls = "ok" if v == "valid" else "bad" if v == "corrupted" else ""
    return f'<span class="{cls}">{_e(v)}</span>'


def _lost(n: int | None) -> str:
    return "unknown" if n is None else str(n)


def _preempted(count: object, lost: object) -> str:
    """``count (steps lost)`` of a run's preemptions ("0" when none)."""
    n = count if isinstance(count, int) else 0
    return "0" if not n else f"{n} ({_lost(lost if isinstance(lost, int) else None)})"


def _resumed(r: dict[str, Any]) -> str:
    if r["resume_action"] is None:
        return "not in the log"
    if r["resumed_from"] is None:
        return str(r["resume_action"])
    if r["resumed_from"] < 0:
        return f"{r['resume_action']}: nothing kept"
    return f"{r['resume_action']}: step {r['resumed_from']} ({r['resume_checkpoint'] or '?'})"


def _preemption_rows(p: dict[str, Any] | None) -> list[str]:
    """The Kueue preemptions section: one row per eviction, then the totals."""
    p = p or {"count": 0, "steps_lost": None, "lost_unknown": 0, "rows": []}
    rows = p.get("rows") or []
    out = ["<h2>Kueue preemptions</h2>"]
    out.append(
        _table(
            (
                "time (UTC)",
                "request",
                "Kueue's reason",
                "step saved",
                "emergency saves",
                "last step trained",
                "resumed",
                "steps lost",
            ),
            (
                (
                    _when(r["time"]),
                    r["request"],
                    r["reason"] or "not in the log",
                    "not committed"
                    if r["step_saved"] is None
                    else f"{r['step_saved']} ({r['checkpoint']})",
                    "; ".join(
                        f"{v['trigger']} step {v['step']}"
                        + (f" {v['status']}" if v["checkpoint"] else " not committed")
                        for v in r["saves"]
                    ),
                    "n/a" if r["last_step"] is None else str(r["last_step"]),
                    _resumed(r),
                    _lost(r["steps_lost"]),
                )
                for r in rows
            ),
        )
    )
    if rows:
        unknown = int(p.get("lost_unknown") or 0)
        out.append(
            f"<p>{len(rows)} preemption(s), {_e(_lost(p.get('steps_lost')))} step(s) lost in all"
            + (f" ({unknown} with no resume in the log: unknown)" if unknown else "")
            + ".</p>"
        )
    return out


def run_page(s: dict[str, Any], svgs: dict[str, str]) -> str:
    """The HTML report of one run (``svgs`` from :func:`~ckpt_agent.report.plots.plot_all`)."""
    rec = s["recovery"]
    body = [
        f"<h1>Checkpointing report: {_e(s['run_id'])}</h1>",
        _kpis(
            [
                ("health score", f"{s['health']:.1f}"),
                ("IO share of wall time", _pct(s["io_share"])),
                ("checkpoints", str(s["checkpoints"])),
                (
                    "bytes written / full saves / raw",
                    f"{_size(s['bytes_written'])} / {_size(s['bytes_full'])}"
                    f" / {_size(s['bytes_raw'])}",
                ),
                ("dedup: written of full", _pct(s["dedup_share"])),
                ("compression: stored (with manifests) of raw", _pct(s["compression_share"])),
                ("recovery success", _pct(rec["success_rate"])),
                ("mean recovery time", _sec(rec["mean_s"])),
                (
                    "Kueue preemptions (steps lost)",
                    _preempted(
                        (s.get("preemptions") or {}).get("count"),
                        (s.get("preemptions") or {}).get("steps_lost"),
                    ),
                ),
            ]
        ),
    ]
    if not s["has_log"]:
        body.append(
            '<p class="bad">No decision log was read: point --work-dir at the pod\'s '
            "CKPT_WORK_DIR for loss, score, interval and timing plots.</p>"
        )
    skipped, long = int(s.get("skipped_lines") or 0), int(s.get("long_lines") or 0)
    if skipped:
        body.append(
            f'<p class="bad">{skipped} log line(s) skipped: {long} longer than the line '
            f"limit (not read), {skipped - long} not JSON objects (damaged or truncated).</p>"
        )
    body += [
        "<h2>Loss and checkpoints</h2>",
        _plot("loss", svgs),
        "<h2>Score</h2>",
        _plot("score", svgs),
        "<h2>Interval</h2>",
        _plot("interval", svgs),
    ]
    body.append(
        _table(
            ("from step", "interval", "rule"),
            (
                (str(c["step"]), str(c["interval"]), c["rule"])
                for c in s["series"]["interval_changes"]
            ),
        )
    )
    body += ["<h2>Cost per save</h2>", _plot("time", svgs), _plot("bytes", svgs)]
    body.append("<h2>Checkpoints and validation verdicts</h2>")
    body.append(
        _table(
            (
                "checkpoint",
                "step",
                "tier",
                "verdict",
                "stall",
                "persist",
                "written",
                "full",
                "raw",
                "reason",
            ),
            (
                (
                    _e(r["checkpoint"]),
                    str(r["step"]),
                    _e(r["tier"]),
                    _status(r["status"]),
                    _sec(r["stall_s"]),
                    _sec(r["persist_s"]),
                    _size(r["bytes_written"]),
                    _size(r["bytes_full"]),
                    _size(r["bytes_raw"]),
                    _e(r["reason"]),
                )
                for r in s["saves"]
            ),
            raw=True,
        )
    )
    body.append("<h2>Restarts and resumes</h2>")
    body.append(
        _table(
            (
                "time (UTC)",
                "action",
                "from",
                "checkpoint",
                "ladder rung",
                "recovery time",
                "reason",
                "rejected",
            ),
            (
                (
                    _when(r["time"]),
                    r["action"],
                    r.get("source", ""),
                    r["checkpoint"] or "",
                    r["rung"] or "",
                    _sec(r["seconds"]),
                    r["reason"],
                    "; ".join(r["rejected"]),
                )
                for r in s["restarts"]
            ),
        )
    )
    body += _preemption_rows(s.get("preemptions"))
    if s["manual_recoveries"]:
        body.append("<h2>Manual recoveries (audit.log)</h2>")
        keys = sorted({k for a in s["manual_recoveries"] for k in a})[:10]
        body.append(
            _table(keys, ([str(a.get(k, "")) for k in keys] for a in s["manual_recoveries"]))
        )
    body.append("<h2>Retention actions</h2>")
    body.append(
        _table(
            ("time (UTC)", "deleted", "why", "blobs deleted", "freed"),
            (
                (_when(r["time"]), cid, why, str(r["blobs_deleted"] or 0), _size(r["bytes_freed"]))
                for r in s["retention"]
                for cid, why in (r["deleted"].items() or [("", "")])
            ),
        )
    )
    if s["anomalies"]:
        body.append("<h2>Anomalies</h2>")
        body.append(_table(("step", "kind"), ((str(a["step"]), a["kind"]) for a in s["anomalies"])))
    return _page(f"ckpt report {s['run_id']}", body)


def fleet_page(f: dict[str, Any], svg: str | None) -> str:
    """The HTML report over every run of a storage root (``ckpt report --all``)."""
    body = [
        "<h1>Checkpointing report: all runs</h1>",
        _kpis(
            [
                ("runs", str(len(f["runs"]))),
                (
                    "mean health score",
                    "n/a" if f["mean_health"] is None else f"{f['mean_health']:.1f}",
                ),
                ("mean IO share", _pct(f["mean_io_share"])),
                ("recovery success rate", _pct(f["recovery_success_rate"])),
            ]
        ),
        "<h2>Health per run</h2>",
        _plot("fleet", {} if svg is None else {"fleet": svg}),
        _table(
            (
                "run",
                "health",
                "mean score",
                "IO share",
                "recovery success",
                "checkpoints",
                "corrupted",
                "preemptions (steps lost)",
                "traits",
            ),
            (
                (
                    r["run_id"],
                    f"{r['health']:.1f}",
                    "n/a" if r["mean_score"] is None else f"{r['mean_score']:.3f}",
                    _pct(r["io_share"]),
                    _pct(r["recovery_success_rate"]),
                    str(r["checkpoints"]),
                    str(r["corrupted"]),
                    _preempted(r.get("preemptions"), r.get("preemption_steps_lost")),
                    ", ".join(r["traits"]),
                )
                for r in f["runs"]
            ),
        ),
        f"<h2>Runs under health {f['low_threshold']:g} and what they have in common</h2>",
        f"<p>{_e(', '.join(f['low_runs']) or 'none')}</p>",
        _table(
            ("trait", "low runs", "share of low runs", "share of the other runs"),
            (
                (c["trait"], str(c["low_runs"]), _pct(c["low_share"]), _pct(c["other_share"]))
                for c in f["common_traits"]
            ),
        ),
    ]
    return _page("ckpt report: all runs", body)
