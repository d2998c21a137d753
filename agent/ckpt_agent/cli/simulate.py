"""``ckpt simulate``: replay failure traces through the checkpoint policies.

Replays seeded Poisson failure traces (and, with ``--trace``, a JSON/CSV file
of failure times) through the real scheduler and the reference policies and
prints the wasted time side by side (:mod:`ckpt_agent.decide.benchmark`).
``--trace llama3`` instead replays a Llama-3-scale trace with failure kinds
through storage only, today's tiers and the memory tier with peer replicas
(and JIT saves) and prints goodput, lost work and recovery time
(:mod:`ckpt_agent.decide.memory_benchmark`, issue #31).
Pure computation: reads only the trace file, writes only to stdout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
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
from ckpt_agent.decide.fault_traces import LLAMA3_DAYS, LLAMA3_GPUS, llama3_trace
from ckpt_agent.decide.memory_benchmark import (
    FIXED_EVERY,
    compare_tiers,
    costs_line,
    tier_plans,
    tier_table,
)
from ckpt_agent.decide.sim_memory import TierCosts
from ckpt_agent.decide.simulate import Comparison, Costs
from ckpt_agent.decide.traces import LLAMA3_MTBF_S

__all__ = ["LLAMA3_TRACE", "MemoryOptions", "memory_report", "report", "run_suite", "simulate"]

LLAMA3_TRACE = "llama3"
"""The ``--trace`` value that runs the memory-tier comparison on a Llama-3-scale trace."""
MEMORY = "Memory tier, peer replicas, JIT (with --trace llama3)"
"""The help panel of the memory-tier options."""
_TIER = TierCosts()

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


@dataclass(frozen=True)
class MemoryOptions:
    """What ``--trace llama3`` replays (the CLI's options, defaults documented there)."""

    gpus: int = LLAMA3_GPUS
    days: float = LLAMA3_DAYS
    seed: int = 0
    peer_loss: float = 0.01
    same_rack: float = 0.0
    replicas: int = 1
    memory_every: int | None = None
    jit: bool = True
    fixed_every: int = FIXED_EVERY


def memory_report(opts: MemoryOptions, costs: TierCosts, out: Callable[[str], None]) -> None:
    """Generate the Llama-3-scale trace, replay every plan, print the parameters and table."""
    trace = llama3_trace(
        gpus=opts.gpus,
        days=opts.days,
        seed=opts.seed,
        peer_loss=opts.peer_loss,
        same_rack=opts.same_rack,
    )
    plans = tier_plans(
        trace,
        costs,
        fixed_every=opts.fixed_every,
        memory_every_steps=opts.memory_every,
        replicas=opts.replicas,
        jit=opts.jit,
    )
    out(costs_line(costs, opts.replicas))
    out(
        f"peer lost with the node: {opts.peer_loss:g} (independent) + {opts.same_rack:g} "
        "(network faults, peer in the same rack); simulated, not measured"
    )
    out("")
    for line in tier_table(compare_tiers(trace, costs, plans)):
        out(line)


def simulate(
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            help="JSON or CSV file of failure times in seconds (optionally a warning lead per "
            "failure): replayed after the built-in traces. 'llama3' instead: the memory-tier "
            "comparison on a generated Llama-3-scale trace (419 failures in 54 days on 16,384 "
            "GPUs, scaled by --gpus; causes from the paper's Table 5 mapped to process crashes "
            "and node losses). A file named llama3 in this folder: give its full path.",
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
    restart: Annotated[
        float,
        typer.Option(
            min=0.0, help="Restart cost, seconds (with llama3: before the state is read)."
        ),
    ] = 30.0,
    gpus: Annotated[
        int,
        typer.Option(
            min=1, help="GPUs of the job: scales the failure rate.", rich_help_panel=MEMORY
        ),
    ] = LLAMA3_GPUS,
    days: Annotated[
        float, typer.Option(min=0.01, help="Length of the trace, days.", rich_help_panel=MEMORY)
    ] = LLAMA3_DAYS,
    seed: Annotated[int, typer.Option(help="Seed of the trace.", rich_help_panel=MEMORY)] = 0,
    memory_tier_every: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Memory-tier snapshot every N steps (unset: Young/Daly for the snapshot "
            "stall and the trace's MTBF, no shorter than the 3 % stall budget or the "
            "replication time allow).",
            rich_help_panel=MEMORY,
        ),
    ] = None,
    replicas: Annotated[
        int,
        typer.Option(
            min=0, help="Peers holding a replica of each node's snapshot.", rich_help_panel=MEMORY
        ),
    ] = 1,
    jit: Annotated[
        bool,
        typer.Option(
            "--jit/--no-jit",
            help="Also show the plan with just-in-time saves from the surviving replicas.",
            rich_help_panel=MEMORY,
        ),
    ] = True,
    peer_loss: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Probability that a node loss also loses a peer holding its replica.",
            rich_help_panel=MEMORY,
        ),
    ] = 0.01,
    same_rack: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Added for network (switch/cable) failures: the peer shares the rack "
            "(0: rack-aware placement).",
            rich_help_panel=MEMORY,
        ),
    ] = 0.0,
    memory_stall: Annotated[
        float,
        typer.Option(min=0.0, help="Stall per memory snapshot, seconds.", rich_help_panel=MEMORY),
    ] = _TIER.memory_stall,
    state_gib: Annotated[
        float, typer.Option(min=0.0, help="State per node, GiB.", rich_help_panel=MEMORY)
    ] = _TIER.state_gib,
    replica_gbps: Annotated[
        float,
        typer.Option(
            min=0.001, help="Replication bandwidth per node, GB/s.", rich_help_panel=MEMORY
        ),
    ] = _TIER.replica_gbps,
    local_read_gbps: Annotated[
        float,
        typer.Option(
            min=0.001, help="Recovery read from node memory, GB/s.", rich_help_panel=MEMORY
        ),
    ] = _TIER.local_read_gbps,
    peer_read_gbps: Annotated[
        float,
        typer.Option(min=0.001, help="Recovery read from a peer, GB/s.", rich_help_panel=MEMORY),
    ] = _TIER.peer_read_gbps,
    storage_read_gbps: Annotated[
        float,
        typer.Option(
            min=0.001, help="Recovery read from storage per node, GB/s.", rich_help_panel=MEMORY
        ),
    ] = _TIER.storage_read_gbps,
    fixed_every: Annotated[
        int,
        typer.Option(
            min=1, help="The storage-only baseline's interval, steps.", rich_help_panel=MEMORY
        ),
    ] = FIXED_EVERY,
) -> None:
    """Replay failure traces through the adaptive scheduler and fixed intervals; print the
    wasted time per policy (exit 1 when the adaptive policy misses a target).

    With --trace llama3: replay a generated Llama-3-scale failure trace through four plans
    (a fixed interval on storage only; today's tiers; a memory tier with peer replicas;
    the same with JIT saves) and print goodput, lost work per failure (mean, p99) and
    recovery time side by side. Simulated, not measured: see docs/performance.md.
    """
    if trace is not None and str(trace) == LLAMA3_TRACE:
        tier_costs = TierCosts(
            step_time=step_time,
            stall=stall,
            persist=persist,
            restart=restart,
            memory_stall=memory_stall,
            state_gib=state_gib,
            replica_gbps=replica_gbps,
            local_read_gbps=local_read_gbps,
            peer_read_gbps=peer_read_gbps,
            storage_read_gbps=storage_read_gbps,
        )
        opts = MemoryOptions(
            gpus, days, seed, peer_loss, same_rack, replicas, memory_tier_every, jit, fixed_every
        )
        memory_report(opts, tier_costs, typer.echo)
        return
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
