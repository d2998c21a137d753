"""Run FIT scenarios: progress lines, the final table, the JSON report, skips by need.

:func:`available_needs` says which of a scenario's ``needs`` this machine has;
:func:`run_scenarios` runs the chosen ones one by one (cleanups after each, newest
first) and never lets one scenario's crash stop the others; :func:`table` renders the
rows issue #14 asks for; :func:`write_report` keeps everything as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..tools import REPO_ROOT
from .core import REGISTRY, SCENARIO_MODULES, FitContext, Outcome, Scenario

#: Environment variable naming the folder for reports (the pytest run and CI use it).
REPORT_DIR_ENV = "CKPT_FIT_REPORT_DIR"
DEFAULT_REPORT_DIR = REPO_ROOT / ".cache" / "fit"


def load_registry() -> tuple[dict[str, Scenario], list[str]]:
    """Import every scenario module; a module that is missing is reported, not fatal."""
    missing = []
    for module in SCENARIO_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            missing.append(module)
    return REGISTRY, missing


#: Tool folders (``build-tools.sh`` cache) each need is served by.
_NEED_TOOLS = {
    "cluster": ("kubernetes", "etcd", "kwok", "training-operator"),
    "s3": ("minio",),
    "toxiproxy": ("toxiproxy",),
}


def available_needs() -> set[str]:
    """What this machine offers among the needs scenarios declare.

    ``$CKPT_FIT_NEEDS`` (comma-separated, may be empty) overrides the detection.
    """
    explicit = os.environ.get("CKPT_FIT_NEEDS")
    if explicit is not None:
        return {n.strip() for n in explicit.split(",") if n.strip()}
    cache = Path(os.environ.get("CKPT_TOOLS_CACHE", Path.home() / ".cache/ckpt-operator/tools"))
    built = {p.name.rsplit("-", 1)[0] for p in cache.glob("*-*") if p.is_dir()}
    have = {need for need, tools in _NEED_TOOLS.items() if set(tools) <= built}
    if os.path.exists("/dev/fuse"):
        have.add("fuse")
    if shutil.which("nvidia-smi"):
        have.add("gpu")
    return have


@dataclass
class Row:
    """One scenario's result in the report (an outcome, or a skip)."""

    scenario: str
    title: str
    status: str  # "pass" | "FAIL" | "skip"
    outcome: Outcome | None = None
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scenario": self.scenario,
            "title": self.title,
            "status": self.status,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.outcome is not None:
            out["outcome"] = self.outcome.to_json()
        return out


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    campaign: dict[str, Any] | None = None
    started: float = field(default_factory=time.time)
    seed: int = 0

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status == "FAIL"]

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "started": self.started,
            "scenarios": [r.to_json() for r in self.rows],
            "campaign": self.campaign,
            "table": table(self.rows),
            "passed": not self.failed and (self.campaign or {}).get("passed", True),
        }


def select(registry: dict[str, Scenario], names: Sequence[str], *, run_all: bool) -> list[Scenario]:
    if run_all or not names:
        return list(registry.values())
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise KeyError(
            f"unknown scenario(s) {', '.join(unknown)}; `ckpt-fit --list` shows the names"
        )
    return [registry[n] for n in names]


@dataclass
class Shared:
    """What every scenario of one FIT run shares: services and their finalizers."""

    services: dict[str, Any] = field(default_factory=dict)
    finalizers: list[Callable[[], None]] = field(default_factory=list)

    def close(self, log: Callable[[str], None] = print) -> None:
        """Stop the shared services, newest first."""
        while self.finalizers:
            stop = self.finalizers.pop()
            try:
                stop()
            except Exception as e:
                log(f"  stopping a shared FIT service failed: {type(e).__name__}: {e}")


def run_one(
    sc: Scenario, work_dir: Path, seed: int, log: Callable[[str], None], shared: Shared
) -> Outcome:
    """Run one scenario in its own folder; an exception becomes a failed outcome."""
    ctx = FitContext(
        work_dir=work_dir,
        seed=seed,
        log=log,
        services=shared.services,
        finalizers=shared.finalizers,
    )
    t0 = time.monotonic()
    try:
        outcome = sc.run(ctx)
    except Exception as e:  # a scenario that crashes fails, the others still run
        outcome = Outcome(sc.name, error=f"{type(e).__name__}: {e}")
        outcome.notes.append(traceback.format_exc(limit=8))
    finally:
        for close in reversed(ctx.cleanups):
            try:
                close()
            except Exception as e:
                log(f"  cleanup of {sc.name} failed: {type(e).__name__}: {e}")
    outcome.duration_s = time.monotonic() - t0
    return outcome


def run_scenarios(
    chosen: Iterable[Scenario],
    work_dir: Path,
    *,
    seed: int,
    have: set[str],
    shared: Shared,
    log: Callable[[str], None] = print,
) -> Report:
    """Run ``chosen`` in order (the caller closes ``shared`` after the last FIT run)."""
    report = Report(seed=seed)
    chosen = list(chosen)
    for i, sc in enumerate(chosen, 1):
        lacking = sorted(sc.needs - have)
        if lacking:
            reason = f"needs {', '.join(lacking)} (not available here)"
            log(f"[{i}/{len(chosen)}] SKIP {sc.name}: {reason}")
            report.rows.append(Row(sc.name, sc.title, "skip", reason=reason))
            continue
        log(f"[{i}/{len(chosen)}] START {sc.name}: {sc.title} (~{sc.expected_s:.0f}s)")
        outcome = run_one(sc, work_dir / sc.name, seed, log, shared)
        status = "pass" if outcome.passed else "FAIL"
        log(f"[{i}/{len(chosen)}] {status.upper():4} {sc.name} in {outcome.duration_s:.1f}s")
        if not outcome.passed:
            for c in outcome.checks:
                if not c.ok:
                    log(f"      failed check: {c.name}: {c.detail}")
            if outcome.error:
                log(f"      error: {outcome.error}")
        report.rows.append(Row(sc.name, sc.title, status, outcome))
    return report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[Row]) -> str:
    """The table issue #14 asks for (one line per scenario)."""
    head = (
        "scenario",
        "injected at",
        "recovered from",
        "lost",
        "recovery s",
        "loss delta",
        "verdict",
    )
    lines = [head]
    for r in rows:
        o = r.outcome
        if o is None:
            lines.append((r.scenario, "-", "-", "-", "-", "-", f"skip: {r.reason}"))
            continue
        lines.append(
            (
                r.scenario,
                o.injected_at or "-",
                o.recovered_from or "-",
                "-" if o.steps_lost is None else str(o.steps_lost),
                _fmt(o.recovery_s, ".1f"),
                _fmt(o.loss_delta, ".3g"),
                "PASS" if o.passed else "FAIL",
            )
        )
    widths = [min(max(len(row[i]) for row in lines), 44) for i in range(len(head))]
    out = []
    for n, row in enumerate(lines):
        cells = [c if len(c) <= widths[i] else c[: widths[i] - 1] + "~" for i, c in enumerate(row)]
        out.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(cells)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_report(report: Report, path: Path) -> Path:
    """The JSON report at ``path`` and the table beside it (``<path>.txt``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=1, sort_keys=True, default=str))
    text = table(report.rows)
    if report.campaign:
        text += "\n\n" + str(report.campaign.get("summary", ""))
    path.with_suffix(path.suffix + ".txt").write_text(text + "\n")
    return path
