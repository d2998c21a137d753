"""The RNG restore point a framework adapter calls (issue #26).

``start()`` restores the RNG at once; a framework then seeds (HF ``set_seed``) or
creates data iterators (a seed drawn from the global generator) before the first
resumed step, and the resume was silently not bitwise. ``restore_rng()`` puts the
checkpoint's RNG back at the moment the adapter chooses.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer

ConfigFactory = Callable[..., AgentConfig]


def _ckpt(config: AgentConfig) -> Checkpointer:
    model = torch.nn.Linear(4, 2)
    return Checkpointer(config, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_restore_rng_puts_back_the_checkpoints_rng_after_the_framework_drew(
    ck_config: ConfigFactory,
) -> None:
    cfg = ck_config()
    first = _ckpt(cfg)
    first.start()
    first.step(0, 1.0)
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    first.save_now("the RNG at this point is the checkpoint's")
    want = _draws()
    first.close()

    second = _ckpt(cfg)
    assert second.start().resumed
    torch.manual_seed(42)  # the framework's own seeding after start()
    torch.rand(5)
    random.random()
    assert _draws() != want
    assert second.restore_rng() is True
    assert _draws() == want
    assert second.restore_rng() is False  # once per resume
    second.close()


def test_restore_rng_on_a_fresh_start_restores_nothing(ck_config: ConfigFactory) -> None:
    ckpt = _ckpt(ck_config())
    ckpt.start()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    assert ckpt.restore_rng() is False
    assert torch.equal(torch.get_rng_state(), before)
    ckpt.close()
