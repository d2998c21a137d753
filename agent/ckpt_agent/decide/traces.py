"""Failure traces and training curves for the policy simulator (pure, no I/O).

A :class:`Trace` is what happens to a job in wall time: failures, the
warnings that precede some of them, and the loss and gradient norm the
training produces at every step (a function of the step, so a restart
replays the same values). Built by :func:`poisson_trace` (seeded,
deterministic) or :func:`parse_trace` (the text of a JSON or CSV file of
failure times).

Curves (:func:`training_curves`): a steep early phase (loss × 0.8 per step
for 20 steps), a slow descent to a noisy plateau (±10 %), loss spikes (× 4
for 5 steps) and gradient-norm spikes (× 5 for 30 steps) every ~20,000
steps; the gradient norm is otherwise stationary noise (1 ± 0.1, Gaussian).
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LLAMA3_MTBF_S",
    "WARNING_KINDS",
    "Alert",
    "Curves",
    "Trace",
    "parse_trace",
    "poisson_trace",
    "training_curves",
]

LLAMA3_MTBF_S = 54 * 86_400 / 419
"""Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs."""

WARNING_KINDS = ("latency", "node", "gpu")
"""How a warning shows: sustained storage latency, a node warning, new GPU errors."""


@dataclass(frozen=True)
class Alert:
    """A warning from ``start`` until ``end`` (wall seconds)."""

    start: float
    end: float
    kind: str = "node"


@dataclass(frozen=True)
class Curves:
    """Loss and gradient norm by step."""

    loss: Sequence[float]
    grad: Sequence[float]


@dataclass(frozen=True)
class Trace:
    """A job's failures and warnings over ``horizon`` wall seconds."""

    name: str
    horizon: float
    failures: tuple[float, ...]
    warnings: tuple[Alert, ...] = ()
    """Sorted by start."""
    mtbf: float = 0.0
    """The true MTBF (``horizon / failures`` when built from a file)."""
    warned_share: float = 0.0
    """Share of the failures a warning precedes."""
    unwarned_rate: float | None = None
    """Rate of the unannounced failures when they are a Poisson process (their lost work is
    then counted as its expectation along the replay, see :mod:`ckpt_agent.decide.simulate`);
    None: count each failure's lost work as it falls (a trace from a file)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """``checked``: False for a trace from a file (no target applies to it)."""


def poisson_trace(
    name: str,
    *,
    mtbf: float,
    horizon: float,
    warned: float,
    lead: tuple[float, float] = (30.0, 120.0),
    seed: int = 0,
) -> Trace:
    """Poisson failures with mean ``mtbf``; a share ``warned`` of them is announced by a
    warning ``lead`` seconds (uniform) ahead that holds until the failure; the warnings'
    kinds take turns (:data:`WARNING_KINDS`)."""
    rng = random.Random(seed)
    failures: list[float] = []
    warnings: list[Alert] = []
    t = rng.expovariate(1.0 / mtbf)
    while t < horizon:
        failures.append(t)
        if rng.random() < warned:
            ahead = rng.uniform(*lead)
            kind = WARNING_KINDS[len(warnings) % len(WARNING_KINDS)]
            warnings.append(Alert(max(0.0, t - ahead), t, kind))
        t += rng.expovariate(1.0 / mtbf)
    share = len(warnings) / len(failures) if failures else 0.0
    return Trace(
        name, horizon, tuple(failures), _by_start(warnings), mtbf, share, (1.0 - warned) / mtbf
    )


def _by_start(alerts: Iterable[Alert]) -> tuple[Alert, ...]:
    return tuple(sorted(alerts, key=lambda a: (a.start, a.end)))


def training_curves(steps: int, *, seed: int = 0) -> Curves:
    """Loss and gradient norm for ``steps`` steps (see the module docstring)."""
    rng = random.Random(seed)
    loss: list[float] = []
    grad: list[float] = []
    spike_every = 20_000
    for s in range(steps):
        if s < 20:
            base = 10.0 * 0.8**s
        else:
            base = 0.03 + (10.0 * 0.8**20 - 0.03) * math.exp(-(s - 20) / 20_000)
        x = base * (1.0 + rng.uniform(-0.1, 0.1))
        phase = s % spike_every
        if s >= spike_every and phase < 5:
            x *= 4.0
        loss.append(x)
        g = rng.gauss(1.0, 0.1)
        if s >= spike_every and spike_every // 2 <= phase < spike_every // 2 + 30:
            g *= 5.0
        grad.append(g)
    return Curves(loss, grad)


def _rows_of(text: str) -> list[tuple[float, float | None]]:
    """(failure time, warning lead or None) rows of a JSON or CSV text."""
    stripped = text.lstrip()
    rows: list[tuple[float, float | None]] = []
    if stripped.startswith(("[", "{")):
        data = json.loads(text)
        items = data.get("failures", []) if isinstance(data, dict) else data
        for item in items:
            if isinstance(item, dict):
                lead = item.get("warning_lead", item.get("warningLead"))
                rows.append((float(item["time"]), None if lead is None else float(lead)))
            else:
                rows.append((float(item), None))
        return rows
    reader = csv.reader(io.StringIO(text))
    for rec in reader:
        cells = [c.strip() for c in rec]
        if not cells or not cells[0] or cells[0].startswith("#"):
            continue
        try:
            t = float(cells[0])
        except ValueError:
            continue  # a header line
        lead = float(cells[1]) if len(cells) > 1 and cells[1] else None
        rows.append((t, lead))
    return rows


def parse_trace(text: str, *, name: str = "file", horizon: float | None = None) -> Trace:
    """A trace from the text of a file of failure times (seconds from the start).

    JSON: a list of times, a list of ``{"time": t, "warning_lead": s}`` objects, or
    ``{"failures": [...], "horizon": h}``; CSV: ``time[,warning_lead]`` rows (a header
    line is skipped). A failure with a lead is announced that many seconds ahead.
    ``horizon`` defaults to the file's, else the last failure plus the mean gap.
    Raises ValueError on a negative, non-finite or non-numeric time.
    """
    rows = sorted(_rows_of(text))
    if any(not math.isfinite(t) or t < 0 for t, _ in rows):
        raise ValueError("failure times must be finite seconds >= 0 from the start of the job")
    if horizon is None and text.lstrip().startswith("{"):
        h = json.loads(text).get("horizon")
        horizon = None if h is None else float(h)
    times = tuple(t for t, _ in rows)
    if horizon is None:
        horizon = (times[-1] * (1 + 1 / len(times))) if times else 86_400.0
    warnings = _by_start(
        Alert(max(0.0, t - lead), t, WARNING_KINDS[i % len(WARNING_KINDS)])
        for i, (t, lead) in enumerate((t, lead) for t, lead in rows if lead is not None)
    )
    mtbf = horizon / len(times) if times else horizon
    share = len(warnings) / len(times) if times else 0.0
    return Trace(name, horizon, times, warnings, mtbf, share, None, {"checked": False})
