"""Replay failure traces through checkpoint policies and count the wasted time (pure).

:func:`replay` runs one policy over one :class:`~ckpt_agent.decide.traces.Trace`
step by step in simulated wall time: every step takes ``step_time``; a save
stalls training ``stall`` seconds (a lightweight pulse ``light_stall``) and
becomes durable ``persist`` seconds later; a failure loses the work since the
last durable weights-bearing save (lightweight pulses lack the optimizer and
are no restart point), costs ``restart`` seconds, and the policy resumes from
the state stored with that save (the real scheduler's ``state_dict``).

Wasted time: *avoidable* = stalls + lost work; *total* adds the restarts
(the same for every policy). Lost work of an announced failure (and of every
failure of a trace from a file) is counted as it falls; that of the
unannounced failures of a Poisson trace as its expectation along the replay,
``rate × ∫ (work done − work at the last durable save) dt`` over running time
(the compensator of the Poisson process: unbiased, but free of the luck of
where each failure falls within a save interval, which otherwise swamps
differences of a few percent). The failures still happen when the trace says.

:func:`compare` replays the policies side by side on the same trace:

* ``adaptive``: the real :class:`~ckpt_agent.decide.scheduler.AdaptiveScheduler`
  with the default policy (``risk.mtbfSeconds`` set to the trace's MTBF);
* ``adaptive (prior→refined)``: the same with the policy's *default* MTBF
  (86,400 s), refined after each failure as the operator does
  (:func:`~ckpt_agent.decide.mtbf.estimate_mtbf` of the failures so far over the
  time since the run started, passed to the restarted pod): what a user who sets
  no ``mtbfSeconds`` gets;
* ``fixed@IO``: a fixed pulse interval with the same IO (saves, a lightweight
  pulse counting half) as ``adaptive``;
* ``young_daly``: a fixed pulse interval of ``√(2·δ·M)`` with the true MTBF;
* ``oracle``: ``√(2·δ·M/u)`` while calm (u: the true share of unannounced
  failures), a save at a warning's onset and every few steps while it holds;
* ``seed``: the same scheduler with the seed's interval rules (base interval ×
  (1 − score), capped by Young/Daly) and its ±1σ gradient rule.

δ is the save cost the scheduler measures (stall + persist). The fixed intervals
keep the scheduler's full tier (a full every ``full.everySteps`` steps, resetting
the pulse count; a pulse due just before a full is taken as the full), as a
fixed-interval policy would: what is compared is the pulse rule, at the same IO
— a plain fixed interval without that cadence spaces its saves evenly, which
the full tier does not allow. The oracle, which has no full tier, is measured
against plain fixed intervals.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.sim_policies import (
    LIGHT,
    REFINED,
    OraclePolicy,
    Policy,
    RefinedPolicy,
    SchedulerPolicy,
    SeedScheduler,
    full_now,
)
from ckpt_agent.decide.traces import Alert, Curves, Trace
from ckpt_agent.policy.models import TiersSpec
from ckpt_agent.policy.scheduler_models import GradientLayerSpec, RiskSpec, SchedulerSpec

__all__ = [
    "Comparison",
    "Costs",
    "Result",
    "compare",
    "replay",
    "replay_fixed",
]


@dataclass(frozen=True)
class Costs:
    """Seconds per step, per save and per restart."""

    step_time: float = 2.0
    stall: float = 2.0
    persist: float = 5.0
    restart: float = 30.0
    light_stall: float = 1.0
    """Stall of a lightweight pulse (weights + RNG only)."""
    alarm_steps: int = 10
    """The oracle's interval while a warning holds (steps)."""

    @property
    def delta(self) -> float:
        """The save cost the scheduler measures: stall + persist."""
        return self.stall + self.persist


@dataclass
class Result:
    """What one policy cost on one trace."""

    policy: str
    saves: int = 0
    light: int = 0
    stall_s: float = 0.0
    lost_s: float = 0.0
    restart_s: float = 0.0
    failures: int = 0

    @property
    def io(self) -> float:
        """Saves written, a lightweight pulse counting half."""
        return self.saves + 0.5 * self.light

    @property
    def avoidable(self) -> float:
        return self.stall_s + self.lost_s

    @property
    def total(self) -> float:
        return self.avoidable + self.restart_s


def _alert_at(
    alerts: Sequence[Alert], starts: Sequence[float], longest: float, now: float
) -> Alert | None:
    """The warning that holds at ``now`` (sorted by start; none lasts over ``longest`` s)."""
    i = bisect.bisect_right(starts, now) - 1
    while i >= 0 and now - alerts[i].start <= longest:
        if alerts[i].end > now:
            return alerts[i]
        i -= 1
    return None


class _Exposure:
    """``∫ (work done − work at the last durable save) dt`` over running time: a Poisson
    failure at rate λ loses λ times this in expectation (the process's compensator)."""

    def __init__(self) -> None:
        self.iw = self.iwb = 0.0
        self.w = self.wb = self.wb_since = 0.0
        self.pending: deque[tuple[float, float]] = deque()

    def compute(self, dt: float) -> None:
        self.iw += self.w * dt + dt * dt / 2
        self.w += dt

    def idle(self, dt: float) -> None:
        self.iw += self.w * dt

    def saved(self, durable_at: float) -> None:
        self.pending.append((durable_at, self.w))

    def _advance(self, t: float) -> None:
        while self.pending and self.pending[0][0] <= t:
            d, work = self.pending.popleft()
            self.iwb += self.wb * (d - self.wb_since)
            self.wb, self.wb_since = work, d

    def failed(self, t_f: float, t_end: float, t_restart: float) -> None:
        """A failure at ``t_f`` (accounted until ``t_end``); running again at ``t_restart``."""
        self._advance(t_f)
        self.iwb += self.wb * (t_end - self.wb_since)
        self.pending.clear()
        self.w, self.wb_since = self.wb, t_restart

    def close(self, t: float) -> float:
        self._advance(t)
        self.iwb += self.wb * (t - self.wb_since)
        self.wb_since = t
        return self.iw - self.iwb


class _Ledger:
    """Failures, restarts and lost work of one replay (see :func:`replay`)."""

    def __init__(self, trace: Trace, res: Result, restart: float) -> None:
        self.res = res
        self.restart = restart
        self.rate = trace.unwarned_rate
        self.warned = frozenset(a.end for a in trace.warnings)
        self.exposure = _Exposure()

    def failure(self, t_f: float, now: float, lost: float) -> float:
        """Book a failure at ``t_f`` (``now``: where the replay is); the restart time."""
        res = self.res
        if self.rate is None or t_f in self.warned:
            res.lost_s += lost
        res.restart_s += self.restart
        res.failures += 1
        t_end = max(now, t_f)
        self.exposure.failed(t_f, t_end, t_end + self.restart)
        return t_end + self.restart

    def close(self, now: float) -> Result:
        exposure = self.exposure.close(now)
        if self.rate is not None:
            self.res.lost_s += self.rate * exposure
        return self.res


def replay(trace: Trace, policy: Policy, curves: Curves, costs: Costs) -> Result:
    """Run ``policy`` over ``trace`` (see the module docstring)."""
    st = costs.step_time
    book = _Ledger(trace, Result(policy.name), costs.restart)
    res, exposure = book.res, book.exposure
    starts = [a.start for a in trace.warnings]
    longest = max((a.end - a.start for a in trace.warnings), default=0.0)
    durable: list[tuple[float, int, Any]] = []  # (durable at, step, snapshot)
    failures = trace.failures
    fi, now, step = 0, 0.0, 0
    n_curve = len(curves.loss)
    while now < trace.horizon:
        if fi < len(failures) and failures[fi] < now + st:
            t_f = failures[fi]
            fi += 1
            while durable and durable[-1][0] > t_f:
                durable.pop()  # not persisted yet: lost with the pod
            back_step, snap = (durable[-1][1], durable[-1][2]) if durable else (0, None)
            partial = max(0.0, t_f - now)
            exposure.compute(partial)
            now = book.failure(t_f, now, partial + (step - back_step) * st)
            step = back_step
            policy.restore(snap)
            continue
        now += st
        step += 1
        exposure.compute(st)
        i = min(step, n_curve - 1)
        alert = _alert_at(trace.warnings, starts, longest, now) if starts else None
        what = policy.decide(step, now, curves.loss[i], curves.grad[i], alert)
        if what is None:
            continue
        stall = costs.light_stall if what == LIGHT else costs.stall
        policy.taken(stall, costs.persist)
        now += stall
        exposure.idle(stall)
        res.stall_s += stall
        if what == LIGHT:
            res.light += 1
        else:
            res.saves += 1
            durable.append((now + costs.persist, step, policy.snapshot()))
            exposure.saved(now + costs.persist)
    return book.close(now)


def replay_fixed(
    trace: Trace, every: int, costs: Costs, name: str = "fixed", full_every: int | None = None
) -> Result:
    """:func:`replay` of :class:`FixedPolicy`, event by event (the same rules)."""
    st, k = costs.step_time, max(1, every)
    book = _Ledger(trace, Result(name), costs.restart)
    res, exposure = book.res, book.exposure
    durable: list[tuple[float, int, int]] = []  # (durable at, step, last full then)
    failures = trace.failures
    fi, now, step, last, last_full = 0, 0.0, 0, 0, 0
    while now < trace.horizon:
        due = last + k
        if full_every is not None:
            # the full comes first, or this pulse is taken as the full
            due = min(due, last_full + full_every)
        t_done = now + (due - step) * st
        f = failures[fi] if fi < len(failures) else math.inf
        if f < t_done:
            fi += 1
            done = max(0, math.floor((f - now) / st))
            exposure.compute(done * st)
            now, step = now + done * st, step + done
            while durable and durable[-1][0] > f:
                durable.pop()
            back, back_full = durable[-1][1:] if durable else (0, 0)
            partial = max(0.0, f - now)
            exposure.compute(partial)
            now = book.failure(f, now, partial + (step - back) * st)
            step, last, last_full = back, back, back_full
            continue
        if now + (due - step - 1) * st >= trace.horizon:
            rest = math.ceil((trace.horizon - now) / st - 1e-9)
            exposure.compute(rest * st)
            now += rest * st
            break  # the save's step would start after the horizon
        exposure.compute(t_done - now)
        exposure.idle(costs.stall)
        if full_now(due - last, due - last_full, k, full_every):
            last_full = due
        now, step, last = t_done + costs.stall, due, due
        res.stall_s += costs.stall
        res.saves += 1
        durable.append((now + costs.persist, step, last_full))
        exposure.saved(now + costs.persist)
    return book.close(now)


def _steps(seconds: float, st: float) -> int:
    return max(1, math.floor(seconds / st)) if math.isfinite(seconds) else 10**9


def _fixed_at_io(
    trace: Trace, costs: Costs, io: float, name: str, full_every: int | None = None
) -> Result:
    """The fixed interval whose IO is closest to ``io`` (ties: the shorter interval)."""
    cache: dict[int, Result] = {}

    def run(k: int) -> Result:
        if k not in cache:
            cache[k] = replay_fixed(trace, k, costs, name, full_every)
        return cache[k]

    guess = max(1, int(trace.horizon / costs.step_time / max(io, 1.0)))
    lo, hi = max(1, guess // 2), guess * 2 + 2
    while lo > 1 and run(lo).io < io:
        lo //= 2
    while run(hi).io >= io and hi < 10**9:
        hi *= 2
    while hi - lo > 1:  # IO falls as k grows: io(lo) >= io > io(hi)
        mid = (lo + hi) // 2
        if run(mid).io >= io:
            lo = mid
        else:
            hi = mid
    a, b = run(lo), run(hi)
    return a if abs(a.io - io) <= abs(b.io - io) else b


def default_spec(mtbf: float, **risk: Any) -> SchedulerSpec:
    """The default scheduler policy with the job's MTBF (and any other risk settings)."""
    return SchedulerSpec(risk=RiskSpec(mtbf_seconds=mtbf, **risk))


@dataclass(frozen=True)
class Comparison:
    """Every policy on one trace, and for each the fixed interval with its IO."""

    trace: Trace
    results: tuple[Result, ...]
    same_io: dict[str, Result]

    def ratio(self, policy: str) -> float:
        """Avoidable waste of ``policy`` over that of a fixed interval with the same IO."""
        r = next(x for x in self.results if x.policy == policy)
        base = self.same_io[policy].avoidable
        return r.avoidable / base if base > 0 else math.nan


def compare(trace: Trace, curves: Curves, costs: Costs | None = None) -> Comparison:
    """Every policy of the module docstring on ``trace``, adaptive first."""
    c = costs if costs is not None else Costs()
    mtbf = trace.mtbf
    spec = default_spec(mtbf)
    seed_spec = spec.model_copy(update={"gradient": GradientLayerSpec(std_multiplier=1.0)})
    unwarned = max(1.0 - trace.warned_share, 1e-9)
    adaptive = replay(
        trace,
        SchedulerPolicy("adaptive", lambda: AdaptiveScheduler(spec, start_time=0.0)),
        curves,
        c,
    )
    prior_spec = SchedulerSpec()  # risk.mtbfSeconds: the policy's default prior
    refined = replay(
        trace,
        RefinedPolicy(REFINED, lambda: AdaptiveScheduler(prior_spec, start_time=0.0)),
        curves,
        c,
    )
    yd = _steps(math.sqrt(2 * c.delta * mtbf), c.step_time)
    calm = _steps(math.sqrt(2 * c.delta * mtbf / unwarned), c.step_time)
    full = TiersSpec().full.every_steps  # the scheduler's full tier (the default policy)
    fixed_io = _fixed_at_io(trace, c, adaptive.io, "fixed@IO", full)
    young_daly = replay_fixed(trace, yd, c, "young_daly", full)
    oracle = replay(trace, OraclePolicy("oracle", calm, c.alarm_steps), curves, c)
    seed = replay(
        trace,
        SchedulerPolicy("seed", lambda: SeedScheduler(seed_spec, start_time=0.0)),
        curves,
        c,
    )
    results = (adaptive, refined, fixed_io, young_daly, oracle, seed)
    # Each policy's fixed-interval twin at the same IO (the oracle has no full tier).
    same_io = {
        fixed_io.policy: fixed_io,
        young_daly.policy: young_daly,
        "adaptive": fixed_io,
        REFINED: _fixed_at_io(trace, c, refined.io, "fixed", full),
        oracle.policy: _fixed_at_io(trace, c, oracle.io, "fixed", None),
        seed.policy: _fixed_at_io(trace, c, seed.io, "fixed", full),
    }
    return Comparison(trace, results, same_io)
