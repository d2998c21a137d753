"""The Lightning integration: SIGKILLed at random points, resumed bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fw_harness import Zygote
from killrun import Run, assert_same, killed_run
from test_transformers import _config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = 30


def _run(zygote: Zygote, root: Path, ck_make_config: Any, world: int = 1) -> Run:
    return Run(zygote, "pl_train", root, _config(root, ck_make_config), STEPS, world)


def test_sigkill_anywhere_resumes_bitwise(
    zygote: Zygote, tmp_path: Path, ck_make_config: Any
) -> None:
    want = _run(zygote, tmp_path / "ref", ck_make_config).to_end()
    assert want["global_step"] == STEPS
    run = _run(zygote, tmp_path / "killed", ck_make_config)
    got = killed_run(run, ["step", "save", "commit", "step", "step", "save"], seed=2612)
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
    got = killed_run(run, ["commit", "step", "save"], seed=2614)
    assert_same(got, want)
