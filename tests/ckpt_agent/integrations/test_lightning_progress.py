"""The Lightning data position read at every heartbeat (#27): the fit loop's state, built
without ``asdict``'s deep copies, is exactly what ``fit_loop.state_dict()`` returns."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: N812
from lightning.pytorch.callbacks import Callback

from ckpt_agent.integrations.lightning import _FitProgress, _loop_state


class _Module(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], i: int) -> torch.Tensor:
        del i
        out: torch.Tensor = self.layer(batch[0]).square().mean()
        return out

    def validation_step(self, batch: list[torch.Tensor], i: int) -> None:
        del batch, i

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _Compare(Callback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.compared = 0

    def _check(self, trainer: Any) -> None:
        want = trainer.fit_loop.state_dict()
        assert _loop_state(trainer.fit_loop, {}) == want
        assert _FitProgress(trainer).state_dict() == want
        self.compared += 1

    def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
        self._check(trainer)

    def on_validation_end(self, trainer: Any, *rest: Any) -> None:
        self._check(trainer)

    def on_train_epoch_end(self, trainer: Any, *rest: Any) -> None:
        self._check(trainer)


def test_the_fit_loop_state_is_what_lightning_returns() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    cmp = _Compare()
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        val_check_interval=3,
        callbacks=[cmp],
    )
    trainer.fit(_Module(), loader, loader)
    assert cmp.compared >= 18 + 3
    assert _loop_state(trainer.fit_loop, {}) == trainer.fit_loop.state_dict()
