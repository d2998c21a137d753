"""Example manifests shipped in examples/ stay valid against the policy model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ckpt_agent.policy import CheckpointPolicy

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("policy*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_policy_is_valid(path: Path) -> None:
    obj = CheckpointPolicy.model_validate(yaml.safe_load(path.read_text()))
    assert obj.metadata.name
