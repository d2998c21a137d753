"""Checkpoint policies replayed over failure traces: wasted time side by side.

    .venv/bin/python benchmarks/bench_policy.py                     # the standard suite
    .venv/bin/python benchmarks/bench_policy.py --trace failures.csv
    .venv/bin/python benchmarks/bench_policy.py --write-docs        # update docs/performance.md

The same as ``ckpt simulate`` (:mod:`ckpt_agent.cli.simulate`): seeded Poisson
failure traces at MTBF 3,000 s and Llama 3's (54 days / 419 interruptions),
0 %, 50 % and 90 % of the failures warned 30-120 s ahead, replayed through the
real :class:`~ckpt_agent.decide.scheduler.AdaptiveScheduler` with the default
policy and through fixed intervals, Young/Daly, the alarm-aware oracle and the
seed's rules (:mod:`ckpt_agent.decide.simulate`). Deterministic; about a
minute on 2 idle cores. Exits 1 when the adaptive policy misses a target.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ckpt_agent.cli.simulate import report, run_suite
from ckpt_agent.decide.benchmark import Case, suite
from ckpt_agent.decide.simulate import Costs

DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
MARK = "<!-- bench_policy results -->"


def _write_docs(lines: list[str], command: str) -> None:
    text = DOC.read_text()
    parts = text.split(MARK)
    if len(parts) != 3:
        raise SystemExit(f"{DOC} needs exactly two '{MARK}' lines around the results")
    body = "\n".join([f"`{command}`", "", *lines])
    DOC.write_text(f"{parts[0]}{MARK}\n{body}\n{MARK}{parts[2]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="JSON/CSV file of failure times, replayed too")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--write-docs", action="store_true", help=f"put the tables into {DOC.name}")
    args = ap.parse_args()
    cases = suite()
    if args.trace is not None:
        cases.append(Case(0.0, 0.0, 0, text=args.trace.read_text(), name=args.trace.name))
    costs = Costs()
    t0 = time.monotonic()
    cmps = run_suite(cases, jobs=args.jobs, costs=costs)
    lines: list[str] = []
    ok = report(cmps, costs, lines.append)
    elapsed = time.monotonic() - t0
    lines.append("")
    lines.append(f"{len(cases)} traces in {elapsed:.0f} s ({args.jobs} worker processes)")
    print("\n".join(lines))
    if args.write_docs:
        _write_docs(lines, "python benchmarks/bench_policy.py  # or: ckpt simulate")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
