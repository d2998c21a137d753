"""What the kill campaigns share (``bench_jit.py``, ``bench_memory_tier.py``): the
distributed tests' job and harness on ``sys.path``, the command line, the uninterrupted
reference run, the bitwise check of a stitched run and the table of steps lost.

Not a benchmark: imported by the campaigns (run as scripts, so this folder is on
``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "ckpt_agent" / "distributed"), str(ROOT / "e2e")]

import ckpt_dist_harness as h  # noqa: E402
import ckpt_dist_workers as w  # noqa: E402

__all__ = ["arguments", "h", "lost_table", "reference", "resumed", "stitched_exact", "w"]


def arguments(doc: str | None, trials: int) -> argparse.Namespace:
    """``--trials``, ``--seed``, ``--keep``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trials", type=int, default=trials)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the trials' folders")
    return p.parse_args()


def _finals(out: Path, world: int) -> list[Any]:
    return [json.loads((out / f"final.rank{r}.json").read_text()) for r in range(world)]


def reference(base: Path, world: int, steps: int) -> dict[str, Any]:
    """The uninterrupted run: every rank's losses and final parameters."""
    out = base / "ref" / "job"
    h.codes_ok(h.launch(w.train_ddp, world, out, steps, {"checkpoint": False}, timeout=150), out)
    return {"losses": [h.losses(out, r) for r in range(world)], "final": _finals(out, world)}


def resumed(out: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's record of its restart (``resume.rank<r>.json``)."""
    return [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(world)]


def stitched_exact(out: Path, codes: Sequence[int | None], ref: dict[str, Any]) -> bool:
    """The restarted run finished and its losses and final parameters are the reference's,
    bit for bit."""
    world = len(codes)
    return (
        all(c == 0 for c in codes)
        and [h.losses(out, r) for r in range(world)] == ref["losses"]
        and _finals(out, world) == ref["final"]
    )


def lost_table(rows: Sequence[dict[str, Any]], groups: Sequence[tuple[str, ...]],
               keys: Sequence[str]) -> list[str]:  # fmt: skip
    """The markdown table of steps lost: one line per group (the values of ``keys``)."""
    head = " | ".join(keys)
    lines = [
        f"| {head} | trials | steps lost: each | mean | max | resumed from | bitwise |",
        "|" + "---|" * len(keys) + "---:|---|---:|---:|---|---:|",
    ]
    for group in groups:
        sel = [r for r in rows if tuple(r[k] for k in keys) == group]
        if not sel:
            continue
        lost = [r["lost"] for r in sel]
        actions = sorted({r["action"] for r in sel})
        lines.append(
            f"| {' | '.join(group)} | {len(sel)} | {', '.join(map(str, lost))} | "
            f"{statistics.fmean(lost):.1f} | {max(lost)} | {', '.join(actions)} | "
            f"{sum(r['exact'] for r in sel)}/{len(sel)} |"
        )
    return lines
