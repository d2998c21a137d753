"""``ckpt simulate``: replay failure traces through the checkpoint policies.

Replays seeded Poisson failure traces (and, with ``--trace``, a JSON/CSV file
of failure times) through the real scheduler and the reference policies and
prints the wasted time side by side (:mod:`ckpt_agent.decide.benchmark`).
Pure computation: reads only the trace file, writes only to stdout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Annotated

import typer

from ckpt_agent.cli.common import fail, plain
from ckpt_agent.decide.benchmark import (
    STEPS_PER_TRACE,
    Case,
    gradient_table,
    run_case,
    suite,
    table,
    verdict,
)
from ckpt_agent.decide.simulate import Comparison, Costs
from ckpt_agent.decide.traces import LLAMA3_MTBF_S

__all__ = ["report", "run_suite", "simulate"]

GRADIENT_SAMPLES = 20_000
"""Stationary-noise samples the gradient rules are measured on."""


def run_suite(cases: Sequence[Case], *, jobs: int, costs: Costs | None = None) -> list[Comparison]:
    """Every case, in order (``jobs`` > 1: in that many worker processes)."""
    c = costs if costs is not None else Costs()
    if jobs <= 1 or len(cases) <= 1:
        return [run_case(case, c) for case in cases]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run_case, cases, [c] * len(cases)))


def report(cmps: Sequence[Comparison], costs: Costs, out: Callable[[str], None]) -> bool:
    """Print every table and the verdict; True when every target is met."""
    out(
        f"step {costs.step_time:g} s, save stall {costs.stall:g} s (lightweight "
        f"{costs.light_stall:g} s), persist {costs.persist:g} s, restart {costs.restart:g} s; "
        "avoidable = stalls + lost work, total adds the restarts"
    )
    for cmp in cmps:
        out("")
        for line in table(cmp):
            out(line)
    out("")
    for line in gradient_table(GRADIENT_SAMPLES):
        out(line)
    ok, lines = verdict([c for c in cmps if c.trace.notes.get("checked", True)])
    out("")
    for line in lines:
        out(line)
    return ok


def simulate(
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            help="JSON or CSV file of failure times in seconds (optionally a warning lead per "
            "failure): replayed after the built-in traces.",
        ),
    ] = None,
    mtbf: Annotated[
        list[float] | None,
        typer.Option(help="MTBF of the built-in Poisson traces, seconds (repeatable)."),
    ] = None,
    steps: Annotated[
        int, typer.Option(min=1000, help="Training steps per built-in trace (its length).")
    ] = STEPS_PER_TRACE,
    only_file: Annotated[
        bool, typer.Option("--only-file", help="Replay only the --trace file.")
    ] = False,
    jobs: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 2,
    step_time: Annotated[float, typer.Option(min=0.001, help="Seconds per step.")] = 2.0,
    stall: Annotated[
        float, typer.Option(min=0.0, help="Stall per save, seconds (a lightweight pulse: half).")
    ] = 2.0,
    persist: Annotated[float, typer.Option(min=0.0, help="Persist per save, seconds.")] = 5.0,
    restart: Annotated[float, typer.Option(min=0.0, help="Restart cost, seconds.")] = 30.0,
) -> None:
    """Replay failure traces through the adaptive scheduler and fixed intervals; print the
    wasted time per policy (exit 1 when the adaptive policy misses a target)."""
    costs = Costs(
        step_time=step_time, stall=stall, persist=persist, restart=restart, light_stall=stall / 2
    )
    cases: list[Case] = []
    if not only_file:
        cases += suite(mtbfs=tuple(mtbf or (3000.0, LLAMA3_MTBF_S)), steps=steps)
    if trace is not None:
        try:
            text = trace.read_text()
            Case(0.0, 0.0, 0, text=text, name=trace.name).trace()
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise fail(
                f"cannot read failure times from {trace}: {plain(e)}; give a JSON list of "
                'seconds (or {"failures": [...]}) or CSV rows "time[,warning_lead]"'
            ) from None
        cases.append(Case(0.0, 0.0, 0, text=text, name=trace.name))
    elif only_file:
        raise fail("--only-file needs --trace FILE")
    t0 = time.monotonic()
    cmps = run_suite(cases, jobs=jobs, costs=costs)
    ok = report(cmps, costs, typer.echo)
    typer.echo(f"\n{len(cases)} traces in {time.monotonic() - t0:.1f} s")
    if not ok:
        raise typer.Exit(1)
