#!/usr/bin/env python
"""A stock Hugging Face ``Trainer`` run checkpointed by ckpt-operator's agent: three lines.

    from ckpt_agent.integrations.transformers import CheckpointCallback

    ckpt = CheckpointCallback()                                       # 1
    trainer = Trainer(..., callbacks=[ckpt])                          # 2
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))        # 3

Everything else is an ordinary ``Trainer`` script: HF builds its optimizer and LR
scheduler, ``save_strategy="no"`` (the agent checkpoints), and the configuration comes
from the environment the operator injects (``CKPT_STORAGE_URL``, ``CKPT_RUN_ID``,
``CKPT_RESUME_FROM``, ``CKPT_CONFIG``...). Killed (SIGKILL, OOM, a lost node) and
restarted — by the operator, or by hand with the same command — it continues from the
newest valid checkpoint and ends bit for bit where an uninterrupted run ends.

The model is a tiny GPT-2 built from a config (random init, no download) trained on
generated token sequences, with what makes a resume hard to get exactly right: dropout,
AdamW, warm-up + linear decay, gradient accumulation, data reshuffled every epoch.

    CKPT_STORAGE_URL=/tmp/ckpts CKPT_RUN_ID=hf-demo python examples/train_hf_trainer.py \
        --steps 16 --out /tmp/hf.json

``--out`` receives the digest of the final state (SHA-256 of every tensor of the weights
and of the optimizer state, the optimizer's parameter groups, the step) and where this
process resumed from; ``--loss-log`` gets one JSON line per step as it happens (the loss
as ``float.hex``, exact; it survives a SIGKILL). ``--no-checkpoint`` trains without the
agent: the uninterrupted run a resumed one is compared with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from ckpt_agent.integrations.transformers import CheckpointCallback

VOCAB = 64
SEQ_LEN = 16


def tiny_gpt2(seed: int) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with random weights (from ``seed``); dropout stays on (0.1)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def synthetic_dataset(seed: int, samples: int) -> list[dict[str, torch.Tensor]]:
    """Random token sequences (from a private generator), labels = inputs (causal LM)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(samples):
        ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def tensor_digests(prefix: str, obj: Any) -> dict[str, str]:
    """SHA-256 of every tensor in a (nested) state dict: dtype, shape and raw bytes.

    Two states with equal digests are ``torch.equal`` tensor by tensor (bit for bit);
    a differing entry names the tensor."""
    out: dict[str, str] = {}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[prefix] = h.hexdigest()
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            out |= tensor_digests(f"{prefix}.{k}", obj[k])
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out |= tensor_digests(f"{prefix}.{i}", v)
    return out


def final_state(trainer: Trainer) -> dict[str, Any]:
    """What an exact resume must reproduce: weights, optimizer state, its groups, step."""
    optimizer = trainer.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps HF's optimizer
    opt_state = inner.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt_state["param_groups"]]
    return {
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        "weights": tensor_digests("model", trainer.model.state_dict()),
        "optimizer": tensor_digests("optimizer", opt_state["state"]),
        "param_groups": json.loads(json.dumps(groups, default=str)),
    }


class LossLog(TrainerCallback):  # type: ignore[misc]
    """One JSON line per optimizer step (index of the step, loss as float.hex); paces the
    run with ``step_sleep`` (demos and tests: it does not change the numbers)."""

    def __init__(self, path: Path | None, step_sleep: float) -> None:
        self.path, self.step_sleep = path, step_sleep
        self.losses: dict[int, str] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            step = state.global_step - 1  # HF counts finished steps
            self.losses[step] = float(logs["loss"]).hex()
            if self.path is not None and state.is_world_process_zero:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": step, "loss": self.losses[step]}) + "\n")
        if self.step_sleep:
            time.sleep(self.step_sleep)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=16, help="total optimizer steps of the run")
    p.add_argument("--seed", type=int, default=42, help="seed of the model, data and Trainer")
    p.add_argument("--samples", type=int, default=40, help="training sequences (5 steps/epoch)")
    p.add_argument("--out", type=Path, help="write the final state's digest (JSON) here")
    p.add_argument("--loss-log", type=Path, help="append one JSON line per step (flushed)")
    p.add_argument(
        "--output-dir",
        default="hf-trainer-output",
        help="the Trainer's output_dir (left empty with save_strategy='no')",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (pacing)")
    p.add_argument("--no-checkpoint", action="store_true", help="train without the agent")
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # a tiny model: one thread is fastest (and reproducible)
    model = tiny_gpt2(args.seed)
    train_ds = synthetic_dataset(args.seed + 1, args.samples)
    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        warmup_steps=3,
        lr_scheduler_type="linear",
        logging_steps=1,  # for the loss log only: the agent gets every step's loss anyway
        save_strategy="no",  # the agent checkpoints
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
    )
    log = LossLog(args.loss_log, args.step_sleep)

    # --- the integration: three lines -------------------------------------------------
    ckpt = None if args.no_checkpoint else CheckpointCallback()  # 1
    callbacks = [log] if ckpt is None else [ckpt, log]
    trainer = Trainer(model=model, args=targs, train_dataset=train_ds, callbacks=callbacks)  # 2
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer) if ckpt else None)  # 3
    # ------------------------------------------------------------------------------------

    resume = ckpt.resume_point if ckpt is not None else None
    result = final_state(trainer) | {
        "steps": args.steps,
        "losses": {str(k): v for k, v in sorted(log.losses.items())},
        "first_step": min(log.losses, default=args.steps),
        "resume": {}
        if resume is None
        else {
            "step": resume.step,
            "checkpoint_id": resume.checkpoint_id,
            "action": resume.action,
            "exact": resume.exact,
        },
    }
    if args.out and trainer.is_world_process_zero():
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, sort_keys=True))
        tmp.replace(args.out)
    weights = hashlib.sha256(json.dumps(result["weights"], sort_keys=True).encode()).hexdigest()
    print(f"done: step {trainer.state.global_step}, weights {weights[:16]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
