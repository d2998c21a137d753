#!/usr/bin/env python
"""Steps lost when one rank of a DDP job dies: with and without JIT saves (#31; not a test).

A real 4-rank gloo DDP job (the distributed tests' program: an MLP with dropout, AdamW,
StepLR, a data position; flash snapshots with a local persister per rank, a pulse every 5
steps) is started, and one rank — random, per trial — is SIGKILLed:

* ``mid-step``: in a random step, between its forward and its backward pass, while the
  other ranks wait for it in the step's all-reduce (the case JIT saves are for);
* ``any instant``: once it reached a random step, after a random part of a step's time
  (the kill may land in ``optimizer.step()``, in ``Checkpointer.step()``, anywhere).

Then the job restarts (every rank, in place) and runs to the end. Each trial runs twice,
with ``agent.jitSave`` on and off, on the same victim and instant. Per trial: the steps
lost (steps every rank had finished before the kill that the restart runs again; the
failed partial step is not counted), the resume action, and whether the stitched losses
and final weights equal the uninterrupted run's, bit for bit.

    python benchmarks/bench_jit.py --trials 8 --seed 1 2>/dev/null
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

WORLD, STEPS = 4, 24
PULSE = w.tiers(5, 5, 5)
FLASH = {"shm": True, "backpressure": "wait", "config": {"tiers": PULSE}}
JIT = {**FLASH, "config": {"tiers": PULSE, "agent": {"jitSave": True}}}


def _trial(root: Path, opts: dict[str, Any], victim: int, step: int, kind: str, frac: float,
           ref: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    out = root / "job"
    out.mkdir(parents=True)
    run = dict(opts)
    if kind == "mid-step":
        (out / f"stall.rank{victim}").touch()
        run["stall_at"] = step

    def kill(job: h.Job) -> None:
        deadline = time.monotonic() + 120
        while job.running() and time.monotonic() < deadline:
            if kind == "mid-step" and (out / f"stalled.rank{victim}").exists():
                time.sleep(0.3)  # the others wait in the all-reduce
                break
            if kind == "any instant" and len(h.losses(out, victim)) >= step:
                time.sleep(frac * 0.02)
                break
            time.sleep(0.002)
        job.kill(victim)

    t0 = time.monotonic()
    codes = h.launch(w.train_ddp, WORLD, out, STEPS, run, timeout=150, during=kill)
    done = min(len(h.losses(out, r)) for r in range(WORLD))
    ok = h.launch(w.train_ddp, WORLD, out, STEPS, opts, timeout=150)
    seconds = time.monotonic() - t0
    first = resumed(out, WORLD)[0]
    return {
        "victim_code": codes[victim],
        "finished_before": done,
        "resume_step": first["step"],
        "lost": done - first["step"],
        "action": first["action"],
        "exact": stitched_exact(out, ok, ref),
        "seconds": seconds,
    }


def main() -> int:
    args = arguments(__doc__, 6)
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="bench-jit-"))
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    ref = reference(base, WORLD, STEPS)
    rows: list[dict[str, Any]] = []
    for n in range(args.trials):
        kind = "mid-step" if n % 2 == 0 else "any instant"
        victim, step, frac = rng.randrange(WORLD), rng.randint(8, STEPS - 4), rng.random()
        for label, opts in (("JIT", JIT), ("no JIT", FLASH)):
            got = _trial(base / f"t{n}-{label.replace(' ', '')}", opts, victim, step, kind, frac,
                         ref)  # fmt: skip
            rows.append({"trial": n, "kind": kind, "mode": label, "victim": victim,
                         "step": step, **got})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n# {WORLD}-rank gloo DDP, {STEPS} steps, pulse every 5, seed {args.seed}, "
        f"load {load:.1f} before / {os.getloadavg()[0]:.1f} after, "
        f"{time.monotonic() - t0:.0f} s\n"
    )
    groups = [(k, m) for k in ("mid-step", "any instant") for m in ("JIT", "no JIT")]
    print("\n".join(lost_table(rows, groups, ("kind", "mode"))))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
