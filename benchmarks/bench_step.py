#!/usr/bin/env python
"""What ``Checkpointer.step()`` costs the training thread on steps without a save (not a timed test).

A plain loop (a small MLP, forward + backward + AdamW, ``--threads`` torch
threads) calls ``Checkpointer.step()`` after every optimizer step; the pulse
and full tiers are never due, so each call only observes, decides and — with
the heartbeat on — captures the heartbeat. Timed around ``step()`` alone, in a
fresh process per configuration, rounds interleaved:

* ``heartbeat every step`` — the default policy's L0 tier (due at every step);
* ``heartbeat every 10`` — nine steps in ten have nothing due at all;
* ``heartbeat off``;
* ``flash, heartbeat every step`` — snapshots into shared memory (a local persister);
* ``flash + JIT, heartbeat every step`` — the same with ``agent.jitSave``: every step's
  heartbeat also written into the shared-memory area (docs/replicas.md).

It prints the median and p99 of the call, the median with and without a
heartbeat due, the heartbeat objects written (commits: one fsync each) per
second, the bytes of the newest one, and the Python memory the training thread
allocates per step with nothing due (``tracemalloc``, net of what it frees).

    python benchmarks/bench_step.py --steps 2000 --repeat 3

``--baseline DIR`` measures another checkout beside this one, in the same rounds (A/B on a
shared machine): its children import ``ckpt_agent`` from ``DIR/agent``, e.g. after
``git worktree add /tmp/base <commit>`` (rows marked ``(baseline)``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch
from _common import agent_config, machine, median
from torch import nn

from ckpt_agent.format.layout import heartbeat_key
from ckpt_agent.runtime.checkpointer import Checkpointer

NEVER = 10**9

CONFIGS: dict[str, dict[str, Any]] = {
    "heartbeat every step": {"enabled": True, "everySteps": 1},
    "heartbeat every 10": {"enabled": True, "everySteps": 10},
    "heartbeat off": {"enabled": False},
    "flash, heartbeat every step": {"enabled": True, "everySteps": 1},
    "flash + JIT, heartbeat every step": {"enabled": True, "everySteps": 1},
}
FLASH = {"flash, heartbeat every step": False, "flash + JIT, heartbeat every step": True}
"""The configurations with shared-memory snapshots, and whether JIT saves are on."""


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * 0.99))] if s else float("nan")


def child(name: str, steps: int, threads: int, hidden: int) -> dict[str, Any]:
    """One configuration in this (fresh) process: times every ``step()`` call."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="bench-step-"))
    flash: dict[str, Any] = {}
    if name in FLASH:
        flash = {"shmDir": str(root / "shm"), "agent": {"jitSave": FLASH[name]}}
    cfg = agent_config(
        root,
        "bench-step",
        NEVER,
        **flash,
        tiers={
            "heartbeat": CONFIGS[name],
            "pulse": {"baseInterval": NEVER, "minInterval": NEVER, "maxInterval": NEVER},
            "full": {"everySteps": NEVER},
        },
    )
    model = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, hidden)
    pos = {"epoch": 0, "pos": 0}
    ckpt = Checkpointer(cfg, model=model, optimizer=opt, dataloader_state=lambda: dict(pos))
    ckpt.start()
    times: list[float] = []
    due: list[bool] = []
    warmup = min(100, steps // 10)
    alloc: list[int] = []
    t_run = time.perf_counter()
    for step in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        pos["pos"] = step
        measure_alloc = step >= warmup and step % 50 == 7
        if measure_alloc:
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        decision = ckpt.step(step, value)
        dt = time.perf_counter() - t0
        if measure_alloc:
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            if not decision.save:
                alloc.append(after - before)
        if step >= warmup:
            times.append(dt)
            due.append(bool(decision.save))
    run_s = time.perf_counter() - t_run
    writer = ckpt._heartbeats.writer if ckpt._heartbeats is not None else None
    written = writer.written if writer is not None else 0
    ckpt.close()
    hb = root / "store" / heartbeat_key("bench-step", 0)
    with_due = [t for t, d in zip(times, due, strict=True) if d]
    without = [t for t, d in zip(times, due, strict=True) if not d]
    return {
        "median_ms": statistics.median(times) * 1e3,
        "p99_ms": p99(times) * 1e3,
        "due_median_ms": median(with_due) * 1e3,
        "idle_median_ms": median(without) * 1e3,
        "idle_p99_ms": p99(without) * 1e3,
        "commits_per_s": written / run_s,
        "heartbeat_bytes": hb.stat().st_size if hb.exists() else 0,
        "idle_alloc_bytes": median([float(a) for a in alloc]) if alloc else float("nan"),
        "steps_per_s": steps / run_s,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--only", action="append", choices=list(CONFIGS), help="run only these")
    p.add_argument(
        "--baseline", type=Path, help="another checkout measured in the same rounds (A/B)"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.threads, args.hidden)))
        return 0
    trees: list[tuple[str, Path | None]] = [("", None)]
    if args.baseline is not None:
        if not (args.baseline / "agent" / "ckpt_agent").is_dir():
            p.error(f"--baseline {args.baseline}: no agent/ckpt_agent there (a checkout?)")
        trees.insert(0, (" (baseline)", args.baseline / "agent"))
    names = [n + label for n in args.only or list(CONFIGS) for label, _ in trees]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeat):  # rounds interleaved: drift in the machine's load hits all
        for name in args.only or list(CONFIGS):
            for label, path in trees:
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                if path is not None:
                    env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
                cmd = [sys.executable, __file__, "--child", name, "--steps", str(args.steps)]
                cmd += ["--threads", str(args.threads), "--hidden", str(args.hidden)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                runs[name + label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"# {machine()}, load {load_before:.1f} before / {os.getloadavg()[0]:.1f} after, "
        f"{args.steps} steps, {args.threads} torch thread(s), median of {args.repeat} runs"
    )
    cols = [
        ("median_ms", "step() median ms", ".3f"),
        ("p99_ms", "p99 ms", ".3f"),
        ("due_median_ms", "heartbeat due: median ms", ".3f"),
        ("idle_median_ms", "nothing due: median ms", ".3f"),
        ("idle_alloc_bytes", "nothing due: bytes allocated", ".0f"),
        ("commits_per_s", "heartbeat commits/s", ".1f"),
        ("heartbeat_bytes", "heartbeat object bytes", ".0f"),
        ("steps_per_s", "steps/s", ".0f"),
    ]
    print("| configuration | " + " | ".join(c[1] for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name in names:
        vals = []
        for key, _, fmt in cols:
            xs = [r[key] for r in runs[name] if r[key] == r[key]]  # NaN-free
            vals.append(format(statistics.median(xs), fmt) if xs else "–")
        print(f"| {name} | " + " | ".join(vals) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
