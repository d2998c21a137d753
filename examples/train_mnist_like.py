#!/usr/bin/env python
"""A small, real PyTorch training run that checkpoints with ckpt-operator's agent.

Everything the checkpointing needs comes from the environment the operator
injects (``CKPT_STORAGE_URL``, ``CKPT_RUN_ID``, ``CKPT_RESUME_FROM``,
``CKPT_SIGNAL_FILE``, ``CKPT_CONFIG``...); the script only calls
``Checkpointer(...).start()``, ``.step()`` and ``.close()``.

The run is deliberately sensitive to every piece of state: synthetic
"MNIST-like" data (generated in the script from ``--seed``) reshuffled each
epoch with a seed drawn from the global torch RNG, dropout, AdamW, a warm-up +
step LR schedule, a GradScaler whose scale changes, and gradient clipping. A
resume that missed any of them would change the loss trajectory.

    CKPT_STORAGE_URL=/tmp/ckpt CKPT_RUN_ID=demo python examples/train_mnist_like.py \
        --steps 200 --out /tmp/run.json

``--out`` receives the final parameters' SHA-256, the loss of every step this
process ran (as float.hex, exact) and the resume point; ``--loss-log`` gets one
JSON line per step as it happens (survives a SIGKILL).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ckpt_agent import Checkpointer

FEATURES = 64
CLASSES = 10


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic 'digits': class templates plus noise, from a private generator."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(CLASSES, FEATURES, generator=g)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    x = templates[labels] + 0.8 * torch.randn(n, FEATURES, generator=g)
    return x, labels


class ShuffledBatches:
    """Epoch-wise shuffled mini-batches; the data position is (epoch, offset, epoch seed).

    Each epoch's order comes from a seed drawn from the *global* torch RNG (as
    ``RandomSampler`` does), so an exact resume needs the RNG state too.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size
        self.epoch = -1
        self.pos = 0
        self.epoch_seed = 0
        self._perm: torch.Tensor | None = None

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.pos = 0
        self.epoch_seed = int(torch.randint(0, 2**62, (1,)).item())
        self._perm = None

    def _permutation(self) -> torch.Tensor:
        if self._perm is None:
            g = torch.Generator().manual_seed(self.epoch_seed)
            self._perm = torch.randperm(len(self.x), generator=g)
        return self._perm

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.epoch < 0 or self.pos + self.batch_size > len(self.x):
            self._new_epoch()
        idx = self._permutation()[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "epoch_seed": self.epoch_seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self.epoch_seed = int(state["epoch_seed"])
        self._perm = None


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, hidden),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(hidden, CLASSES),
    )


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps of the run")
    p.add_argument("--seed", type=int, default=0, help="seed for data, init and all RNGs")
    p.add_argument("--out", type=Path, help="write final params hash + loss trajectory JSON here")
    p.add_argument("--loss-log", type=Path, help="append one JSON line per step (flushed)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)"
    )
    p.add_argument("--no-checkpoint", action="store_true", help="train without the agent")
    p.add_argument(
        "--on-persist-error",
        choices=("auto", "raise", "warn"),
        default="auto",
        help="a failed background save: auto (default: log storage outages and retry, raise"
        " permanent failures and outages past 10 min), raise (always) or warn (never)",
    )
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    x, y = make_data(args.seed + 1, args.samples)
    data = ShuffledBatches(x, y, args.batch_size)
    model = build_model(args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = 10
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
            torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.7),
        ],
        milestones=[warmup],
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=7)
    loss_fn = nn.CrossEntropyLoss()

    ckpt: Checkpointer | None = None
    start_step = 0
    resume_info: dict[str, Any] = {}
    if not args.no_checkpoint:
        ckpt = Checkpointer(
            model=model,
            optimizer=opt,
            lr_scheduler=sched,
            grad_scaler=scaler,
            dataloader_state=data,
            train_config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            handle_sigterm=True,
            on_persist_error=args.on_persist_error,
        )
        resume = ckpt.start()
        start_step = resume.step
        resume_info = {
            "step": resume.step,
            "checkpoint_id": resume.checkpoint_id,
            "action": resume.action,
            "exact": resume.exact,
            "rejected": [list(r) for r in resume.rejected],
        }
        print(f"start: {resume.action} -> step {resume.step} ({resume.reason})", file=sys.stderr)

    log_f = open(args.loss_log, "a", encoding="utf-8") if args.loss_log else None  # noqa: SIM115
    losses: dict[int, str] = {}
    model.train()
    try:
        for step in range(start_step, args.steps):
            xb, yb = data.next_batch()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            scaler.step(opt)
            scaler.update()
            sched.step()
            value = float(loss.item())
            losses[step] = value.hex()
            if log_f is not None:
                log_f.write(json.dumps({"step": step, "loss": value.hex()}) + "\n")
                log_f.flush()
            if ckpt is not None:
                ckpt.step(step, value, grad_norm)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    finally:
        if log_f is not None:
            log_f.close()
    summary: dict[str, Any] = {}
    if ckpt is not None:
        ckpt.close()
        summary = ckpt.summary()
    result = {
        "final_params_sha256": params_sha256(model),
        "losses": losses,
        "first_step": start_step,
        "steps": args.steps,
        "resume": resume_info,
        "checkpointing": summary,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    print(
        f"done: params {result['final_params_sha256'][:16]} after step {args.steps - 1}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
