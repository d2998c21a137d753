"""The Hugging Face ``Trainer`` integration: SIGKILLed at random points, resumed bitwise."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from fw_harness import Zygote
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


@pytest.mark.distributed
@pytest.mark.xdist_group("distributed")
def test_ddp_two_ranks_sigkill_resumes_bitwise(
    zygote: Zygote, tmp_path: Path, ck_make_config: Any
) -> None:
    """Two ranks (gloo, CPU), both SIGKILLed at once, as when the job's pod fails."""
    want = _run(zygote, tmp_path / "ref", ck_make_config, world=2).to_end()
    assert want["global_step"] == STEPS
    run = _run(zygote, tmp_path / "killed", ck_make_config, world=2)
    got = killed_run(run, ["step", "commit", "save"], seed=2613)
    assert_same(got, want)


def test_readme_as_a_callback_fails_loudly(
    zygote: Zygote, tmp_path: Path, ck_make_config: Any
) -> None:
    """The naive port of the README (a Checkpointer built in a callback, step() from on_log):
    after a restart the agent restores step N while the Trainer counts from 0 again. It
    must not train silently (the issue saw 160 steps instead of 120): step() refuses the
    lower step before anything is saved or trained on."""
    run = Run(zygote, "hf_naive", tmp_path, _config(tmp_path, ck_make_config), STEPS)
    run.kill_at("commit", random.Random(0))
    committed = (run.out / "commits").read_text().split()
    children = run.launch()
    codes = [c.wait(120) for c in children]
    assert codes == [1], run.log
    error = children[0].error()
    assert "StepOrderError" in error and "start().step" in error, error
    assert not (run.out / "final.pt").exists()
    assert (run.out / "commits").read_text().split() == committed  # nothing saved after
