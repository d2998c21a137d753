"""The policy's scheduler section (policy.scheduler_models): camelCase wire names, bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ckpt_agent.policy.models import CheckpointPolicySpec
from ckpt_agent.policy.scheduler_models import RiskSpec, SchedulerSpec


def test_the_section_parses_camel_case_and_is_what_the_policy_holds() -> None:
    spec = SchedulerSpec.model_validate(
        {"pulseNowScore": 0.5, "risk": {"mtbfSeconds": 3600, "stallBudget": 0.05}}
    )
    assert spec.pulse_now_score == 0.5
    assert spec.risk == RiskSpec(mtbf_seconds=3600.0, stall_budget=0.05)
    assert (
        CheckpointPolicySpec.model_validate({"scheduler": spec.model_dump(by_alias=True)}).scheduler
        == spec
    )


@pytest.mark.parametrize(
    "patch",
    [
        {"loss": {"ewmaAlpha": 0}},
        {"gradient": {"history": 1}},
        {"system": {"emergencyTier": "heartbeat"}},
        {"risk": {"maxWarnedFraction": 1.0}},
        {"noSuchField": 1},
    ],
)
def test_out_of_bounds_or_unknown_fields_are_refused(patch: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SchedulerSpec.model_validate(patch)
