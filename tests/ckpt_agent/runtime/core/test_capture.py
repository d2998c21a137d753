"""StateCapture: which sections a rank's snapshot holds, the data position, extra files
(an Engine over fakes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import runtime_fakes as fk
import torch

from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.core.capture import TRAIN_CONFIG_FILE, StateCapture, encode_train_config

ConfigFactory = Callable[..., AgentConfig]


class Position:
    def __init__(self) -> None:
        self.pos = 3

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, s: dict[str, int]) -> None:
        self.pos = s["pos"]


def _capture(
    config: AgentConfig, *, rank: int = 0, world_size: int = 1, **objects: object
) -> StateCapture:
    engine, _ = fk.make_engine(config, rank=rank, world_size=world_size, distributed=world_size > 1)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    kw: dict[str, object] = {"optimizer": opt, "lr_scheduler": sched, **objects}
    return StateCapture(engine, model, **kw)  # type: ignore[arg-type]


def test_a_single_process_snapshot_holds_everything(ck_config: ConfigFactory) -> None:
    cap = _capture(ck_config(), dataloader_state=Position())
    s = cap.sections(lightweight=False, step=12)
    assert set(s) == {"progress", "model", "optimizer", "lr_scheduler", "rng", "data", "scheduler"}
    assert s["progress"] == {"step": 12, "world_size": 1, "rank": 0}
    assert s["data"] == {"pos": 3}
    model = s["model"]
    assert isinstance(model, dict) and set(model) == {"weight", "bias"}


def test_a_lightweight_snapshot_leaves_the_optimizer_state_out(ck_config: ConfigFactory) -> None:
    s = _capture(ck_config()).sections(lightweight=True, step=1)
    assert "model" in s and "rng" in s
    assert not {"optimizer", "lr_scheduler", "grad_scaler"} & set(s)


def test_other_ranks_write_only_their_own_progress_rng_and_data(ck_config: ConfigFactory) -> None:
    cap = _capture(ck_config(), rank=2, world_size=4, dataloader_state=lambda: {"shard": 2})
    s = cap.sections(lightweight=False, step=7)
    assert set(s) == {"progress", "rng", "data"}  # shared state is rank 0's
    assert s["progress"] == {"step": 7, "world_size": 4, "rank": 2}
    assert s["data"] == {"shard": 2}
    zero = _capture(ck_config(), rank=0, world_size=4).sections(lightweight=False, step=7)
    assert {"model", "optimizer", "scheduler"} <= set(zero)


def test_train_config_is_a_file_of_rank_0s_full_snapshots(ck_config: ConfigFactory) -> None:
    cfg = {"lr": 0.1, "layers": [2, 3]}
    zero = _capture(ck_config(), train_config=cfg)
    assert zero.files(Tier.PULSE) == {}
    assert zero.files(Tier.FULL) == {TRAIN_CONFIG_FILE: encode_train_config(cfg)}
    other = _capture(ck_config(), rank=1, world_size=2, train_config=cfg)
    assert other.files(Tier.FULL) == {}
    assert _capture(ck_config()).files(Tier.FULL) == {}


def test_train_config_must_be_json(ck_config: ConfigFactory) -> None:
    with pytest.raises(TypeError, match="JSON-serializable"):
        _capture(ck_config(), train_config={"x": object()})
    with pytest.raises(TypeError, match="JSON-serializable"):
        encode_train_config({"nan": float("nan")})


def test_the_data_position_is_read_from_state_dict_or_a_callable(ck_config: ConfigFactory) -> None:
    assert _capture(ck_config()).data_state() is None
    assert _capture(ck_config(), dataloader_state=Position()).data_state() == {"pos": 3}
    assert _capture(ck_config(), dataloader_state=lambda: [1, 2]).data_state() == [1, 2]
    with pytest.raises(TypeError, match="dataloader_state must have"):
        _capture(ck_config(), dataloader_state=42).data_state()


def test_the_scheduler_state_travels_with_the_shared_state(ck_config: ConfigFactory) -> None:
    cap = _capture(ck_config())
    cap.engine.scheduler.observe(0, 1.0, None)
    s = cap.sections(lightweight=False, step=0)
    assert s["scheduler"] == cap.engine.scheduler.state_dict()
