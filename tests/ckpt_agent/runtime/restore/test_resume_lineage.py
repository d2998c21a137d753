"""Resume lineages with the real Checkpointer: a pin is applied once, then its lineage continues.

The operator restarts job ``J`` as ``J-r1`` with ``CKPT_RESUME_FROM=A`` in every
pod for the job's whole life; a container of ``J-r1`` that restarts in place
after progress must continue from its own newest checkpoint, not rewind to
``A`` and supersede what it wrote (issue #11).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.format.layout import audit_key, recover_request_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, Lineage
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.runtime.restore.resume_point import ResumePoint
from ckpt_agent.storage.fs import LocalStorage

ConfigFactory = Callable[..., AgentConfig]
RUN = "run1"
#: Checkpoints only where the test saves (and every one kept: retention is not under test).
POLICY: dict[str, Any] = {
    "tiers": {
        "heartbeat": {"everySteps": 1},
        "pulse": {"baseInterval": 500, "minInterval": 400, "maxInterval": 600},
        "full": {"everySteps": 1000},
    },
    "retention": {"routineKeep": 100, "importantKeep": 100},
}


class Cursor:
    """The data position (what a sampler's state_dict would hold)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class Job:
    """A small model, SGD with momentum, dropout and a data position: one training process."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 300), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(300, 1)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.data = Cursor()
        self.ckpt: Checkpointer | None = None

    def start(self, config: AgentConfig) -> ResumePoint:
        self.ckpt = Checkpointer(
            config, model=self.model, optimizer=self.opt, dataloader_state=self.data
        )
        return self.ckpt.start()

    def train(self, start: int, stop: int, *, save_at: tuple[int, ...] = ()) -> list[float]:
        """Steps ``start..stop-1``; ``save_now`` after the steps in ``save_at``."""
        losses = []
        for s in range(start, stop):
            x = torch.randn(8, 6) + 0.1 * (self.data.pos % 5)
            self.opt.zero_grad()
            loss = self.model(x).pow(2).mean()
            loss.backward()
            self.opt.step()
            self.data.pos += 1
            losses.append(float(loss.item()))
            if self.ckpt is not None:
                self.ckpt.step(s, losses[-1])
                if s in save_at:
                    assert self.ckpt.save_now(f"test save at {s}") is not None
        return losses

    def stop(self) -> None:
        """The container dies (its storage writes are complete: what a restart finds)."""
        assert self.ckpt is not None
        self.ckpt.close()
        self.ckpt = None


def _store(cfg: AgentConfig) -> LocalStorage:
    return LocalStorage(Path(cfg.work_dir or "").parent / "store")


def _statuses(cfg: AgentConfig) -> dict[int, CheckpointStatus]:
    return {
        r.step: r.status for r in list_checkpoints(_store(cfg), RUN) if r.tier != Tier.HEARTBEAT
    }


def _ckpt(step: int) -> str:
    return f"full_step_{step:012d}"


def _job_j(cfg: AgentConfig) -> None:
    """The original job: checkpoints at steps 5, 10 and 15."""
    job = Job(seed=0)
    assert job.start(cfg).step == 0
    job.train(0, 18, save_at=(5, 10, 15))
    job.stop()


def test_in_place_restart_of_a_pinned_job_continues_its_lineage(ck_config: ConfigFactory) -> None:
    cfg = ck_config(**POLICY)
    _job_j(cfg)
    pinned = cfg.model_copy(update={"resume_from": _ckpt(5)})  # J-r1: CKPT_RESUME_FROM

    # J-r1's first start: the pin is applied, the newer branch (10, 15) retired
    r1 = Job(seed=1)
    first = r1.start(pinned)
    assert (first.checkpoint_id, first.action, first.step) == (_ckpt(5), "resume_from", 6)
    key = "CKPT_RESUME_FROM:" + _ckpt(5)
    assert first.lineage == Lineage(epoch=1, pins=(key,), parent=_ckpt(5))
    assert _statuses(cfg) == {5: "valid", 10: "expired", 15: "expired"}

    # progress past the pin, then the container dies
    r1.train(6, 29, save_at=(12, 20, 28))
    r1.stop()
    newest = read_checkpoint(_store(cfg), RUN, _ckpt(28))[1].meta
    assert newest.lineage == Lineage(epoch=1, pins=(key,), parent=_ckpt(5))
    saved_rng = torch.get_rng_state()
    reference = r1.train(29, 40)  # the same process had it gone on (from step 28's state)

    # the in-place restart: same CKPT_RESUME_FROM, new process
    restarted = Job(seed=2)
    again = restarted.start(pinned)
    assert (again.checkpoint_id, again.action, again.step) == (_ckpt(28), "resume", 29)
    assert again.exact and again.lineage == Lineage(epoch=1, pins=(key,), parent=_ckpt(28))
    statuses = _statuses(cfg)
    assert {s: statuses[s] for s in (5, 12, 20, 28)} == dict.fromkeys((5, 12, 20, 28), "valid")
    torch.set_rng_state(saved_rng)
    assert restarted.train(29, 40, save_at=(35,)) == reference  # bit-exact continuation
    restarted.stop()

    # and once more: still the newest of the lineage, never the pin
    third = Job(seed=3)
    assert third.start(pinned).checkpoint_id == _ckpt(35)
    third.stop()
    assert all(s == "valid" for step, s in _statuses(cfg).items() if step not in (10, 15))


def test_in_place_restart_before_the_first_commit_applies_the_pin_again(
    ck_config: ConfigFactory,
) -> None:
    cfg = ck_config(**POLICY)
    _job_j(cfg)
    pinned = cfg.model_copy(update={"resume_from": _ckpt(10)})
    r1 = Job(seed=1)
    assert r1.start(pinned).checkpoint_id == _ckpt(10)
    r1.train(11, 14)  # heartbeats only: nothing committed
    r1.stop()
    again = Job(seed=2)
    point = again.start(pinned)
    assert (point.checkpoint_id, point.action, point.lineage.epoch) == (_ckpt(10), "resume_from", 1)
    again.stop()


def test_a_new_pin_opens_a_new_lineage(ck_config: ConfigFactory) -> None:
    """J-r1 (pin 5) progresses, J-r2 is pinned to J-r1's newest, restarts in place."""
    cfg = ck_config(**POLICY)
    _job_j(cfg)
    r1 = Job(seed=1)
    r1.start(cfg.model_copy(update={"resume_from": _ckpt(5)}))
    r1.train(6, 22, save_at=(12, 20))
    r1.stop()
    j_r2 = cfg.model_copy(update={"resume_from": _ckpt(20)})
    r2 = Job(seed=2)
    point = r2.start(j_r2)
    assert (point.checkpoint_id, point.action) == (_ckpt(20), "resume_from")
    assert point.lineage.epoch == 2 and point.lineage.pins == ("CKPT_RESUME_FROM:" + _ckpt(20),)
    r2.train(21, 27, save_at=(25,))
    r2.stop()
    r2b = Job(seed=3)
    assert r2b.start(j_r2).checkpoint_id == _ckpt(25)
    r2b.stop()
    statuses = _statuses(cfg)
    assert {s: statuses[s] for s in (5, 12, 20, 25)} == dict.fromkeys((5, 12, 20, 25), "valid")
    assert all(statuses.get(s, "expired") == "expired" for s in (10, 15))  # (or deleted since)


def _recover(store: LocalStorage, step: int) -> None:
    args = ["recover", "--storage", str(store.root), "--run-id", RUN, "--manual"]
    res = CliRunner().invoke(app, [*args, "--step", str(step), "--force"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("crash_before_commit", [False, True])
def test_manual_rewind_in_a_pinned_job_is_applied_once(
    ck_config: ConfigFactory, crash_before_commit: bool
) -> None:
    cfg = ck_config(**POLICY)
    _job_j(cfg)
    pinned = cfg.model_copy(update={"resume_from": _ckpt(10)})
    r1 = Job(seed=1)
    r1.start(pinned)
    r1.train(11, 24, save_at=(18, 22))
    r1.stop()
    store = _store(cfg)
    _recover(store, 5)  # a person rewinds past the operator's pin

    rewound = Job(seed=2)
    point = rewound.start(pinned)
    assert (point.checkpoint_id, point.action) == (_ckpt(5), "manual")
    assert point.lineage.epoch == 2 and point.lineage.pins[1] == "CKPT_RESUME_FROM:" + _ckpt(10)
    assert not store.exists(recover_request_key(RUN))
    if not crash_before_commit:
        rewound.train(6, 9, save_at=(8,))
    rewound.stop()

    # the in-place restart keeps the rewind: neither the operator's pin nor the old branch
    after = Job(seed=3)
    expected = _ckpt(5) if crash_before_commit else _ckpt(8)
    assert after.start(pinned).checkpoint_id == expected
    after.stop()
    statuses = _statuses(cfg)
    assert all(statuses.get(s, "expired") == "expired" for s in (10, 15, 18, 22))
    audit = [json.loads(x)["what"] for x in store.read(audit_key(RUN)).splitlines()]
    assert audit.count("manual recovery applied") == 1
