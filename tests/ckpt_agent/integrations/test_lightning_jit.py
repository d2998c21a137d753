"""Just-in-time saves under a real Lightning fit (#31): ``training_step`` raises in step 13
(a peer's all-reduce failing, say); Lightning hands the exception to the callback's
``on_exception``, which saves step 12 to shared memory; the next fit resumes at step 13
and ends with the weights and optimizer state of the uninterrupted fit, bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_agent.policy import AgentConfig
from ckpt_agent.storage.fs import LocalStorage
from ckpt_e2e.local_flash import same_state, sidecar_thread

pl = pytest.importorskip("lightning.pytorch")

pytestmark = [
    pytest.mark.timeout(240),
    # Lightning's own warnings (its pytree use, the loader's workers), not the agent's
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:lightning"),
]

RUN, STEPS, FAIL_AT = "pl-jit", 20, 13


class FailedError(RuntimeError):
    pass


def _config(root: Path) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "runId": RUN,
            "storageUrl": (root / "store").as_uri(),
            "shmDir": str(root / "shm"),
            "workDir": str(root / "work"),
            "agent": {"sidecar": True, "jitSave": True},
            "tiers": {
                "heartbeat": {"everySteps": 1000},
                "pulse": {"baseInterval": 5, "minInterval": 5, "maxInterval": 5},
                "full": {"everySteps": 1000},
            },
            "scheduler": {"risk": {"enabled": False}},
            "validation": {"loadInSubprocess": False},
        }
    )


def _fit(root: Path, fail_at: int = -1) -> dict[str, Any]:
    """One fit (an MLP with dropout, AdamW, a per-step LR schedule, a resumable sampler);
    the final state, or raises FailedError from ``training_step`` at step ``fail_at``."""
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt_agent.integrations.lightning import CheckpointCallback, ResumableSampler

    pl.seed_everything(0, verbose=False)

    class MLP(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                torch.nn.Linear(32, 1),
            )  # fmt: skip

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if self.trainer.global_step == fail_at:
                raise FailedError(f"step {fail_at}: the all-reduce failed")
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    model = MLP()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g)
    ds = TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = DataLoader(ds, batch_size=4, sampler=ResumableSampler(ds, seed=3))
    callbacks = [CheckpointCallback(_config(root), storage=LocalStorage(root / "store"))]
    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, loader)
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": trainer.optimizers[0].state_dict(),
        "global_step": trainer.global_step,
    }


def test_a_failed_lightning_step_costs_only_that_step(tmp_path: Path) -> None:
    with sidecar_thread(
        _config(tmp_path / "ref")
    ):  # the same fit, uninterrupted, with the callback too
        want = _fit(tmp_path / "ref")
    tmp_path = tmp_path / "failed"
    with sidecar_thread(_config(tmp_path)):
        with pytest.raises(FailedError):
            _fit(tmp_path, fail_at=FAIL_AT)
        got = _fit(tmp_path)
    assert got["global_step"] == want["global_step"] == STEPS
    assert same_state(got, want)
    lines = (tmp_path / "work" / "decisions.rank0.jsonl").read_text().splitlines()
    events = list(map(json.loads, lines))
    (saved,) = [e for e in events if e["event"] == "jit_save"]
    assert (saved["outcome"], saved["step"]) == ("saved", FAIL_AT - 1), saved
    (start,) = [e for e in events if e["event"] == "start" and e.get("checkpoint")]
    assert (start["action"], start["next_step"]) == ("resume_shm", FAIL_AT), start
