#!/usr/bin/env python
"""Steps lost when a node is lost: the memory tier against pulses alone (#31; not a test).

A real 2-rank gloo DDP job (the distributed tests' program: an MLP with dropout, AdamW,
StepLR, a data position; each step sleeps 0.1 s for the compute of a real model), one rank
per node; a node is a shared-memory directory with its
sidecar (a thread of its rank's process) pushing every snapshot to the other node. A pulse
every 10 steps. Per trial, once rank 0 reached a random step and a random part of a step's
time went by, every process is SIGKILLed and node n1 is lost with its memory; the job
restarts with n1's rank on a new node n2, which asks n0 for its replica, and runs to the
end. Each trial runs twice on the same instant: with the memory tier (a memory-only
snapshot every 2 steps) and without (pulses only, replicated the same way). Per trial: the
steps lost (steps every rank had finished before the kill that the restart runs again),
the resume action, and whether the stitched losses and final weights equal the
uninterrupted run's, bit for bit.

    python benchmarks/bench_memory_tier.py --trials 6 --seed 1 2>/dev/null
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from _kill_campaign import arguments, h, lost_table, reference, resumed, stitched_exact, w

from ckpt_e2e.api import free_port

WORLD, STEPS, EVERY = 2, 30, 2
COMPUTE_S = 0.1
"""Each step's stand-in for an accelerator's compute (the MLP itself takes ~1 ms): the
replication of a snapshot has a step's time to finish, as in a real job."""
PULSES = {"heartbeat": {"everySteps": 1000}, **{k: v for k, v in w.tiers(10, 10, 10).items()
                                                if k != "heartbeat"}}  # fmt: skip
MODES = {
    f"memory tier (every {EVERY})": {"tiers": {**PULSES, "memory": {"enabled": True,
                                                                     "everySteps": EVERY}}},
    "pulses only": {"tiers": PULSES},
}  # fmt: skip


def _trial(root: Path, config: dict[str, Any], step: int, frac: float,
           ref: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    out = root / "job"
    out.mkdir(parents=True)
    ports = {n: free_port() for n in ("n0", "n1", "n2")}
    opts: dict[str, Any] = {"config": config, "compute_s": COMPUTE_S}

    def lose_n1(job: h.Job) -> None:
        deadline = time.monotonic() + 120
        while job.running() and time.monotonic() < deadline:
            if len(h.losses(out, 0)) >= step:
                time.sleep(frac * COMPUTE_S)
                break
            time.sleep(0.002)
        for rank in range(WORLD):
            job.kill(rank)

    t0 = time.monotonic()
    first = {**opts, "replicated": {"nodes": ["n0", "n1"], "ports": ports}}
    h.launch(w.train_ddp, WORLD, out, STEPS, first, timeout=150, during=lose_n1)
    done = min(len(h.losses(out, r)) for r in range(WORLD))
    shutil.rmtree(root / "shm.n1", ignore_errors=True)
    again = {**opts, "replicated": {"nodes": ["n0", "n2"], "ports": ports}}
    ok = h.launch(w.train_ddp, WORLD, out, STEPS, again, timeout=150)
    seconds = time.monotonic() - t0
    first = resumed(out, WORLD)[0]
    return {
        "finished_before": done,
        "resume_step": first["step"],
        "lost": done - first["step"],
        "action": first["action"],
        "exact": stitched_exact(out, ok, ref),
        "seconds": round(seconds, 1),
    }


def main() -> int:
    args = arguments(__doc__, 6)
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="bench-memory-tier-"))
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    ref = reference(base, WORLD, STEPS)
    rows: list[dict[str, Any]] = []
    for n in range(args.trials):
        step, frac = rng.randint(8, STEPS - 4), rng.random()
        for i, (mode, config) in enumerate(MODES.items()):
            got = _trial(base / f"t{n}-{i}", config, step, frac, ref)
            rows.append({"trial": n, "mode": mode, "step": step, **got})
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n# {WORLD}-rank gloo DDP, a node per rank, {STEPS} steps of {COMPUTE_S} s, "
        "pulse every 10, "
        f"seed {args.seed}, load {load:.1f} before / {os.getloadavg()[0]:.1f} after, "
        f"{time.monotonic() - t0:.0f} s\n"
    )
    print("\n".join(lost_table(rows, [(m,) for m in MODES], ("mode",))))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
