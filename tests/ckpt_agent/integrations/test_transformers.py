"""The Hugging Face ``Trainer`` integration: SIGKILLed at random points, resumed bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import Zygote
from killrun import Run, assert_same, killed_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = 30


def _config(root: Path, ck_make_config: Any) -> Path:
    cfg = ck_make_config(
        root,
        tiers={
            "heartbeat": {"everySteps": 1},
            "pulse": {"baseInterval": 4, "minInterval": 2, "maxInterval": 6},
            "full": {"everySteps": 10},
        },
    )
    root.mkdir(parents=True, exist_ok=True)
    path = root / "ckpt-config.json"
    path.write_text(json.dumps(cfg.to_wire()))
    return path


def _run(zygote: Zygote, root: Path, ck_make_config: Any, world: int = 1) -> Run:
    return Run(zygote, "hf_train", root, _config(root, ck_make_config), STEPS, world)


def test_sigkill_anywhere_resumes_bitwise(
    zygote: Zygote, tmp_path: Path, ck_make_config: Any
) -> None:
    want = _run(zygote, tmp_path / "ref", ck_make_config).to_end()
    assert want["global_step"] == STEPS
    run = _run(zygote, tmp_path / "killed", ck_make_config)
    got = killed_run(run, ["step", "save", "step", "commit", "step", "save"], seed=2611)
    assert_same(got, want)
    assert run.launches == 7
