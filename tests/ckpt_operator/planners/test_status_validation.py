"""Conditions and field-level validation messages."""

from __future__ import annotations

from typing import Any

from ckpt_operator.model import constants as c
from ckpt_operator.planners.status import get_condition, policy_ready_status, set_condition
from ckpt_operator.planners.validation import (
    CHECKED_ANNOTATIONS,
    annotation_errors,
    parse_policy_spec,
)

T0 = 1714640000.0


def test_transition_time_changes_only_with_status() -> None:
    conds = set_condition(None, "Ready", "True", "Validated", "ok", now=T0, observed_generation=1)
    assert conds[0]["lastTransitionTime"] == "2024-05-02T08:53:20Z"
    same = set_condition(conds, "Ready", "True", "Validated", "still ok", now=T0 + 60)
    assert same[0]["lastTransitionTime"] == conds[0]["lastTransitionTime"]
    assert same[0]["message"] == "still ok"
    flipped = set_condition(same, "Ready", "False", "InvalidSpec", "bad", now=T0 + 120)
    assert flipped[0]["lastTransitionTime"] == "2024-05-02T08:55:20Z"


def test_other_conditions_are_kept_in_order() -> None:
    conds = set_condition(None, "Ready", "True", "A", "", now=T0)
    conds = set_condition(conds, "Reconciled", "True", "B", "", now=T0)
    conds = set_condition(conds, "Ready", "False", "C", "", now=T0)
    assert [x["type"] for x in conds] == ["Ready", "Reconciled"]
    reconciled = get_condition(conds, "Reconciled")
    assert reconciled is not None and reconciled["reason"] == "B"


def test_policy_ready_status(fixture: Any) -> None:
    status = policy_ready_status(None, generation=3, errors=[], now=T0)
    assert status["observedGeneration"] == 3
    assert status["conditions"][0]["status"] == "True"
    assert status["conditions"][0]["observedGeneration"] == 3
    bad = policy_ready_status(status, generation=4, errors=["spec.x: nope"], now=T0 + 1)
    assert bad["conditions"][0]["status"] == "False"
    assert bad["conditions"][0]["message"] == "spec.x: nope"


def test_valid_recorded_policy_parses(fixture: Any) -> None:
    spec, errors = parse_policy_spec(fixture("checkpointpolicy.json")["spec"])
    assert errors == [] and spec is not None
    assert spec.storage.url() == "s3://ml-checkpoints/team-a"


def test_field_level_messages(fixture: Any) -> None:
    spec = fixture("checkpointpolicy.json")["spec"]
    spec["tiers"]["pulse"]["minInterval"] = 0
    spec["scheduler"]["loss"]["weight"] = 1.5
    spec["agent"]["unknownField"] = True
    parsed, errors = parse_policy_spec(spec)
    assert parsed is None
    text = "\n".join(errors)
    assert "spec.tiers.pulse.minInterval: Input should be greater than or equal to 1" in text
    assert "spec.scheduler.loss.weight: Input should be less than or equal to 1" in text
    assert "spec.agent.unknownField: Extra inputs are not permitted" in text


def test_cross_field_rules_name_the_section(fixture: Any) -> None:
    spec = fixture("checkpointpolicy.json")["spec"]
    spec["tiers"]["pulse"]["minInterval"] = 800
    _, errors = parse_policy_spec(spec)
    assert errors == ["spec.tiers: tiers.pulse.minInterval must be <= pulse.maxInterval"]


def _called(annotations: dict[str, str], old: dict[str, str] | None) -> bool:
    """The chart's job validation ``matchConditions`` in Python (``old`` None: a CREATE):
    a checked annotation present and absent or different before."""
    return any(
        k in annotations and (old is None or old.get(k) != annotations[k])
        for k in CHECKED_ANNOTATIONS
    )


def test_annotation_errors_refuse_only_writes_the_webhook_conditions_call() -> None:
    """Every combination of absent/valid/invalid values of checked and unchecked keys, on
    CREATE and UPDATE: what the chart's condition skips, annotation_errors never refuses
    (issue #19; the rendered condition: test_chart.py)."""
    values: dict[str, tuple[str | None, ...]] = {
        c.ANN_RUN_ID: (None, "run-1", "../x"),
        c.ANN_RECOVER_STEP: (None, "10", "x"),
        c.ANN_RECOVER_BY: (None, "alice", ""),
        c.ANN_POLICY: (None, "p"),
        "ckpt.dev/intent": (None, "{}"),
    }
    combos: list[dict[str, str]] = [{}]
    for key, choices in values.items():
        combos = [{**a, key: v} if v is not None else a for a in combos for v in choices]
    refused = 0
    for new in combos:
        for old in [None, *combos]:
            if annotation_errors(new, old):
                refused += 1
                assert _called(new, old), (new, old)
    assert refused > 0
