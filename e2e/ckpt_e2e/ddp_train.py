"""A small gloo DDP training program for multi-pod e2e scenarios (run as a script).

It takes the environment the training-operator gives a PyTorchJob's pods (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``WORLD_SIZE`` 1 or unset: one process,
no process group) and checkpoints only through ``ckpt_agent``'s Checkpointer and the
environment the webhook injects (flash mode, the memory tier: whatever the policy says).

Deterministic, so a resumed run can be compared bit for bit with an uninterrupted one: an
MLP with dropout (each rank its own dropout stream: RNG state that must be restored),
AdamW, a StepLR schedule and a data position (each step's batch derived from the step and
the rank). Outputs: ``--loss-log`` (one JSON line ``{"step", "loss"}`` per step,
appended: a restart continues it) and ``--out`` (the final parameters' SHA-256, the
losses of this process, the first step it ran and its resume point); ``{rank}`` in either
path is replaced by the process's global rank.

``--nproc-per-node N`` (N > 1) runs N local ranks per pod, as ``torchrun
--nproc_per_node=N`` (the training-operator's ``nprocPerNode``) would: this process only
starts N children of itself with ``RANK = N·RANK + i``, ``LOCAL_RANK = i``,
``LOCAL_WORLD_SIZE = N`` and ``WORLD_SIZE = N·WORLD_SIZE``, forwards SIGTERM to them and
exits with the first failure among them (0 when all succeed). DDP uses
``find_unused_parameters=True``: no bucket rebuild, so a resume is bitwise with three or
more gloo ranks too (docs/distributed.md, "Bitwise with more than two ranks").

Standard library, torch and ckpt_agent only: the pod runs it as a file
(``/opt/ckpt-e2e/ddp_train.py``, this folder mounted by ``hostPath``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as nnf


class Position:
    """The data position: the next step's batch index."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.pos = int(d["pos"])


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def spawn_local_ranks(nproc: int, argv: list[str]) -> int:
    """Run ``nproc`` local ranks of this pod (module doc); their first failure, else 0."""
    world = int(os.environ.get("WORLD_SIZE") or 1)
    node_rank = int(os.environ.get("RANK") or 0)
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *argv],
            env={
                **os.environ,
                "RANK": str(node_rank * nproc + i),
                "LOCAL_RANK": str(i),
                "LOCAL_WORLD_SIZE": str(nproc),
                "WORLD_SIZE": str(world * nproc),
            },
        )
        for i in range(nproc)
    ]

    def forward(signum: int, _frame: Any) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    codes = [proc.wait() for proc in procs]
    failed = [c for c in codes if c != 0]
    return (128 - failed[0] if failed[0] < 0 else failed[0]) if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc-per-node", type=int, default=1, help="local ranks per pod")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (pacing)")
    p.add_argument("--out", type=Path)
    p.add_argument("--loss-log", type=Path)
    p.add_argument("--no-checkpoint", action="store_true")
    raw = sys.argv[1:] if argv is None else argv
    args = p.parse_args(raw)
    if args.nproc_per_node > 1:
        rest, it = [], iter(raw)
        for a in it:
            if a == "--nproc-per-node":
                next(it)
            elif not a.startswith("--nproc-per-node="):
                rest.append(a)
        return spawn_local_ranks(args.nproc_per_node, rest)

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE") or 1)
    rank = int(os.environ.get("RANK") or 0)
    for name in ("out", "loss_log"):
        path = getattr(args, name)
        if path is not None:
            setattr(args, name, Path(str(path).replace("{rank}", str(rank))))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    net: nn.Module = model
    if world > 1:
        net = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)
    torch.manual_seed(args.seed * 1000 + 1000 + rank)  # each rank its own dropout stream
    pos = Position()

    ckpt: Any = None
    start = 0
    resume_info: dict[str, Any] = {}
    if not args.no_checkpoint:
        from ckpt_agent.runtime.checkpointer import Checkpointer

        ckpt = Checkpointer(
            model=model,
            optimizer=opt,
            lr_scheduler=sched,
            dataloader_state=pos,
            handle_sigterm=True,
        )
        resume = ckpt.start()
        start = resume.step
        resume_info = {
            "step": resume.step,
            "checkpoint_id": resume.checkpoint_id,
            "action": resume.action,
            "exact": resume.exact,
        }
        print(f"start: {resume.action} -> step {resume.step} ({resume.reason})", file=sys.stderr)
        assert pos.pos == start, (pos.pos, start)

    losses: dict[int, str] = {}
    log = open(args.loss_log, "a", encoding="utf-8") if args.loss_log else None  # noqa: SIM115
    try:
        for step in range(start, args.steps):
            g = torch.Generator().manual_seed(args.seed * 100_000 + step * 100 + rank)
            x = torch.randn(8, 16, generator=g)
            y = torch.randn(8, 4, generator=g)
            loss = nnf.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            pos.pos = step + 1
            value = float(loss.item())
            losses[step] = value.hex()
            if log is not None:
                log.write(json.dumps({"step": step, "loss": value.hex()}) + "\n")
                log.flush()
            if ckpt is not None:
                ckpt.step(step, value)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    finally:
        if log is not None:
            log.close()
    if ckpt is not None:
        ckpt.close()
    result = {
        "final_params_sha256": params_sha256(model),
        "losses": losses,
        "first_step": start,
        "steps": args.steps,
        "rank": rank,
        "world_size": world,
        "resume": resume_info,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    if world > 1:
        dist.destroy_process_group()
    print(f"done: rank {rank} params {result['final_params_sha256'][:16]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
