"""Training scripts the integration tests fork from the zygote (one function per scenario).

Each reads the agent config from ``CKPT_CONFIG`` (as in a pod), appends every finished
step to ``<out>/progress.rank<r>`` and, on rank 0 at the end, writes the final weights
and optimizer state to ``<out>/final.pt``. ``COMMIT_DELAY_S`` holds every COMMIT that
long (a SIGKILL then lands during a save); ``<out>/commits`` lists the COMMITs written.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions


class MarkedStorage(LocalStorage):
    """Local storage that marks (and optionally delays) every checkpoint's COMMIT."""

    def __init__(self, root: str, out: Path) -> None:
        super().__init__(root, StorageOptions(fsync=False))
        self.out = out
        self.delay = float(os.environ.get("COMMIT_DELAY_S", "0"))

    def commit(self, key: str, data: bytes) -> None:
        self._publish(key, lambda: super(MarkedStorage, self).commit(key, data))

    def create_exclusive(self, key: str, data: bytes) -> bool:  # a fenced writer's COMMIT
        won: list[bool] = []
        self._publish(
            key, lambda: won.append(super(MarkedStorage, self).create_exclusive(key, data))
        )
        return won[0]

    def _publish(self, key: str, publish: Any) -> None:
        if not key.endswith("/COMMIT"):
            publish()
            return
        (self.out / "committing").write_text(key)
        if self.delay:
            time.sleep(self.delay)
        publish()
        with (self.out / "commits").open("a") as f:
            f.write(key + "\n")


def _storage(out: Path) -> MarkedStorage:
    url = os.environ["STORE_DIR"]
    return MarkedStorage(url, out)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _progress(out: Path, step: int, note: str = "") -> None:
    with (out / f"progress.rank{_rank()}").open("a") as f:
        f.write(f"{step} {note}\n")
    if note:
        with (out / f"trace.rank{_rank()}").open("a") as f:
            f.write(f"{step} {note}\n")


def _final(out: Path, model: torch.nn.Module, optimizer: Any, extra: dict[str, Any]) -> None:
    if _rank() != 0:
        return
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}
    tmp = out / "final.pt.tmp"
    torch.save(state, tmp)
    tmp.rename(out / "final.pt")


# ---------------------------------------------------------------- Hugging Face Trainer


def _hf_setup(out: Path, steps: int, world: int) -> tuple[Any, Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    ds = []
    for _ in range(40):
        ids = torch.randint(0, 64, (16,), generator=g)
        ds.append({"input_ids": ids, "labels": ids.clone()})
    args = TrainingArguments(
        output_dir=str(out / "hf"),
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=3,
        logging_steps=7,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=42,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_backend="gloo" if world > 1 else None,
    )
    return model, args, ds


def hf_train(out_dir: str, steps: int, world: int) -> None:
    """The three-line integration on a stock Trainer (tiny random GPT-2, 2 epochs+)."""
    from transformers import Trainer, TrainerCallback

    from ckpt_agent.integrations.transformers import CheckpointCallback

    out = Path(out_dir)
    model, args, ds = _hf_setup(out, steps, world)

    kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
    seen: list[str] = []

    def log_batch(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if module.training:
            ids = kwargs["input_ids"][:, 0].tolist()
            seen.append(f"{ids}:{float(output.loss).hex()}")

    model.register_forward_hook(log_batch, with_kwargs=True)

    class Progress(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _progress(out, state.global_step, " ".join(seen))
            seen.clear()
            if state.global_step == kill_at:
                os._exit(9)

    ckpt = CheckpointCallback(storage=_storage(out))
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt, Progress()])
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))
    _final(
        out,
        model,
        trainer.optimizer,
        {"global_step": trainer.state.global_step, "epoch": trainer.state.epoch},
    )


def hf_naive(out_dir: str, steps: int, world: int) -> None:
    """The README used as a callback: a Checkpointer built in a callback, step() from on_log."""
    from transformers import Trainer, TrainerCallback

    from ckpt_agent import Checkpointer

    out = Path(out_dir)
    model, args, ds = _hf_setup(out, steps, world)
    storage = _storage(out)

    class Naive(TrainerCallback):  # type: ignore[misc]
        ckpt: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ckpt = Checkpointer(model=kw["model"], optimizer=kw["optimizer"], storage=storage)
            self.ckpt.start()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.ckpt.step(state.global_step, logs["loss"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _progress(out, state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ckpt.close()

    args.logging_steps = 1
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Naive()])
    trainer.train()
    _final(out, model, trainer.optimizer, {"global_step": trainer.state.global_step})


# ---------------------------------------------------------------- Lightning


def pl_train(out_dir: str, steps: int, world: int) -> None:
    """The three-line integration on a Lightning fit (an MLP with dropout, 3 epochs)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt_agent.integrations.lightning import CheckpointCallback, ResumableSampler

    out = Path(out_dir)
    pl.seed_everything(0, verbose=False)

    class MLP(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32),
                torch.nn.ReLU(),
                torch.nn.Dropout(0.2),
                torch.nn.Linear(32, 1),
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    model = MLP()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g)
    ds = TensorDataset(x, x.sum(dim=1, keepdim=True))

    kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))

    class Progress(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int
        ) -> None:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            note = f"{float(batch[0][0, 0]).hex()}:{float(outputs['loss']).hex()}:{lr}"
            _progress(out, trainer.global_step, note)
            if trainer.global_step == kill_at:
                os._exit(9)

    loader = DataLoader(
        ds, batch_size=int(os.environ.get("PL_BATCH", "4")), sampler=ResumableSampler(ds, seed=3)
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        callbacks=[CheckpointCallback(storage=_storage(out)), Progress()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader)
    _final(
        out,
        model,
        trainer.optimizers[0],
        {"global_step": trainer.global_step, "epoch": trainer.current_epoch},
    )
