"""What the scheduler tells the engine and what the engine tells it back (pure data).

* :class:`Decision`: what to save at one step, broadcastable as JSON
  (:meth:`Decision.to_dict`, :meth:`Decision.from_dict`); per-rank decisions
  combine with :func:`merge_decisions`.
* :class:`SaveOutcome`: what became of a save (taken, persisted, deferred,
  failed), fed back through
  :meth:`~ckpt_agent.decide.scheduler.AdaptiveScheduler.settle`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ckpt_agent.decide.tiers import tier_rank
from ckpt_agent.policy.models import Tier

__all__ = [
    "ANOMALY_KINDS",
    "Decision",
    "SaveOutcome",
    "SaveResult",
    "merge_decisions",
]

_new = object.__new__
_set = object.__setattr__

ANOMALY_KINDS = ("nan", "loss_spike", "grad_anomaly")
"""Anomaly kinds, most severe first."""


@dataclass(frozen=True)
class Decision:
    """What to do at one step. Pure data: broadcastable via :meth:`to_dict`."""

    step: int
    """Global step the decision is for."""
    save: bool
    """Save something at this step."""
    tier: Tier | None
    """Highest tier due (full > pulse > heartbeat); None when nothing is due."""
    lightweight: bool = False
    """A pulse with weights + RNG only (gradient anomaly); never set for other tiers."""
    emergency: bool = False
    """Requested by a system alarm or by
    :meth:`~ckpt_agent.decide.scheduler.AdaptiveScheduler.request_emergency`."""
    high_risk: bool = False
    """Taken in a high-risk environment (system layer alarm)."""
    score: float = 0.0
    """Sum of the weights of the fired layers."""
    components: dict[str, float] = field(default_factory=dict)
    """Per-layer contribution: ``loss``, ``gradient``, ``system`` (the scheduler hands the
    same dict to every decision with the same contributions: read it, do not change it)."""
    interval: int = 0
    """Current dynamic pulse interval in steps."""
    interval_rule: str = "base"
    """Which rule set the interval (see :data:`~ckpt_agent.decide.intervals.INTERVAL_RULES`)."""
    reason: str = ""
    """Human-readable why (``;``-separated when several rules agree)."""
    anomaly: str | None = None
    """Anomaly detected at this step (``nan``, ``loss_spike``, ``grad_anomaly``)."""
    hazard: float = 1.0
    """Failure-rate multiplier the interval was sized for (:mod:`ckpt_agent.decide.hazard`):
    ``1 − warned share`` while calm, ``mtbf / warning_mtbf`` while a warning holds."""
    warning: str | None = None
    """The warning that holds (system alarm or node warning); None while calm."""
    memory: bool = False
    """A memory-tier snapshot is due (``tiers.memory``): into the node's shared memory and
    the peers' replicas, never to storage. Set when neither a pulse nor a full is due (those
    go to shared memory too); ``save`` and ``tier`` keep saying what is due durably."""
    memory_interval: int = 0
    """The memory tier's current interval in steps (0: the tier is off)."""

    @property
    def memory_only(self) -> bool:
        """This step's snapshot goes to memory only (a memory-tier snapshot, no pulse or full)."""
        return self.memory and self.tier not in (Tier.PULSE, Tier.FULL)

    @property
    def snapshot_tier(self) -> Tier | None:
        """The tier of the weights-bearing snapshot this decision takes (pulse or full; a
        memory-tier snapshot is a pulse's content); None: no snapshot."""
        if self.tier in (Tier.PULSE, Tier.FULL):
            return self.tier
        return Tier.PULSE if self.memory else None

    @classmethod
    def quick(
        cls,
        step: int,
        tier: Tier | None,
        score: float,
        components: dict[str, float],
        interval: int,
        interval_rule: str,
        reason: str,
        anomaly: str | None,
        hazard: float,
        warning: str | None,
        memory_interval: int = 0,
    ) -> Decision:
        """``Decision(step, save=tier is not None, tier, ...)`` with no emergency, not
        lightweight, not high-risk: the same instance, built without the frozen
        ``__init__``'s one ``object.__setattr__`` per field (the scheduler's every step).
        Its ``__dict__`` is a copy of a blank decision's, so it shares the class's keys
        as one built by ``__init__`` does (no bigger)."""
        fields = _BLANK.copy()
        fields["step"] = step
        fields["save"] = tier is not None
        fields["tier"] = tier
        fields["score"] = score
        fields["components"] = components
        fields["interval"] = interval
        fields["interval_rule"] = interval_rule
        fields["reason"] = reason
        fields["anomaly"] = anomaly
        fields["hazard"] = hazard
        fields["warning"] = warning
        fields["memory_interval"] = memory_interval
        d = _new(cls)
        _set(d, "__dict__", fields)
        return d

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (tier as its string value)."""
        return {
            "step": self.step,
            "save": self.save,
            "tier": None if self.tier is None else self.tier.value,
            "lightweight": self.lightweight,
            "emergency": self.emergency,
            "high_risk": self.high_risk,
            "score": self.score,
            "components": dict(self.components),
            "interval": self.interval,
            "interval_rule": self.interval_rule,
            "reason": self.reason,
            "anomaly": self.anomaly,
            "hazard": self.hazard,
            "warning": self.warning,
            "memory": self.memory,
            "memory_interval": self.memory_interval,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        """Inverse of :meth:`to_dict` (unknown keys are an error)."""
        known = {
            "step",
            "save",
            "tier",
            "lightweight",
            "emergency",
            "high_risk",
            "score",
            "components",
            "interval",
            "interval_rule",
            "reason",
            "anomaly",
            "hazard",
            "warning",
            "memory",
            "memory_interval",
        }
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Decision keys: {sorted(unknown)}")
        tier = data.get("tier")
        return cls(
            step=int(data["step"]),
            save=bool(data["save"]),
            tier=None if tier is None else Tier(tier),
            lightweight=bool(data.get("lightweight", False)),
            emergency=bool(data.get("emergency", False)),
            high_risk=bool(data.get("high_risk", False)),
            score=float(data.get("score", 0.0)),
            components={str(k): float(v) for k, v in dict(data.get("components", {})).items()},
            interval=int(data.get("interval", 0)),
            interval_rule=str(data.get("interval_rule", "base")),
            reason=str(data.get("reason", "")),
            anomaly=None if data.get("anomaly") is None else str(data["anomaly"]),
            hazard=float(data.get("hazard", 1.0)),
            warning=None if data.get("warning") is None else str(data["warning"]),
            memory=bool(data.get("memory", False)),
            memory_interval=int(data.get("memory_interval", 0)),
        )

    def to_json_line(self) -> str:
        """One line of JSON (no trailing newline), keys sorted."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)


_BLANK: dict[str, Any] = vars(Decision(step=0, save=False, tier=None))
""":meth:`Decision.quick`'s template (a blank decision's fields, keys shared with the class)."""


def merge_decisions(decisions: Iterable[Decision]) -> Decision:
    """Combine per-rank decisions for the same step into the one all ranks act on.

    Order-independent: ``save`` if any rank saves; the highest tier; max score
    and per-component max; the smallest interval (and its rule); the highest hazard
    (and its warning); emergency /
    high-risk if any; lightweight only when every rank that chose the merged
    tier chose a lightweight pulse; a memory-tier snapshot if any rank is due one and the
    merged tier is neither pulse nor full, at the smallest memory interval; the most severe
    anomaly; reasons joined (unique, sorted).
    """
    ds = list(decisions)
    if not ds:
        raise ValueError("merge_decisions needs at least one decision")
    steps = {d.step for d in ds}
    if len(steps) != 1:
        raise ValueError(f"cannot merge decisions for different steps: {sorted(steps)}")
    tier = max((d.tier for d in ds), key=tier_rank)
    at_tier = [d for d in ds if d.tier == tier]
    lightweight = tier == Tier.PULSE and all(d.lightweight for d in at_tier)
    components: dict[str, float] = {}
    for d in ds:
        for k, v in d.components.items():
            components[k] = max(components.get(k, 0.0), v)
    smallest = min(ds, key=lambda d: (d.interval, d.interval_rule))
    anomalies = [d.anomaly for d in ds if d.anomaly is not None]
    anomaly = (
        min(anomalies, key=lambda a: ANOMALY_KINDS.index(a) if a in ANOMALY_KINDS else 99)
        if anomalies
        else None
    )
    reasons = sorted({d.reason for d in ds if d.reason})
    riskiest = max(ds, key=lambda d: (d.hazard, d.warning or ""))
    return Decision(
        step=ds[0].step,
        save=any(d.save for d in ds),
        tier=tier,
        lightweight=lightweight,
        emergency=any(d.emergency for d in ds),
        high_risk=any(d.high_risk for d in ds),
        score=max(d.score for d in ds),
        components=components,
        interval=smallest.interval,
        interval_rule=smallest.interval_rule,
        reason=" | ".join(reasons),
        anomaly=anomaly,
        hazard=riskiest.hazard,
        warning=riskiest.warning,
        memory=tier not in (Tier.PULSE, Tier.FULL) and any(d.memory for d in ds),
        memory_interval=min((d.memory_interval for d in ds), default=0),
    )


class SaveResult(StrEnum):
    """What became of a save: the ``result`` of a :class:`SaveOutcome`."""

    TAKEN = "taken"
    """The snapshot was taken (its stall is known; its persist may still run)."""
    PERSISTED = "persisted"
    """An asynchronous persist finished (its seconds are known)."""
    DEFERRED = "deferred"
    """The save was not taken (backpressure, no free slot): due again next step."""
    FAILED = "failed"
    """The save's persist failed: due again next step."""


@dataclass(frozen=True)
class SaveOutcome:
    """The engine's feedback on one save, for
    :meth:`~ckpt_agent.decide.scheduler.AdaptiveScheduler.settle`.

    Build it with :meth:`taken`, :meth:`persisted`, :meth:`deferred` or
    :meth:`failed`. ``tier`` may be given as its string value.
    """

    result: SaveResult
    tier: Tier
    step: int | None = None
    """The save's step; required for ``TAKEN``, informational otherwise."""
    lightweight: bool = False
    """A lightweight pulse (weights + RNG): resets only the heartbeat, costs not fed."""
    stall_seconds: float | None = None
    """Seconds training was blocked by the snapshot (``TAKEN``)."""
    persist_seconds: float | None = None
    """Seconds the persist took (``PERSISTED``, or ``TAKEN`` when persisted synchronously)."""
    memory: bool = False
    """A memory-tier snapshot (``PERSISTED``: its persister recorded it): its own counter and
    costs, never the durable tiers'."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "result", SaveResult(self.result))
        object.__setattr__(self, "tier", Tier(self.tier))
        if self.result is SaveResult.TAKEN and self.step is None:
            raise ValueError("a taken save needs its step")

    @classmethod
    def taken(
        cls,
        decision: Decision,
        stall_seconds: float | None = None,
        persist_seconds: float | None = None,
    ) -> SaveOutcome:
        """The snapshot ``decision`` asked for was taken (raises when it has no tier)."""
        tier, lightweight = _tier_of(decision)
        return cls(
            SaveResult.TAKEN,
            tier,
            step=decision.step,
            lightweight=lightweight,
            stall_seconds=stall_seconds,
            persist_seconds=persist_seconds,
            memory=decision.memory_only,
        )

    @classmethod
    def persisted(
        cls,
        tier: Tier | str,
        persist_seconds: float,
        *,
        step: int | None = None,
        memory: bool = False,
    ) -> SaveOutcome:
        """An asynchronous persist of ``tier`` finished after ``persist_seconds`` (``memory``:
        a memory-tier snapshot's persister recorded it)."""
        return cls(
            SaveResult.PERSISTED,
            Tier(tier),
            step=step,
            persist_seconds=persist_seconds,
            memory=memory,
        )

    @classmethod
    def deferred(cls, decision: Decision) -> SaveOutcome:
        """The save ``decision`` asked for was not taken."""
        tier, lightweight = _tier_of(decision)
        return cls(
            SaveResult.DEFERRED,
            tier,
            step=decision.step,
            lightweight=lightweight,
            memory=decision.memory_only,
        )

    @classmethod
    def failed(
        cls, tier: Tier | str, *, step: int | None = None, memory: bool = False
    ) -> SaveOutcome:
        """The persist of a ``tier`` save failed (``memory``: a memory-tier snapshot's)."""
        return cls(SaveResult.FAILED, Tier(tier), step=step, memory=memory)


def _tier_of(decision: Decision) -> tuple[Tier, bool]:
    """(tier, lightweight) of a decision's snapshot (:attr:`Decision.snapshot_tier`, else
    its tier: a heartbeat); ValueError when it has none."""
    tier = decision.snapshot_tier or decision.tier
    if tier is None:
        raise ValueError("decision has no tier")
    return tier, decision.lightweight
