"""Checkpoint policies replayed over failure traces: wasted time side by side.

    .venv/bin/python benchmarks/bench_policy.py                     # the standard suite
    .venv/bin/python benchmarks/bench_policy.py --trace failures.csv
    .venv/bin/python benchmarks/bench_policy.py --write-docs        # update docs/performance.md
    .venv/bin/python benchmarks/bench_policy.py --memory [--write-docs]   # #31's table

The same as ``ckpt simulate`` (:mod:`ckpt_agent.cli.simulate`): seeded Poisson
failure traces at MTBF 3,000 s and Llama 3's (54 days / 419 interruptions),
0 %, 50 % and 90 % of the failures warned 30-120 s ahead, replayed through the
real :class:`~ckpt_agent.decide.scheduler.AdaptiveScheduler` with the default
policy and through fixed intervals, Young/Daly, the alarm-aware oracle and the
seed's rules (:mod:`ckpt_agent.decide.simulate`). Deterministic; about a
minute on 2 idle cores. Exits 1 when the adaptive policy misses a target.

``--memory`` instead: the memory tier, peer replicas and JIT saves on a generated
Llama-3-scale failure trace, side by side with storage only and today's tiers (the
same as ``ckpt simulate --trace llama3`` with its defaults; a few seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ckpt_agent.cli.simulate import MemoryOptions, memory_report, report, run_suite
from ckpt_agent.decide.benchmark import Case, suite
from ckpt_agent.decide.sim_memory import TierCosts
from ckpt_agent.decide.simulate import Costs

DOC = Path(__file__).resolve().parent.parent / "docs" / "performance.md"
MARK = "<!-- bench_policy results -->"
MEMORY_MARK = "<!-- bench_policy memory results -->"


def _write_docs(lines: list[str], command: str, mark: str = MARK) -> None:
    text = DOC.read_text()
    parts = text.split(mark)
    if len(parts) != 3:
        raise SystemExit(f"{DOC} needs exactly two '{mark}' lines around the results")
    body = "\n".join([f"`{command}`", "", *lines])
    DOC.write_text(f"{parts[0]}{mark}\n{body}\n{mark}{parts[2]}")


def _memory(write_docs: bool) -> int:
    lines: list[str] = []
    t0 = time.monotonic()
    memory_report(MemoryOptions(), TierCosts(), lines.append)
    lines += ["", f"replayed in {time.monotonic() - t0:.1f} s"]
    print("\n".join(lines))
    if write_docs:
        command = "python benchmarks/bench_policy.py --memory  # or: ckpt simulate --trace llama3"
        _write_docs(lines, command, MEMORY_MARK)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="JSON/CSV file of failure times, replayed too")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--write-docs", action="store_true", help=f"put the tables into {DOC.name}")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="the memory tier, replicas and JIT on a Llama-3-scale trace instead (#31)",
    )
    args = ap.parse_args()
    if args.memory:
        return _memory(args.write_docs)
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
