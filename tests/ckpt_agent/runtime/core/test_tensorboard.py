"""TensorBoard integration: a user's SummaryWriter gets the scheduler's scalars every step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckpt_agent import Checkpointer
from ckpt_agent.policy import AgentConfig


class RecordingWriter:
    """Stands in for ``torch.utils.tensorboard.SummaryWriter`` (the package is optional)."""

    def __init__(self) -> None:
        self.scalars: dict[str, dict[int, float]] = {}
        self.closed = False

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None:
        self.scalars.setdefault(tag, {})[global_step] = float(scalar_value)

    def close(self) -> None:
        self.closed = True


def test_score_interval_and_tier_reach_the_users_writer(
    ck_config: Callable[..., AgentConfig],
) -> None:
    cfg = ck_config()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = RecordingWriter()
    ckpt = Checkpointer(cfg, model=model, optimizer=opt, summary_writer=writer)
    ckpt.start()
    for step in range(12):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(step, loss.item())
    ckpt.close()

    assert set(writer.scalars) == {"checkpoint/score", "checkpoint/interval", "checkpoint/tier"}
    for series in writer.scalars.values():
        assert sorted(series) == list(range(12))  # one point per step
    # the scalars are the decisions the log records
    assert cfg.work_dir
    log = Path(cfg.work_dir) / "decisions.rank0.jsonl"
    decisions: list[dict[str, Any]] = [
        e for line in log.read_text().splitlines() if (e := json.loads(line))["event"] == "decision"
    ]
    rank = {None: -1, "heartbeat": 0, "pulse": 1, "full": 2}
    for d in decisions:
        step = d["step"]
        assert writer.scalars["checkpoint/interval"][step] == d["interval"]
        assert abs(writer.scalars["checkpoint/score"][step] - d["score"]) < 1e-9
        assert writer.scalars["checkpoint/tier"][step] == rank[d["tier"] if d["save"] else None]
    assert max(writer.scalars["checkpoint/tier"].values()) >= 1  # a pulse (or full) was saved
    assert not writer.closed  # the user's writer is the user's to close
