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

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "ckpt_agent" / "distributed"), str(ROOT / "e2e")]

import ckpt_dist_harness as h  # noqa: E402
import ckpt_dist_workers as w  # noqa: E402

WORLD, STEPS = 4, 24
PULSE = w.tiers(5, 5, 5)
FLASH = {"shm": True, "backpressure": "wait", "config": {"tiers": PULSE}}
JIT = {**FLASH, "config": {"tiers": PULSE, "agent": {"jitSave": True}}}


def _finals(out: Path) -> list[Any]:
    return [json.loads((out / f"final.rank{r}.json").read_text()) for r in range(WORLD)]


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
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(WORLD)]
    exact = (
        all(c == 0 for c in ok)
        and [h.losses(out, r) for r in range(WORLD)] == ref["losses"]
        and _finals(out) == ref["final"]
    )
    return {
        "victim_code": codes[victim],
        "finished_before": done,
        "resume_step": resumed[0]["step"],
        "lost": done - resumed[0]["step"],
        "action": resumed[0]["action"],
        "exact": exact,
        "seconds": seconds,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the trials' folders")
    args = p.parse_args()
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="bench-jit-"))
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    ref_out = base / "ref" / "job"
    h.codes_ok(h.launch(w.train_ddp, WORLD, ref_out, STEPS, {"checkpoint": False}, timeout=150),
               ref_out)  # fmt: skip
    ref = {"losses": [h.losses(ref_out, r) for r in range(WORLD)], "final": _finals(ref_out)}
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
    print("| kill | mode | trials | steps lost: each | mean | max | resumed from | bitwise |")
    print("|---|---|---:|---|---:|---:|---|---:|")
    for kind in ("mid-step", "any instant"):
        for mode in ("JIT", "no JIT"):
            sel = [r for r in rows if r["kind"] == kind and r["mode"] == mode]
            if not sel:
                continue
            lost = [r["lost"] for r in sel]
            actions = sorted({r["action"] for r in sel})
            print(
                f"| {kind} | {mode} | {len(sel)} | {', '.join(map(str, lost))} | "
                f"{statistics.fmean(lost):.1f} | {max(lost)} | {', '.join(actions)} | "
                f"{sum(r['exact'] for r in sel)}/{len(sel)} |"
            )
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
