"""The agent's Prometheus metrics that answer "what did checkpointing cost and did recovery work"."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ckpt_agent.metrics import Metrics
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer, ResumeError

ConfigFactory = Callable[..., AgentConfig]


def _run(cfg: AgentConfig, steps: int) -> Metrics:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 200)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(cfg, model=model, optimizer=opt)
    first = ckpt.start().step
    for s in range(first, first + steps):
        loss = model(torch.randn(2, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        ckpt.step(s, loss)
    ckpt.save_now("test")
    m = ckpt.metrics
    assert 0 < m.value("ckpt_io_time_ratio") < 1  # stalled a little, trained mostly
    ckpt.close()
    return m


def test_recovery_outcomes_time_and_io_share(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    m = _run(cfg, 12)
    assert m.value("ckpt_recoveries_total", {"outcome": "fresh"}) == 1
    assert m.value("ckpt_recovery_seconds_count") == 1
    assert m.value("ckpt_stall_seconds_count", {"tier": "full"}) == 1
    m = _run(cfg, 3)
    assert m.value("ckpt_recoveries_total", {"outcome": "resume"}) == 1
    assert m.value("ckpt_recovery_seconds_count") == 1 and m.value("ckpt_recovery_seconds_sum") > 0
    gone = cfg.model_copy(update={"resume_from": "pulse_step_000000004242"})
    ckpt = Checkpointer(gone, model=torch.nn.Linear(8, 200))
    with pytest.raises(ResumeError):
        ckpt.start()
    assert ckpt.metrics.value("ckpt_recoveries_total", {"outcome": "failed"}) == 1
    assert ckpt.metrics.value("ckpt_recovery_seconds_count") == 0


def test_io_ratio_is_stall_over_wall_time() -> None:
    m = Metrics()
    m._started -= 10.0  # ten seconds in
    m.add_stall("pulse", 1.0)
    m.add_stall("full", 0.5)
    assert m.value("ckpt_io_time_ratio") == pytest.approx(0.15, rel=0.01)
    assert m.value("ckpt_stall_seconds_sum", {"tier": "pulse"}) == 1.0
