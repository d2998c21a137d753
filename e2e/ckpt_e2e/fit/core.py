"""What a FIT scenario is, what it reports, and the pass criteria every one shares.

A scenario is a function ``run(ctx) -> Outcome`` registered with :func:`scenario`.
It starts real processes under ``ctx.work_dir``, injects its fault, lets the system
recover without help, and fills an :class:`Outcome` with named :class:`Check`\\ s;
the outcome passes when every check holds. The shared criteria (issue #14):

* recovered automatically;
* recovery time (failure detected -> training running again) <= :data:`RECOVERY_LIMIT_S`;
* losses after recovery equal the uninterrupted run's bit for bit where the resume is
  exact, within :data:`LOSS_TOLERANCE` otherwise;
* no checkpoint acknowledged as committed is lost;
* no corrupted checkpoint is ever marked valid or loaded;
* the restart resumes from a checkpoint a restart may use (:func:`restart_may_resume`):
  of the complete weights checkpoints committed when the fault hit, the newest one valid
  then or a newer one still pending then (its validation lagging, as under load) that the
  restarting trainer verified itself (docs/format.md: a restart verifies pending
  checkpoints newer than the newest valid one before the ladder); every such checkpoint
  newer than the one it resumed from was rejected by that restart or found corrupted.
  Never one committed after the fault, never one older than the newest valid at the
  fault while that one is intact.

Scenario modules register themselves on import; :func:`load_all` imports them.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus

T = TypeVar("T")

#: Failure detected -> training running again, on this (2-core) machine.
RECOVERY_LIMIT_S = 90.0
#: Loss difference allowed after a resume that is not bit-exact.
LOSS_TOLERANCE = 1e-4
#: The modules that register scenarios (imported by :func:`load_all`).
SCENARIO_MODULES = (
    "ckpt_e2e.fit.local",
    "ckpt_e2e.fit.cluster",
    "ckpt_e2e.fit.s3faults",
    "ckpt_e2e.fit.replicas",
)


@dataclass
class Check:
    """One asserted property of a scenario's run."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class Outcome:
    """What one scenario run found (one row of the final table)."""

    scenario: str
    injected_at: str = ""
    recovered_from: str | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None
    loss_delta: float | None = None
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record one property; returns ``ok`` so callers can branch on it."""
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def check_recovery_time(self, seconds: float | None) -> bool:
        self.recovery_s = seconds
        return self.check(
            "recovery time",
            seconds is not None and seconds <= RECOVERY_LIMIT_S,
            f"{seconds:.1f}s (limit {RECOVERY_LIMIT_S:.0f}s)" if seconds is not None else "never",
        )

    def check_losses(
        self, got: dict[int, float], reference: dict[int, float], *, exact: bool
    ) -> bool:
        """Compare the losses after recovery with the uninterrupted run's, step by step."""
        common = sorted(set(got) & set(reference))
        if not common:
            return self.check("losses vs reference", False, "no common steps after recovery")
        delta = max(abs(got[s] - reference[s]) for s in common)
        self.loss_delta = delta
        limit = 0.0 if exact else LOSS_TOLERANCE
        want = "bit-exact" if exact else f"<= {limit:g}"
        return self.check(
            "losses vs reference",
            delta <= limit,
            f"max |delta| {delta:.3g} over {len(common)} steps ({want})",
        )

    def check_resume_choice(
        self,
        resumed: str | None,
        at_fault: Sequence[CheckpointRecord],
        *,
        rejected: Collection[str],
        corrupted_now: Collection[str],
        avoid: Collection[str] = (),
    ) -> bool:
        """The shared criterion on *which* checkpoint the restart took (module docstring):
        ``at_fault`` is what storage held once the trainer was gone, ``rejected`` the ids
        the restart's report says it rejected, ``corrupted_now`` the ids found corrupted
        after the run, ``avoid`` the ones the scenario damaged or made unreadable."""
        may = [r.id for r in restart_may_resume(at_fault, avoid)]
        what = f"resumed from {resumed or '(fresh start)'}; a restart may use {may or 'none'}"
        if not may:
            return self.check("resumed from a checkpoint a restart may use", resumed is None, what)
        if resumed not in may:
            return self.check("resumed from a checkpoint a restart may use", False, what)
        passed_over = [
            c for c in may[: may.index(resumed)] if c not in rejected and c not in corrupted_now
        ]
        if passed_over:
            what += f"; newer ones passed over unverified: {passed_over}"
        return self.check("resumed from a checkpoint a restart may use", not passed_over, what)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out


_TIER_ORDER = {Tier.HEARTBEAT: 0, Tier.PULSE: 1, Tier.FULL: 2}


def _newest_first(r: CheckpointRecord) -> tuple[int, int]:
    return (r.step, _TIER_ORDER[r.tier])  # the ladder's order: a full wins a pulse's step


def restart_may_resume(
    at_fault: Sequence[CheckpointRecord], avoid: Collection[str] = ()
) -> list[CheckpointRecord]:
    """The checkpoints a restart may legitimately resume from, newest first (pure).

    ``at_fault``: the checkpoints committed in storage when the fault hit (listed once
    the trainer was gone, so nothing newer can commit). A restart (the agent's own start,
    :mod:`ckpt_agent.runtime.restore.restorer`) takes the newest complete weights checkpoint
    (pulse or full, not lightweight) that it can use: valid, or pending (committed, the
    validator had not got to it yet) and verified by the restart itself. So the candidates
    are the newest one valid at the fault and every newer one still pending then; the
    restart resumes from the first of them that verifies. ``avoid``: checkpoints the
    scenario damaged or made unreadable (never candidates; other checks cover them).
    """
    usable = (CheckpointStatus.VALID, CheckpointStatus.PENDING)
    complete = sorted(
        (
            r
            for r in at_fault
            if r.tier in (Tier.PULSE, Tier.FULL)
            and r.has_weights
            and not r.lightweight
            and r.status in usable
            and r.id not in avoid
        ),
        key=_newest_first,
        reverse=True,
    )
    valid = [r for r in complete if r.status == CheckpointStatus.VALID]
    if not valid:
        return complete
    floor = _newest_first(valid[0])
    return [r for r in complete if _newest_first(r) >= floor]


@dataclass
class FitContext:
    """What a scenario gets: its own folder, a seed, a progress sink and shared services."""

    work_dir: Path
    seed: int
    log: Callable[[str], None]
    #: Shared, lazily started services (a control plane, MinIO, Toxiproxy) by name;
    #: scenario modules put them here so several scenarios reuse one.
    services: dict[str, Any] = field(default_factory=dict)
    #: Closers run by the runner after every scenario, newest first.
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    #: Closers of the shared ``services``, run once when the whole FIT run ends, newest
    #: first (the runner hands every scenario's context the same dict and list).
    finalizers: list[Callable[[], None]] = field(default_factory=list)

    def shared(self, name: str, start: Callable[[], T], stop: Callable[[T], None]) -> T:
        """The shared service ``name``: started by ``start()`` on first use (then kept in
        :attr:`services`, ``stop(it)`` registered in :attr:`finalizers`); a service the
        caller put there beforehand (e.g. the e2e session's cluster) is used as it is."""
        if name not in self.services:
            service = start()
            self.services[name] = service
            self.finalizers.append(lambda: stop(service))
        got: T = self.services[name]
        return got


@dataclass(frozen=True)
class Scenario:
    """One registered scenario."""

    name: str
    title: str
    run: Callable[[FitContext], Outcome]
    #: What it needs beyond Python + torch: "cluster", "s3", "toxiproxy", "fuse", "gpu".
    needs: frozenset[str] = frozenset()
    #: Roughly how long it takes here, for --list and planning.
    expected_s: float = 30.0


REGISTRY: dict[str, Scenario] = {}


def scenario(
    name: str, title: str, *, needs: tuple[str, ...] = (), expected_s: float = 30.0
) -> Callable[[Callable[[FitContext], Outcome]], Callable[[FitContext], Outcome]]:
    """Register ``run`` as the scenario ``name`` (names are unique, kebab-case)."""

    def register(run: Callable[[FitContext], Outcome]) -> Callable[[FitContext], Outcome]:
        if name in REGISTRY:
            raise ValueError(f"FIT scenario {name!r} registered twice")
        REGISTRY[name] = Scenario(name, title, run, frozenset(needs), expected_s)
        return run

    return register


def load_all() -> dict[str, Scenario]:
    """Import every scenario module and return the registry (in registration order)."""
    for module in SCENARIO_MODULES:
        importlib.import_module(module)
    return REGISTRY


@contextmanager
def stopwatch() -> Iterator[Callable[[], float]]:
    """``with stopwatch() as elapsed: ...; elapsed()`` -> seconds since entry."""
    t0 = time.monotonic()
    yield lambda: time.monotonic() - t0
