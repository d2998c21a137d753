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
* no corrupted checkpoint is ever marked valid or loaded.

Scenario modules register themselves on import; :func:`load_all` imports them.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: Failure detected -> training running again, on this (2-core) machine.
RECOVERY_LIMIT_S = 90.0
#: Loss difference allowed after a resume that is not bit-exact.
LOSS_TOLERANCE = 1e-4
#: The modules that register scenarios (imported by :func:`load_all`).
SCENARIO_MODULES = ("ckpt_e2e.fit.local", "ckpt_e2e.fit.cluster", "ckpt_e2e.fit.s3faults")


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

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["passed"] = self.passed
        return out


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
