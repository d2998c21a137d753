"""Decision and SaveOutcome data: JSON round trip, merging per-rank decisions, validation."""

from __future__ import annotations

import itertools
import json

import pytest
from decide_builders import GRAD, N, make, one_anomaly, pulse_at

from ckpt_agent.decide.decision import Decision, SaveOutcome, SaveResult, merge_decisions
from ckpt_agent.policy.models import Tier

# --------------------------------------------------------------------------- serialization


def test_decision_json_line_round_trip() -> None:
    s = make(gradient=GRAD)
    one_anomaly(s)
    d = s.observe(N + 1, 1.0, grad_norm=2.0, now=N + 1.0)
    line = d.to_json_line()
    assert "\n" not in line
    data = json.loads(line)
    for key in ("step", "score", "components", "interval", "tier", "reason"):
        assert key in data
    assert data["tier"] == "pulse" and data["components"]["gradient"] == 0.35
    assert Decision.from_dict(data) == d
    assert Decision.from_dict(json.loads(Decision(step=3, save=False, tier=None).to_json_line()))
    with pytest.raises(ValueError, match="unknown"):
        Decision.from_dict({**data, "bogus": 1})


def test_save_outcome_validation() -> None:
    with pytest.raises(ValueError, match="step"):
        SaveOutcome(SaveResult.TAKEN, Tier.PULSE)
    with pytest.raises(ValueError, match="no tier"):
        SaveOutcome.taken(Decision(step=1, save=False, tier=None))
    with pytest.raises(ValueError, match="no tier"):
        SaveOutcome.deferred(Decision(step=1, save=False, tier=None))
    with pytest.raises(ValueError):
        SaveOutcome.failed("bogus")
    o = SaveOutcome("persisted", "full", persist_seconds=1.0)  # type: ignore[arg-type]
    assert (o.result, o.tier) == (SaveResult.PERSISTED, Tier.FULL)
    assert SaveOutcome.deferred(pulse_at(3, lightweight=True)).lightweight


# --------------------------------------------------------------------------- distributed


def D(tier: Tier | None, **kw: object) -> Decision:
    return Decision(step=7, save=tier is not None, tier=tier, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("decisions", "tier", "lightweight", "emergency"),
    [
        ([D(Tier.HEARTBEAT), D(Tier.HEARTBEAT)], Tier.HEARTBEAT, False, False),
        ([D(None), D(Tier.HEARTBEAT)], Tier.HEARTBEAT, False, False),
        ([D(None), D(None)], None, False, False),
        ([D(Tier.HEARTBEAT), D(Tier.PULSE, lightweight=True)], Tier.PULSE, True, False),
        ([D(Tier.PULSE), D(Tier.PULSE, lightweight=True)], Tier.PULSE, False, False),
        ([D(Tier.FULL, emergency=True), D(Tier.PULSE, lightweight=True)], Tier.FULL, False, True),
    ],
)
def test_merge_decisions_table(
    decisions: list[Decision], tier: Tier | None, lightweight: bool, emergency: bool
) -> None:
    for perm in itertools.permutations(decisions):
        m = merge_decisions(perm)
        assert (m.tier, m.lightweight, m.emergency, m.save) == (
            tier,
            lightweight,
            emergency,
            tier is not None,
        )
        assert m == merge_decisions(decisions)  # order-independent


def _scored(
    score: float,
    *,
    loss: float = 0.0,
    system: float = 0.0,
    interval: int,
    anomaly: str,
    reason: str,
) -> Decision:
    return D(
        Tier.HEARTBEAT,
        score=score,
        components={"loss": loss, "gradient": 0.0, "system": system},
        interval=interval,
        interval_rule="score",
        anomaly=anomaly,
        reason=reason,
    )


def test_merge_takes_max_score_min_interval_and_worst_anomaly() -> None:
    a = _scored(0.25, system=0.25, interval=75, anomaly="grad_anomaly", reason="a")
    b = _scored(0.4, loss=0.4, interval=60, anomaly="nan", reason="b")
    m = merge_decisions([a, b])
    assert m.score == 0.4 and m.components == {"loss": 0.4, "gradient": 0.0, "system": 0.25}
    assert (m.interval, m.anomaly, m.reason) == (60, "nan", "a | b")
    with pytest.raises(ValueError):
        merge_decisions([])
    with pytest.raises(ValueError, match="different steps"):
        merge_decisions([a, Decision(step=8, save=False, tier=None)])


def test_decision_records_the_hazard_and_merge_keeps_the_highest() -> None:
    calm = Decision(step=7, save=False, tier=None, hazard=0.5)
    warned = Decision(step=7, save=False, tier=None, hazard=25.0, warning="node warning: NotReady")
    data = json.loads(warned.to_json_line())
    assert (data["hazard"], data["warning"]) == (25.0, "node warning: NotReady")
    assert Decision.from_dict(data) == warned
    for order in itertools.permutations([calm, warned]):
        m = merge_decisions(order)
        assert (m.hazard, m.warning) == (25.0, "node warning: NotReady")
    old = {k: v for k, v in calm.to_dict().items() if k not in ("hazard", "warning")}
    assert Decision.from_dict(old).hazard == 1.0  # a decision logged before the field
