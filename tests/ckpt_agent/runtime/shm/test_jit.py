"""Just-in-time saves of one process (#31): a failure in the middle of a step saves the
step before it, in shared memory, and the restart resumes right after it, bitwise.

A model with dropout (the RNG matters), AdamW, a data position; flash snapshots through a
sidecar running in a thread; a pulse every 5 steps. The failure is raised in step 13
between the backward pass and ``optimizer.step()``: the ``with Checkpointer`` block's exit
writes step 12, and the restart goes on from step 13 (without JIT: from step 10).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckpt_agent.flash.step_heartbeat import read_step_heartbeat
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_e2e.local_flash import same_state, sidecar_thread

pytestmark = pytest.mark.timeout(120)

RUN = "jit-1"
STEPS, FAIL_AT = 20, 13


class Position:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = int(sd["pos"])


class BoomError(RuntimeError):
    pass


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, pos: Position, step: int, fail: str = ""
) -> float:
    g = torch.Generator().manual_seed(1000 + pos.pos)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)  # dropout draws from the global RNG
    opt.zero_grad()
    loss.backward()
    if fail == "before optimizer.step":
        raise BoomError(f"step {step}: a collective failed")
    opt.step()
    if fail == "after optimizer.step":
        raise BoomError(f"step {step}: logging failed")
    pos.pos += 1
    return float(loss.item())


def _config(tmp_path: Path, jit: bool) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "runId": RUN,
            "storageUrl": (tmp_path / "store").as_uri(),
            "shmDir": str(tmp_path / "shm"),
            "workDir": str(tmp_path / "work"),
            "agent": {"sidecar": True, "jitSave": jit},
            "tiers": {
                "heartbeat": {"everySteps": 1000},
                "pulse": {"baseInterval": 5, "minInterval": 5, "maxInterval": 5},
                "full": {"everySteps": 1000},
            },
            "scheduler": {"risk": {"enabled": False}},
            "validation": {"loadInSubprocess": False},
        }
    )


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def _events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    lines = (tmp_path / "work" / "decisions.rank0.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def _fail_then_resume(tmp_path: Path, jit: bool, fail: str) -> tuple[int, dict[str, Any]]:
    """Train, fail in step FAIL_AT, restart, finish; (the step resumed at, final state)."""
    with sidecar_thread(_config(tmp_path, jit)):
        model, opt = _model()
        pos = Position()
        torch.manual_seed(7)
        with pytest.raises(BoomError), Checkpointer(
            _config(tmp_path, jit), model=model, optimizer=opt, dataloader_state=pos,
            storage=None, preallocate=False,
        ) as ckpt:  # fmt: skip
            assert ckpt.start().step == 0
            for step in range(STEPS):
                loss = _step(model, opt, pos, step, fail if step == FAIL_AT else "")
                ckpt.step(step, loss)
        model, opt = _model()
        pos = Position()
        torch.manual_seed(99)  # the restart must put the RNG back itself
        with Checkpointer(
            _config(tmp_path, jit), model=model, optimizer=opt, dataloader_state=pos,
            storage=None, preallocate=False,
        ) as ckpt:  # fmt: skip
            resume = ckpt.start()
            assert resume.exact and pos.pos == resume.step
            for step in range(resume.step, STEPS):
                ckpt.step(step, _step(model, opt, pos, step))
    return resume.step, _state(model, opt)


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, Any]:
    model, opt = _model()
    pos = Position()
    torch.manual_seed(7)
    for step in range(STEPS):
        _step(model, opt, pos, step)
    return _state(model, opt)


def test_a_failure_before_the_optimizer_step_loses_only_that_step(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    resumed, state = _fail_then_resume(tmp_path, True, "before optimizer.step")
    assert resumed == FAIL_AT
    assert same_state(state, uninterrupted)
    (saved,) = [e for e in _events(tmp_path, "jit_save") if e["outcome"] == "saved"]
    assert saved["step"] == FAIL_AT - 1 and "BoomError: step 13" in saved["failure"]
    mark = read_step_heartbeat(tmp_path / "shm" / RUN / "rank_00000")
    assert mark is not None and mark.heartbeat.step == STEPS - 1  # the restarted run's too


def test_a_failure_after_the_optimizer_step_saves_nothing_and_resumes_from_the_pulse(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    resumed, state = _fail_then_resume(tmp_path, True, "after optimizer.step")
    assert resumed == 11  # the pulse of step 10: the live state was step 13's, not 12's
    assert same_state(state, uninterrupted)
    (skipped,) = _events(tmp_path, "jit_save")
    assert skipped["outcome"] == "skipped" and "optimizer stepped" in skipped["reason"]


def test_without_jit_the_failure_goes_back_to_the_pulse(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    resumed, state = _fail_then_resume(tmp_path, False, "before optimizer.step")
    assert resumed == 11
    assert same_state(state, uninterrupted)
    assert _events(tmp_path, "jit_save") == []
    assert read_step_heartbeat(tmp_path / "shm" / RUN / "rank_00000") is None
