"""Multi-rank checkpoints: every rank saves the same step with the same tier.

**Agreement** (:class:`DecisionAgreement`, on the training thread, once per step).
Every rank must save the same step with the same tier, or the checkpoint has
parts from different steps. Each step takes two small ``all_gather`` rounds on
a dedicated gloo group (``Comm``):

1. *inputs*: every rank contributes ``[step, loss, grad_norm, gpu_errors,
   write_latency_ms, now, busy, emergency, stop]``. Every rank reduces the
   same table in the same order, so the results are bitwise identical
   everywhere: the loss is the mean over ranks (a NaN anywhere is a NaN for
   all), the gradient norm and the write latency the maximum, GPU errors the
   sum, the clock rank 0's. A rank-local emergency (its save-now file, its
   SIGTERM) becomes an emergency request on *every* rank's scheduler.
   Every scheduler then observes identical inputs.
2. *decisions*: each rank's :class:`~ckpt_agent.decide.scheduler.Decision` is
   all-gathered (JSON), merged with :func:`~ckpt_agent.decide.scheduler.merge_decisions`
   (order-independent: any save, highest tier, max score) and adopted by every
   scheduler. Costs measured per rank (stall, persist) can make intervals
   differ slightly; the merge makes the *decision* identical regardless, and
   the adoption resets every scheduler's counters the same way.

The scheduler state stored in a checkpoint is rank 0's (shared state is
written once) and every rank restores it, so a restart with a different rank
order — or a different world size — starts from one state on all ranks.
Whether each rank's persister is busy travels in round 2 too: a save is
deferred (or waited for) by all ranks or by none.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.decision import Decision, merge_decisions
from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.errors import DistributedError
from ckpt_agent.runtime.dist.comm import Comm, encode_json

__all__ = ["DECISION_BYTES", "Agreed", "DecisionAgreement", "LocalSignals"]

#: Fixed message size of the decision round (one collective instead of two).
DECISION_BYTES = 4096


@dataclass(frozen=True)
class LocalSignals:
    """One rank's inputs to the agreement at one step."""

    step: int
    loss: float
    grad_norm: float | None = None
    system: SystemSignals = field(default_factory=SystemSignals)
    busy: bool = False
    """This rank cannot take a snapshot right now (its persister still owns the buffers)."""
    emergency: bool = False
    """This rank wants an emergency save (its save-now signal, its SIGTERM)."""
    stop: bool = False
    """This rank received SIGTERM: every rank saves and stops."""


@dataclass(frozen=True)
class Agreed:
    """The decision every rank acts on, and what the agreement learned on the way."""

    decision: Decision
    any_busy: bool
    busy_ranks: tuple[int, ...]
    emergency_ranks: tuple[int, ...]
    stop: bool
    stop_ranks: tuple[int, ...]
    loss: float
    """The global loss the schedulers observed (mean over ranks)."""
    grad_norm: float | None
    per_rank: tuple[Decision, ...]


_NAN = float("nan")
_F_STEP, _F_LOSS, _F_GRAD, _F_HAS_GRAD, _F_GPU, _F_LAT, _F_NOW, _F_BUSY, _F_EMERG, _F_STOP = range(
    10
)
_F_WARN = 10
_ROW = 11


def _opt(x: float | None) -> float:
    return _NAN if x is None else float(x)


class DecisionAgreement:
    """Agree on every step's save decision (see the module doc)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.rounds = 0
        self.seconds = 0.0

    def agree(
        self, scheduler: AdaptiveScheduler, local: LocalSignals, *, now: float | None = None
    ) -> Agreed:
        t0 = time.perf_counter()
        now = time.time() if now is None else now
        sys_ = local.system
        row = [0.0] * _ROW
        row[_F_STEP] = float(local.step)
        row[_F_LOSS] = float(local.loss)
        row[_F_GRAD] = _opt(local.grad_norm)
        row[_F_HAS_GRAD] = 0.0 if local.grad_norm is None else 1.0
        row[_F_GPU] = _opt(None if sys_.gpu_errors is None else float(sys_.gpu_errors))
        row[_F_LAT] = _opt(sys_.write_latency_ms)
        row[_F_NOW] = now
        row[_F_BUSY] = 1.0 if local.busy else 0.0
        row[_F_EMERG] = 1.0 if local.emergency else 0.0
        row[_F_STOP] = 1.0 if local.stop else 0.0
        row[_F_WARN] = 1.0 if sys_.node_warning else 0.0
        rows = self.comm.all_gather_f64(row)
        steps = sorted({int(r[_F_STEP]) for r in rows})
        if len(steps) != 1:
            raise DistributedError(
                f"ranks are at different steps {steps}: call step() at every step on every rank"
            )
        n = len(rows)
        loss = sum(r[_F_LOSS] for r in rows) / n  # same order on every rank: bitwise equal
        grads = [r[_F_GRAD] for r in rows if r[_F_HAS_GRAD]]
        grad: float | None = None
        if grads:  # a non-finite norm anywhere is the global norm (the anomaly is global)
            bad = [g for g in grads if not math.isfinite(g)]
            grad = bad[0] if bad else max(grads)
        gpus = [r[_F_GPU] for r in rows if not math.isnan(r[_F_GPU])]
        lats = [r[_F_LAT] for r in rows if not math.isnan(r[_F_LAT])]
        warned = [i for i, r in enumerate(rows) if r[_F_WARN]]
        system = SystemSignals(
            gpu_errors=int(sum(gpus)) if gpus else None,
            write_latency_ms=max(lats) if lats else None,
            node_warning=f"node warning on rank(s) {warned}" if warned else None,
        )
        emergency = tuple(i for i, r in enumerate(rows) if r[_F_EMERG])
        stop = tuple(i for i, r in enumerate(rows) if r[_F_STOP])
        if emergency or stop:
            who = sorted(set(emergency) | set(stop))
            what = "SIGTERM" if stop else "save-now"
            scheduler.request_emergency(f"{what} on rank(s) {who}")
        decision = scheduler.observe(local.step, loss, grad, system=system, now=rows[0][_F_NOW])
        # Round 2: decisions and busy flags; merge, adopt.
        mine = {"d": _fit(decision.to_dict()), "busy": local.busy}
        gathered = self.comm.all_gather_json(mine, fixed=DECISION_BYTES)
        per_rank = tuple(Decision.from_dict(g["d"]) for g in gathered)
        merged = merge_decisions(per_rank)
        scheduler.adopt(merged)
        busy = tuple(i for i, g in enumerate(gathered) if g.get("busy"))
        self.rounds += 1
        self.seconds += time.perf_counter() - t0
        return Agreed(
            decision=merged,
            any_busy=bool(busy),
            busy_ranks=busy,
            emergency_ranks=emergency,
            stop=bool(stop),
            stop_ranks=stop,
            loss=loss,
            grad_norm=grad,
            per_rank=per_rank,
        )


def _fit(d: dict[str, Any]) -> dict[str, Any]:
    """A decision dict whose JSON fits :data:`DECISION_BYTES` (long reasons are cut)."""
    if len(encode_json(d)) + 64 <= DECISION_BYTES:
        return d
    out = dict(d)
    out["reason"] = str(out.get("reason", ""))[:1024] + "…"
    return out
