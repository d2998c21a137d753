"""The memory tier, peer replicas and JIT saves, replayed over a failure trace (pure, #31).

:func:`replay_tiers` runs one :class:`Plan` over a
:class:`~ckpt_agent.decide.fault_traces.FaultTrace` event by event in simulated
wall time (steps of ``step_time`` seconds):

* **storage tiers**: a save every ``storage_every`` steps (with ``full_every``: the
  scheduler's full-tier rule, :func:`~ckpt_agent.decide.sim_policies.full_now`)
  stalls ``stall`` s and is durable ``persist`` s later;
* **node memory** (``local_memory``): every save lands in the node's shared memory
  first (today's flash path), usable once its stall ends;
* **memory tier** (``memory_every``): an in-memory snapshot every m steps (counted
  from the last snapshot of any kind), stalling ``memory_stall`` s;
* **peer replicas** (``replicas`` = k): each snapshot in node memory is streamed to k
  peers, which takes ``k · state / replica bandwidth`` s; one stream at a time and,
  while one runs, only the newest waiting snapshot is kept (the replica is the newest
  snapshot whose replication *finished*: its lag);
* **JIT** (``jit``): on a failure where surviving data-parallel replicas hold the
  state (:attr:`Fault.jit_possible`), they save the last completed step: at most the
  partial step is lost.

A failure restores from the newest valid source, ties to the fastest: the node's
memory (a process crash: it survives; a node loss: it does not), a peer's replica
(unless every peer is lost too), storage (the newest durable save), else the start.
Work since that step is lost; the recovery costs ``restart`` s plus reading the
state from the source (:meth:`TierCosts.recovery_s`; a JIT save adds its own
``memory_stall``). After a failure, saves not yet durable, replications in flight and
(on a node loss) the node's memory are gone; the counters resume from the restored
step. Wall time = progress + stalls + lost work + recoveries, exactly
(:attr:`TierResult.goodput` is the share of progress).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckpt_agent.decide.fault_traces import NODE, PROCESS, Fault, FaultTrace
from ckpt_agent.decide.sim_policies import full_now

__all__ = [
    "JIT",
    "LOCAL",
    "PEER",
    "SOURCES",
    "START",
    "STORAGE",
    "Plan",
    "Recovery",
    "TierCosts",
    "TierResult",
    "percentile",
    "replay_tiers",
]

LOCAL, PEER, STORAGE, JIT, START = "local memory", "peer replica", "storage", "JIT", "start"
SOURCES = (LOCAL, PEER, STORAGE, JIT, START)
"""Where a restart reads its state from, fastest first (JIT: the survivors' memory)."""

GIB = float(2**30)


@dataclass(frozen=True)
class TierCosts:
    """Seconds, sizes and bandwidths of the model (defaults: see docs/performance.md)."""

    step_time: float = 2.0
    stall: float = 2.0
    """Stall of a save to storage (the policy simulator's default)."""
    persist: float = 5.0
    """From the end of a storage save's stall until it is durable."""
    restart: float = 30.0
    """Fixed part of a recovery: pods rescheduled, processes up, process group formed."""
    memory_stall: float = 0.2
    """Stall of a memory-tier snapshot (the state copied to the node's pinned memory)."""
    state_gib: float = 10.0
    """Checkpoint state per node, GiB."""
    replica_gbps: float = 5.0
    """Bandwidth a node spends streaming its snapshots to its peers, GB/s."""
    local_read_gbps: float = 20.0
    peer_read_gbps: float = 5.0
    storage_read_gbps: float = 1.0
    """Read bandwidth per node at recovery, GB/s, by source."""

    def replicate_s(self, replicas: int) -> float:
        """Seconds to stream one snapshot to ``replicas`` peers."""
        return replicas * self.state_gib * GIB / (self.replica_gbps * 1e9)

    def recovery_s(self, source: str) -> float:
        """Seconds from the failure to training again, reading from ``source``."""
        gbps = {
            LOCAL: self.local_read_gbps,
            PEER: self.peer_read_gbps,
            JIT: self.peer_read_gbps,
            STORAGE: self.storage_read_gbps,
        }.get(source)
        read = 0.0 if gbps is None else self.state_gib * GIB / (gbps * 1e9)
        return self.restart + read + (self.memory_stall if source == JIT else 0.0)


@dataclass(frozen=True)
class Plan:
    """Which tiers a configuration has (see the module docstring)."""

    name: str
    storage_every: int
    full_every: int | None = None
    local_memory: bool = False
    memory_every: int | None = None
    replicas: int = 0
    jit: bool = False

    def __post_init__(self) -> None:
        if self.storage_every < 1 or (self.memory_every is not None and self.memory_every < 1):
            raise ValueError(f"{self.name}: save intervals are at least 1 step")
        if self.replicas < 0:
            raise ValueError(f"{self.name}: replicas must be >= 0 (got {self.replicas})")

    @property
    def in_memory(self) -> bool:
        """Snapshots land in node memory (today's flash path or the memory tier)."""
        return self.local_memory or self.memory_every is not None


@dataclass(frozen=True)
class Recovery:
    """One failure as the plan met it."""

    fault: Fault
    source: str
    step: int
    """The last step completed when it failed."""
    back: int
    """The step training resumed from."""
    lost_s: float
    recovery_s: float
    replica_lag: int | None = None
    """Steps between ``step`` and the newest finished replica (None: no replicas)."""


@dataclass
class TierResult:
    """What one plan cost on one trace."""

    plan: str
    step_time: float
    recoveries: list[Recovery] = field(default_factory=list)
    saves: int = 0
    snapshots: int = 0
    """Memory-tier snapshots (saves to storage not counted)."""
    stall_s: float = 0.0
    elapsed_s: float = 0.0
    final_step: int = 0

    @property
    def lost_s(self) -> float:
        return sum(r.lost_s for r in self.recoveries)

    @property
    def recovery_s(self) -> float:
        return sum(r.recovery_s for r in self.recoveries)

    @property
    def goodput(self) -> float:
        """Share of the wall time that became progress."""
        if self.elapsed_s <= 0:
            return math.nan
        return self.final_step * self.step_time / self.elapsed_s

    def by_source(self) -> dict[str, int]:
        return {s: sum(r.source == s for r in self.recoveries) for s in SOURCES}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in (0, 100]); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


class _Replicator:
    """One stream to the peers: the newest finished replica, one in flight, the newest
    waiting snapshot (see the module docstring)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.latest: int | None = None
        self.inflight: tuple[float, int] | None = None  # (done at, step)
        self.pending: int | None = None

    def _drain(self, t: float) -> None:
        while self.inflight is not None and self.inflight[0] <= t:
            done, self.latest = self.inflight
            self.inflight = None
            if self.pending is not None:
                self.inflight = (done + self.seconds, self.pending)
                self.pending = None

    def offer(self, step: int, t: float) -> None:
        """A snapshot of ``step`` is complete in node memory at ``t``."""
        self._drain(t)
        if self.inflight is None:
            self.inflight = (t + self.seconds, step)
        else:
            self.pending = step

    def newest_at(self, t: float) -> int | None:
        self._drain(t)
        return self.latest

    def failed(self, peers_lost: bool, back: int) -> None:
        """After a failure: streams in flight are gone, and the replica with the peers."""
        self.inflight = self.pending = None
        if peers_lost or (self.latest is not None and self.latest > back):
            self.latest = None


@dataclass
class _Run:
    """The replay's mutable state."""

    now: float = 0.0
    step: int = 0
    last: int = 0
    last_full: int = 0
    last_mem: int = 0
    saves: list[tuple[float, int, int, int]] = field(default_factory=list)
    """Storage saves: (durable at, step, last save, last full) — the counters after it."""
    local: list[tuple[float, int]] = field(default_factory=list)
    """The newest snapshots in node memory: (usable at, step)."""


def _choose(
    plan: Plan, run: _Run, fault: Fault, repl: _Replicator | None
) -> tuple[str, int, int | None]:
    """(source, step to resume from, replica lag) for ``fault`` (see the module docstring)."""
    t = fault.time
    replica = repl.newest_at(t) if repl is not None else None
    lag = None if repl is None else run.step - (replica if replica is not None else 0)
    if plan.jit and plan.in_memory and fault.jit_possible:
        return JIT, run.step, lag
    candidates: list[tuple[int, int, str]] = []  # (step, -speed rank, source)
    durable = [s for s in run.saves if s[0] <= t]
    if durable:
        candidates.append((durable[-1][1], -2, STORAGE))
    if plan.in_memory and fault.kind == PROCESS:
        usable = [step for at, step in run.local if at <= t]
        if usable:
            candidates.append((usable[-1], 0, LOCAL))
    if replica is not None and not fault.peers_lost(plan.replicas):
        candidates.append((replica, -1, PEER))
    if not candidates:
        return START, 0, lag
    step, _, source = max(candidates)
    return source, step, lag


def _fail(
    plan: Plan, costs: TierCosts, run: _Run, fault: Fault, repl: _Replicator | None
) -> Recovery:
    """Book ``fault`` (``run.step``: the last completed step) and roll ``run`` back."""
    partial = max(0.0, fault.time - run.now)
    source, back, lag = _choose(plan, run, fault, repl)
    lost = partial + (run.step - back) * costs.step_time
    rec = Recovery(fault, source, run.step, back, lost, costs.recovery_s(source), lag)
    t = fault.time
    # not yet durable (lost with the pods) or after the restored step: gone
    run.saves = [s for s in run.saves if s[0] <= t and s[1] <= back]
    run.last, run.last_full = run.saves[-1][2:] if run.saves else (0, 0)
    if fault.kind == NODE:
        run.local = []
    else:
        run.local = [(at, s) for at, s in run.local if at <= t and s <= back]
    if repl is not None:
        repl.failed(fault.peers_lost(plan.replicas), back)
    if source == JIT:  # the survivors' save: in their memory, pushed to the peers
        run.local = [(t, back)]
        if repl is not None:
            repl.latest = back
    run.step, run.last_mem = back, back
    run.now = max(run.now, t) + rec.recovery_s
    return rec


def replay_tiers(trace: FaultTrace, plan: Plan, costs: TierCosts) -> TierResult:
    """Run ``plan`` over ``trace`` (see the module docstring)."""
    st, k, full_every, m = costs.step_time, plan.storage_every, plan.full_every, plan.memory_every
    res = TierResult(plan.name, st)
    repl = (
        _Replicator(costs.replicate_s(plan.replicas))
        if plan.replicas > 0 and plan.in_memory
        else None
    )
    run = _Run()
    faults, fi = trace.faults, 0
    while run.now < trace.horizon:
        due = run.last + k if full_every is None else min(run.last + k, run.last_full + full_every)
        target = due if m is None else min(due, run.last_mem + m)
        t_done = run.now + (target - run.step) * st
        if fi < len(faults) and faults[fi].time < t_done:
            fault = faults[fi]
            fi += 1
            done = max(0, math.floor((fault.time - run.now) / st))
            run.now, run.step = run.now + done * st, run.step + done
            res.recoveries.append(_fail(plan, costs, run, fault, repl))
            continue
        if t_done > trace.horizon:
            rest = max(0, math.floor((trace.horizon - run.now) / st))
            run.now, run.step = run.now + rest * st, run.step + rest
            break
        run.now, run.step = t_done, target
        if target == due:
            if full_now(due - run.last, due - run.last_full, k, full_every):
                run.last_full = due
            run.last = due
            stall = costs.stall
            res.saves += 1
        else:
            stall = costs.memory_stall
            res.snapshots += 1
        run.now += stall
        res.stall_s += stall
        if target == due:
            run.saves.append((run.now + costs.persist, due, run.last, run.last_full))
            del run.saves[:-64]  # a restore never reaches back further
        if plan.in_memory:
            run.local = [*run.local[-1:], (run.now, target)]
            run.last_mem = target
            if repl is not None:
                repl.offer(target, run.now)
    res.elapsed_s, res.final_step = run.now, run.step
    return res
