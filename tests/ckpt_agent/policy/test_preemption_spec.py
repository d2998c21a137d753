"""The policy's ``preemption`` section (#30): defaults, bounds, errors that name the field,
and the CRD carrying it."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from ckpt_agent.policy.crdgen import CRD_PATH
from ckpt_agent.policy.models import CheckpointPolicySpec, PreemptionSpec, PriorityBoostSpec


def test_defaults_are_off_and_bounded() -> None:
    spec = CheckpointPolicySpec()
    boost = spec.preemption.priority_boost
    assert boost == PriorityBoostSpec()
    assert boost.enabled is False  # opt-in: nothing is written to a Workload by default
    assert (boost.max_boost, boost.seconds_per_point, boost.min_update_seconds) == (100, 30.0, 30.0)
    assert spec.preemption.save_on_eviction is True
    assert spec.preemption.max_grace_seconds == 300


def test_wire_names_are_camel_case() -> None:
    spec = CheckpointPolicySpec.model_validate(
        {
            "preemption": {
                "priorityBoost": {
                    "enabled": True,
                    "maxBoost": 50,
                    "secondsPerPoint": 10,
                    "minUpdateSeconds": 60,
                },
                "saveOnEviction": False,
                "maxGraceSeconds": 120,
            }
        }
    )
    assert spec.preemption == PreemptionSpec(
        priority_boost=PriorityBoostSpec(
            enabled=True, max_boost=50, seconds_per_point=10.0, min_update_seconds=60.0
        ),
        save_on_eviction=False,
        max_grace_seconds=120,
    )
    wire = spec.to_wire()["preemption"]
    assert wire["priorityBoost"]["maxBoost"] == 50 and wire["maxGraceSeconds"] == 120


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"priorityBoost": {"maxBoost": 0}}, "maxBoost"),
        ({"priorityBoost": {"maxBoost": 2_000_000}}, "maxBoost"),
        ({"priorityBoost": {"secondsPerPoint": 0}}, "secondsPerPoint"),
        ({"priorityBoost": {"minUpdateSeconds": 0.5}}, "minUpdateSeconds"),
        ({"priorityBoost": {"boost": 3}}, "boost"),
        ({"maxGraceSeconds": -1}, "maxGraceSeconds"),
    ],
)
def test_a_bad_value_names_its_field(section: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        CheckpointPolicySpec.model_validate({"preemption": section})
    locs = [".".join(str(p) for p in e["loc"]) for e in info.value.errors()]
    assert any(loc.startswith("preemption.") and loc.endswith(field) for loc in locs), locs


def test_the_crd_carries_the_section_with_its_bounds() -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    section = spec["properties"]["preemption"]["properties"]
    boost = section["priorityBoost"]["properties"]
    assert boost["enabled"]["default"] is False
    assert (boost["maxBoost"]["minimum"], boost["maxBoost"]["maximum"]) == (1, 1_000_000)
    assert boost["secondsPerPoint"]["exclusiveMinimum"] is True
    assert section["maxGraceSeconds"]["default"] == 300
