"""Steps that go backwards are refused, never turned into data loss (issue #26).

Retention orders checkpoints by step; a framework that restarts its counter at 0 on the
same run id (or calls ``step()`` once per micro-batch) used to be accepted, and then
``close()`` kept ``full_step_4`` and deleted the newer ``full_step_2``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_agent.errors import StepOrderError
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.storage.fs import LocalStorage

ConfigFactory = Callable[..., AgentConfig]


def _ckpt(config: AgentConfig) -> Checkpointer:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Checkpointer(config, model=model, optimizer=opt)


def test_counter_restarted_at_zero_on_the_same_run_is_refused_and_keeps_both(
    tmp_path: Path, ck_config: ConfigFactory
) -> None:
    cfg = ck_config()
    first = _ckpt(cfg)
    assert first.start().step == 0
    for s in range(5):
        first.step(s, 1.0)
    first.save_now("end of the first run")
    first.close()
    store = LocalStorage(tmp_path / "store")
    before = {r.id for r in list_checkpoints(store, cfg.run_id, include_heartbeat=False)}
    assert "full_step_000000000004" in before

    second = _ckpt(cfg)  # a framework that restarts its own counter, ignoring start()
    resume = second.start()
    assert resume.step == 5
    with pytest.raises(StepOrderError) as err:
        second.step(0, 1.0)
    msg = str(err.value)
    assert "step(0) is not after step 4" in msg and "start().step (5)" in msg
    assert "CKPT_RUN_ID" in msg
    second.step(5, 1.0)  # continuing from start().step works
    second.save_now("second run")
    second.close()
    after = {r.id for r in list_checkpoints(store, cfg.run_id, include_heartbeat=False)}
    assert before <= after and "full_step_000000000005" in after


def test_a_repeated_step_in_one_process_is_refused(
    ck_config: ConfigFactory,
) -> None:
    ckpt = _ckpt(ck_config())
    ckpt.start()
    ckpt.step(3, 1.0)
    with pytest.raises(StepOrderError, match=r"step\(3\) is not after step 3.*micro-batch"):
        ckpt.step(3, 1.0)  # gradient accumulation calling once per micro-batch
    with pytest.raises(StepOrderError):
        ckpt.step(2, 1.0)
    ckpt.step(4, 1.0)
    ckpt.close()


def test_a_first_step_past_the_resume_point_is_named_in_a_warning(
    ck_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A framework counts finished steps; passing that count (not minus one) skips a step at
    every resume. The first step() says so (the integrations pass global_step - 1)."""
    ckpt = _ckpt(ck_config())
    ckpt.start()
    with caplog.at_level("WARNING", logger="ckpt_agent.runtime.step_order"):
        ckpt.step(1, 1.0)
        ckpt.step(2, 1.0)
    warned = [r for r in caplog.records if "first step() after start()" in r.getMessage()]
    assert len(warned) == 1 and "continues at step 0" in warned[0].getMessage()
    ckpt.close()


def test_a_first_step_at_the_resume_point_warns_nothing(
    ck_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = _ckpt(ck_config())
    ckpt.start()
    with caplog.at_level("WARNING", logger="ckpt_agent.runtime.step_order"):
        ckpt.step(0, 1.0)
    assert not [r for r in caplog.records if "first step()" in r.getMessage()]
    ckpt.close()
