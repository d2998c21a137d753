"""Listing a run that holds garbage: ``ckpt ls``, the library listing and the operator's
bounded scan over thousands of empty step folders or unreadable COMMITs (issue #28).

    .venv/bin/python benchmarks/bench_listing.py                  # 50,000 entries each
    .venv/bin/python benchmarks/bench_listing.py --n 5000 --repeat 3
    .venv/bin/python benchmarks/bench_listing.py --root /tmp/bench-listing --keep

Builds (with plain os calls, a few seconds) a local store with two runs beside one real
checkpoint each: ``empty-run`` (``--n`` empty ``pulse_step_*`` folders) and
``garbage-run`` (``--n`` folders holding only a ``COMMIT`` that is not JSON). Rows, each
the median of ``--repeat`` runs in seconds:

  list_checkpoints   the library call every reader uses (``ckpt ls``, the agent, the
                     operator's recovery): the whole run, every COMMIT read
  scan (bounded)     :func:`~ckpt_agent.format.listing.scan_checkpoints` with the
                     operator's default bound on entries examined per pass
  ckpt ls            the command as a user runs it (subprocess, output to /dev/null)

Absolute numbers depend on the machine and its load (this one has 2 cores shared with
other work); the point is the ratio between rows and between the two kinds of garbage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ckpt_agent.format.layout import validation_key
from ckpt_agent.format.listing import ListingLimits, list_checkpoints, scan_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions

RUNS = ("empty-run", "garbage-run")
DEFAULT_MAX_ENTRIES = 100_000
"""The operator's default ``--retention-max-entries``."""


def build(root: Path, n: int) -> None:
    """Both runs: one real validated checkpoint at step 10**9, then ``n`` garbage folders."""
    storage = LocalStorage(root, StorageOptions(fsync=False))
    for run in RUNS:
        writer = CheckpointWriter(storage, run, codec=CodecPolicy(codec="none"))
        meta = CheckpointMeta(run_id=run, step=10**9, tier=Tier.FULL, created_at=1000.0)
        data = memoryview(bytes(8))
        rank = writer.write_rank(meta, 0, {"w": 1}, [TensorSource("w", "uint8", (8,), data)])
        done = writer.commit(meta, [rank])
        verdict = ValidationVerdict(meta.checkpoint_id, done.manifest_hash, CheckpointStatus.VALID)
        storage.commit(validation_key(run, meta.checkpoint_id), verdict.to_bytes())
        steps = root / run / "steps"
        for i in range(n):
            folder = steps / checkpoint_id(Tier.PULSE, i)
            os.mkdir(folder)
            if run == "garbage-run":
                fd = os.open(folder / "COMMIT", os.O_WRONLY | os.O_CREAT, 0o644)
                os.write(fd, b"not a commit \x00\xff")
                os.close(fd)


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=50_000, help="garbage folders per run")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--root", type=Path, default=None, help="store folder (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep (and reuse) the store")
    p.add_argument("--skip-cli", action="store_true", help="leave out the ckpt ls rows")
    args = p.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="bench-listing-"))
    try:
        if not (root / RUNS[1] / "steps").is_dir():
            t0 = time.perf_counter()
            build(root, args.n)
            print(f"built {2 * args.n} folders in {time.perf_counter() - t0:.1f}s under {root}")
        storage = LocalStorage(root, StorageOptions(fsync=False))
        limits = ListingLimits(max_entries=DEFAULT_MAX_ENTRIES)
        ckpt = Path(sys.executable).with_name("ckpt")
        print(f"{'run':<12} {'what':<18} {'seconds':>8}  records")
        for run in RUNS:

            def full(run: str = run) -> object:
                return list_checkpoints(storage, run)

            def bounded(run: str = run) -> object:
                return scan_checkpoints(storage, run, limits=limits)

            rows: list[tuple[str, Callable[[], object]]] = [
                ("list_checkpoints", full),
                ("scan (bounded)", bounded),
            ]
            if not args.skip_cli:
                cmd = [str(ckpt), "ls", "--storage", str(root), "--run-id", run]

                def cli(cmd: list[str] = cmd) -> None:
                    out = subprocess.DEVNULL
                    subprocess.run(cmd, check=False, stdout=out, stderr=out)

                rows.append(("ckpt ls", cli))
            for what, fn in rows:
                s = median_s(fn, args.repeat)
                count = len(list_checkpoints(storage, run)) if what == "list_checkpoints" else ""
                print(f"{run:<12} {what:<18} {s:>8.2f}  {count}")
    finally:
        if not args.keep and args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
