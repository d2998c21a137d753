"""``ckpt-fit`` / ``python -m ckpt_e2e.fit``: the fault-injection suite (issue #14).

See :func:`main`'s ``--help``; ``scripts/ckpt-fit`` runs it with the project's venv.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .campaign import run_campaign
from .core import RECOVERY_LIMIT_S
from .runner import (
    DEFAULT_REPORT_DIR,
    Report,
    Shared,
    available_needs,
    load_registry,
    run_scenarios,
    select,
    table,
    write_report,
)

EPILOG = f"""\
What a scenario does: it starts real training processes (the example trainer with
the agent; the local control plane too where the scenario involves the operator),
injects its fault, lets the system recover on its own, and checks the pass criteria
every scenario shares: recovered automatically; recovery (failure detected ->
training running again) <= {RECOVERY_LIMIT_S:.0f} s; losses after recovery bit-exact
vs an uninterrupted reference run (1e-4 where the resume is not exact); no
acknowledged (valid) checkpoint lost; no corrupt checkpoint marked valid or loaded.

examples:
  ckpt-fit --list                              # names, needs, rough durations
  ckpt-fit --scenario trainer-sigkill          # one scenario (repeat --scenario for more)
  ckpt-fit --all --report fit.json             # everything this machine can run
  ckpt-fit --campaign 200 --seed 1             # 200 random SIGKILLs, counts + p50/p99
  CKPT_FIT_NEEDS= ckpt-fit --all               # pretend nothing optional is here (local only)

Scenarios whose needs ("cluster", "s3", "toxiproxy", ...) this machine lacks are
reported as SKIP, never silently dropped. The exit code is 1 when a scenario or the
campaign fails, 2 on a usage error. Work folders are kept under --work-dir for a
post-mortem (trainer logs, storage, decision logs).
"""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ckpt-fit",
        description="Inject failures into real training runs and check that they recover "
        "from the newest usable checkpoint, exactly (issue #14).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME",
        help="run this scenario (repeatable; see --list)",
    )
    p.add_argument("--all", action="store_true", help="run every registered scenario")
    p.add_argument(
        "--campaign",
        type=int,
        default=0,
        metavar="N",
        help="also run N random-crash trials (SIGKILL at a random instant, restart, check)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed for kill steps and instants")
    p.add_argument("--report", type=Path, help="write the JSON report here (+ .txt table)")
    p.add_argument(
        "--work-dir",
        type=Path,
        help="folder for the runs' files (default: a new temp folder, kept)",
    )
    args = p.parse_args(argv)
    if not (args.list or args.all or args.scenario or args.campaign):
        p.error("say what to run: --list, --all, --scenario NAME or --campaign N")
    if args.campaign < 0:
        p.error("--campaign takes a positive number of trials")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    registry, missing = load_registry()
    for module in missing:
        print(f"note: scenario module {module} is not there; its scenarios are not listed")
    have = available_needs()
    if args.list:
        for sc in registry.values():
            lacking = sorted(sc.needs - have)
            needs = ",".join(sorted(sc.needs)) or "-"
            state = f"  (skipped here: needs {','.join(lacking)})" if lacking else ""
            print(f"{sc.name:28} ~{sc.expected_s:4.0f}s  needs {needs:16} {sc.title}{state}")
        return 0
    try:
        chosen = (
            select(registry, args.scenario, run_all=args.all) if (args.all or args.scenario) else []
        )
    except KeyError as e:
        print(f"ckpt-fit: {e.args[0]}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else time.time_ns() % 1_000_000
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ckpt-fit-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"ckpt-fit: seed {seed}, work dir {work}")
    shared = Shared()
    try:
        report = run_scenarios(chosen, work, seed=seed, have=have, shared=shared)
        if args.campaign:
            report.campaign = run_campaign(args.campaign, work / "campaign", seed=seed)
    finally:
        shared.close()
    if report.rows:
        print()
        print(table(report.rows))
    if report.campaign:
        print()
        print(report.campaign["summary"])
    path = write_report(report, args.report or DEFAULT_REPORT_DIR / f"fit-{seed}.json")
    print(f"\nreport: {path} (table: {path}.txt)")
    ok = not report.failed and (report.campaign or {}).get("passed", True)
    print("ckpt-fit: PASS" if ok else f"ckpt-fit: FAIL ({_failures(report)})")
    return 0 if ok else 1


def _failures(report: Report) -> str:
    parts = [r.scenario for r in report.failed]
    if report.campaign and not report.campaign.get("passed", True):
        parts.append("campaign")
    return ", ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
