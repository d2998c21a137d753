"""Failure traces with failure kinds for the memory-tier simulator (pure, no I/O, seeded).

:func:`llama3_trace` generates a Llama-3-scale trace from published numbers (no
download): the Llama 3 405B pre-training saw **419 unexpected interruptions in 54
days on 16,384 GPUs** ("The Llama 3 Herd of Models", Meta, 2024, arXiv:2407.21783,
§3.3.4 and Table 5). Failures are a Poisson process at that rate scaled by the job's
size (``gpus / 16,384``: every GPU fails independently at the same rate); each
failure's cause is drawn with the weights of Table 5's counts (:data:`LLAMA3_CAUSES`,
which sum to 419; the table's printed shares are not all of 419 — 148 "Faulty GPU"
prints as 30.1 % — so the counts are used) and mapped to what it does to the job:

* **kind** ``process``: processes crash on nodes that survive: each node's
  in-memory snapshot survives (software bugs, NCCL watchdog timeouts, dependency
  failures); ``node``: a node leaves the job (every hardware cause, host
  maintenance, the network): its memory is lost, a peer's replica survives unless
  the peer is lost too.
* **scope** ``one``: one rank or node fails while the others, data-parallel
  replicas of its state, survive: a just-in-time save from them is possible;
  ``wide``: every rank fails at once (a software bug or a dependency hits them
  all; silent data corruption makes the survivors' state suspect): no JIT;
  ``rack``: the network (switch or cable) takes a rack: no JIT, and a peer in the
  same rack is lost with the node.
* **peer loss**: a node loss also loses the peer holding its replica with
  probability ``peer_loss`` (independent: a second failure before the replica is
  read), and a rack-scope one with ``same_rack`` (the peer shares the rack: 0 with
  rack-aware placement). With k peers all k must be lost (``q**k``): each fault
  keeps its probability and a uniform draw, so the outcome is reproducible at any k.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = [
    "LLAMA3_CAUSES",
    "LLAMA3_DAYS",
    "LLAMA3_GPUS",
    "LLAMA3_INTERRUPTIONS",
    "Cause",
    "Fault",
    "FaultTrace",
    "kind_shares",
    "llama3_rate",
    "llama3_trace",
]

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16_384
"""Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs."""

PROCESS, NODE = "process", "node"
"""Failure kinds: processes crash on surviving nodes / a node (and its memory) is lost."""
ONE, WIDE, RACK = "one", "wide", "rack"
"""Failure scopes (see the module docstring)."""


@dataclass(frozen=True)
class Cause:
    """One row of the Llama 3 paper's Table 5 and what it does to a job."""

    name: str
    count: int
    kind: str
    scope: str


LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause("Faulty GPU", 148, NODE, ONE),
    Cause("GPU HBM3 memory", 72, NODE, ONE),
    Cause("Software bug", 54, PROCESS, WIDE),
    Cause("Network switch/cable", 35, NODE, RACK),
    Cause("Host maintenance", 32, NODE, ONE),
    Cause("GPU SRAM memory", 19, NODE, ONE),
    Cause("GPU system processor", 17, NODE, ONE),
    Cause("NIC", 7, NODE, ONE),
    Cause("NCCL watchdog timeouts", 7, PROCESS, ONE),
    Cause("Silent data corruption", 6, NODE, WIDE),
    Cause("GPU thermal interface + sensor", 6, NODE, ONE),
    Cause("SSD", 3, NODE, ONE),
    Cause("Power supply", 3, NODE, ONE),
    Cause("Server chassis", 2, NODE, ONE),
    Cause("IO expansion board", 2, NODE, ONE),
    Cause("Dependency", 2, PROCESS, WIDE),
    Cause("CPU", 2, NODE, ONE),
    Cause("System memory", 2, NODE, ONE),
)
"""Table 5 of arXiv:2407.21783 (root causes of the 419 unexpected interruptions), each
mapped to a kind and a scope (the mapping is this module's, see its docstring)."""


@dataclass(frozen=True)
class Fault:
    """One failure: when, why, and what it takes."""

    time: float
    cause: str
    kind: str
    scope: str
    peer_q: float = 0.0
    """Probability that a peer holding the replica is lost with the node (node kind)."""
    draw: float = 1.0
    """Uniform in [0, 1): the replica survives unless ``draw < peer_q ** replicas``."""

    @property
    def jit_possible(self) -> bool:
        """Surviving data-parallel replicas hold the state (one rank or node failed)."""
        return self.scope == ONE

    def peers_lost(self, replicas: int) -> bool:
        """Every one of ``replicas`` peers holding this node's replica is lost too."""
        if self.kind != NODE:
            return False  # the peers are not involved: the node's own memory survives
        return replicas <= 0 or self.draw < self.peer_q**replicas


@dataclass(frozen=True)
class FaultTrace:
    """A job's failures (sorted by time) over ``horizon`` wall seconds."""

    name: str
    horizon: float
    faults: tuple[Fault, ...]
    gpus: int = LLAMA3_GPUS
    mtbf: float = 0.0
    """The mean time between failures the trace was drawn with."""

    @property
    def times(self) -> tuple[float, ...]:
        return tuple(f.time for f in self.faults)


def llama3_rate(gpus: int = LLAMA3_GPUS) -> float:
    """Failures per second of a job on ``gpus`` GPUs at Llama 3's per-GPU rate."""
    return LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86_400.0) * gpus / LLAMA3_GPUS


def llama3_trace(
    *,
    gpus: int = LLAMA3_GPUS,
    days: float = LLAMA3_DAYS,
    seed: int = 0,
    peer_loss: float = 0.01,
    same_rack: float = 0.0,
) -> FaultTrace:
    """Poisson failures at :func:`llama3_rate` over ``days``, causes drawn by
    :data:`LLAMA3_CAUSES`' counts (see the module docstring); deterministic in ``seed``."""
    if gpus < 1 or days <= 0:
        raise ValueError(f"a trace needs gpus >= 1 and days > 0 (got {gpus}, {days})")
    for what, p in (("peer_loss", peer_loss), ("same_rack", same_rack)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{what} is a probability in [0, 1] (got {p})")
    rate = llama3_rate(gpus)
    horizon = days * 86_400.0
    rng = random.Random(seed)
    weights = [c.count for c in LLAMA3_CAUSES]
    faults: list[Fault] = []
    t = rng.expovariate(rate)
    while t < horizon:
        cause = rng.choices(LLAMA3_CAUSES, weights)[0]
        rack = same_rack if cause.scope == RACK else 0.0
        q = 0.0 if cause.kind != NODE else min(1.0, peer_loss + rack)
        faults.append(Fault(t, cause.name, cause.kind, cause.scope, q, rng.random()))
        t += rng.expovariate(rate)
    name = (
        f"Llama 3 rate (419 in 54 days on 16,384 GPUs) scaled to {gpus:,} GPUs, "
        f"{days:g} days, seed {seed}"
    )
    return FaultTrace(name, horizon, tuple(faults), gpus, 1.0 / rate)


def kind_shares(causes: tuple[Cause, ...] = LLAMA3_CAUSES) -> dict[str, float]:
    """Expected share of each kind and scope (``process``, ``node``, ``one``, ...)."""
    total = sum(c.count for c in causes)
    shares: dict[str, float] = {}
    for c in causes:
        for key in (c.kind, c.scope):
            shares[key] = shares.get(key, 0.0) + c.count / total
    return shares
