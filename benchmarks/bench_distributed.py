#!/usr/bin/env python
"""Flash checkpoints and multi-rank costs (not a timed test).

Three measurements:

* **training stall per checkpoint, same state** (an MLP whose weights + AdamW
  moments total ``--size-mb``): our shared-memory path (copy into a slot of
  ``/dev/shm``, a persister process does the rest) vs ``torch.save`` + fsync
  vs ``torch.distributed.checkpoint.async_save`` (its staging copy) vs our
  in-process path (copy into reusable host buffers). The background time to
  durable storage is reported beside each.
* **work lost on SIGKILL**: a trainer (``--lost-size-mb`` state, ``--step-ms``
  per step, a pulse every ``--every`` steps) is SIGKILLed at a random step;
  lost work = steps since the newest *committed* checkpoint after everything
  settled. Without the sidecar (in-process persister) the newest snapshot dies
  with the process unless its persist finished; with the sidecar it survives
  in shared memory and is committed after the death.
* **agreement cost per step** on a 2-rank gloo job (two small all-gathers).
* **in-place restart after SIGKILL, 2 ranks** (``--only inplace``, ``--inplace-mb``):
  both ranks restore from shared memory vs ``torch.load`` + ``load_state_dict`` on
  both ranks at once, and vs the restore from storage (``_inplace.py``).

    python benchmarks/bench_distributed.py --size-mb 300 --write-doc docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    MIB,
    agent_config,
    machine,
    median,
    mlp_layers,
    results_table,
    state_bytes,
    timed_torch_save,
    write_marked,
)
from _inplace import bench_inplace
from _inplace import rows as inplace_rows
from torch import nn

from ckpt_agent.policy import AgentConfig

RUN = "bench"


def build(size_mb: float, hidden: int = 2048) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = mlp_layers(size_mb, hidden)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, *, noisy: bool = True) -> None:
    """One AdamW step; random gradients (realistic bytes) or constant ones (cheap, for the
    crash trials, whose trainer must keep its step time)."""
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3 if noisy else torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)


def config(root: Path, **over: Any) -> AgentConfig:
    return agent_config(root, RUN, 10, **over)


# --------------------------------------------------------------------------- 1. stall


def bench_stall(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import async_save

    from ckpt_agent.policy.models import Tier
    from ckpt_agent.runtime.save.snapshot import HostArena, take_snapshot
    from ckpt_agent.runtime.shm.target import FlashTarget

    root.mkdir(parents=True, exist_ok=True)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
    model, opt = build(args.size_mb)
    nbytes = state_bytes(model, opt)
    out: dict[str, Any] = {"bytes": nbytes}

    # torch.save + fsync: everything on the training thread
    saves = []
    for i in range(args.repeat):
        train_step(model, opt)
        path = root / f"torch_{i}.pt"
        saves.append(timed_torch_save(model, opt, path))
        path.unlink()
    out["torch_save"] = saves

    # DCP async_save: stall = until it returns (staging); then wait for the write
    stalls, totals = [], []
    for i in range(args.repeat + 1):
        train_step(model, opt)
        msd, osd = get_state_dict(model, opt)
        t0 = time.perf_counter()
        fut = async_save({"model": msd, "optimizer": osd}, checkpoint_id=str(root / f"dcp{i}"))
        t1 = time.perf_counter()
        result = getattr(fut, "result", None)
        if callable(result):
            result()
        else:  # an AsyncSaveResponse (newer torch): wait for its upload
            fut.upload_completion.result()  # type: ignore[union-attr]
        t2 = time.perf_counter()
        if i:  # the first call sets up its staging buffers and thread
            stalls.append(t1 - t0)
            totals.append(t2 - t0)
    out["dcp_async_stall"], out["dcp_async_total"] = stalls, totals

    # ours, in process: copy into reusable host buffers (the persister thread writes later)
    arena = HostArena()
    sections = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    take_snapshot(0, Tier.PULSE, sections, arena)  # allocate + touch
    ours = []
    for i in range(args.repeat):
        train_step(model, opt)
        snap = take_snapshot(i + 1, Tier.PULSE, sections, arena)
        ours.append(snap.stall_s)
    out["host_stall"] = ours

    # ours, shared memory: copy into a slot; a separate persister process writes it
    shm = tempfile.mkdtemp(prefix="bench-shm-", dir=args.shm_root)
    cfg = config(root / "flash", shmDir=shm)
    flash = FlashTarget(cfg, 0, 1, work_dir=root / "flash" / "work")
    flash.start()
    flash.prepare(sections)
    shm_stalls, persists = [], []
    for i in range(args.repeat):
        train_step(model, opt)
        desc = flash.write(i + 1, Tier.PULSE, sections, meta={"reason": "bench"})
        assert desc is not None
        shm_stalls.append(desc.stall_s)
        mark = flash.wait(desc.seq, timeout=600)
        assert mark is not None and mark.ok, mark
        persists.append(mark.persist_s)
        wait_validated(root / "flash" / "work" / "sidecar.jsonl", desc.checkpoint_id)
    flash.close(120)
    shutil.rmtree(shm, ignore_errors=True)  # 2 slots of the state, in memory
    out["shm_stall"], out["shm_persist"] = shm_stalls, persists
    dist.destroy_process_group()
    return out


def wait_validated(log: Path, ckpt_id: str, timeout: float = 600) -> None:
    """Let the persister finish validating (so the next stall is not measured against it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text().splitlines():
                ev = json.loads(line)
                if (
                    ev.get("event") in ("validated", "corrupted")
                    and ev.get("checkpoint") == ckpt_id
                ):
                    return
        time.sleep(0.02)


# --------------------------------------------------------------------------- 2. work lost


def trainer(args: argparse.Namespace) -> int:
    """Child: train forever, checkpointing every ``--every`` steps; log each finished step."""
    from ckpt_agent.runtime.checkpointer import Checkpointer

    torch.set_num_threads(1)
    root = Path(args.root)
    over: dict[str, Any] = {
        "tiers": {
            "heartbeat": {"enabled": False},
            "pulse": {
                "baseInterval": args.every,
                "minInterval": args.every,
                "maxInterval": args.every,
            },
            "full": {"everySteps": 100000},
        }
    }
    if args.shm:
        over["shmDir"] = args.shm_dir
    model, opt = build(args.lost_size_mb)
    ckpt = Checkpointer(config(root, **over), model=model, optimizer=opt, rank=0, world_size=1)
    resume = ckpt.start()
    log = open(root / "steps.txt", "a")  # noqa: SIM115
    step = resume.step
    while True:
        t0 = time.perf_counter()
        train_step(model, opt, noisy=False)
        ckpt.step(step, 1.0)
        log.write(f"{step}\n")
        log.flush()
        step += 1
        left = args.step_ms / 1000 - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)


def one_crash(args: argparse.Namespace, root: Path, shm: bool, kill_at: int) -> dict[str, Any]:
    from ckpt_agent.format.listing import list_checkpoints
    from ckpt_agent.storage.fs import LocalStorage

    root.mkdir(parents=True)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--root",
        str(root),
        "--every",
        str(args.every),
        "--lost-size-mb",
        str(args.lost_size_mb),
        "--step-ms",
        str(args.step_ms),
    ]
    shm_dir = tempfile.mkdtemp(prefix="bench-shm-", dir=args.shm_root) if shm else None
    if shm_dir:
        cmd += ["--shm", "--shm-dir", shm_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(root / "log", "w"))  # noqa: SIM115
    steps = root / "steps.txt"
    deadline = time.monotonic() + 300
    last = -1
    while time.monotonic() < deadline and proc.poll() is None:
        if steps.exists():
            lines = steps.read_text().split()
            last = int(lines[-1]) if lines else -1
            if last >= kill_at:
                break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lines = steps.read_text().split()
    crashed_after = int(lines[-1])
    # let a surviving persister finish (it exits once the trainer is gone)
    pidf = root / "work" / "sidecar.rank0.pid"
    if pidf.exists():
        pid = int(pidf.read_text())
        end = time.monotonic() + 300
        while time.monotonic() < end and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
    if shm_dir:
        shutil.rmtree(shm_dir, ignore_errors=True)
    store = LocalStorage(root / "store")
    recs = [r for r in list_checkpoints(store, RUN, include_heartbeat=False)]
    newest = recs[-1].step if recs else -1
    return {"crashed_after": crashed_after, "newest": newest, "lost": crashed_after - newest}


def bench_lost(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    kills = [rng.randint(args.every * 3, args.every * 6) for _ in range(args.trials)]
    out: dict[str, Any] = {"kills": kills}
    for shm in (False, True):
        key = "sidecar" if shm else "in_process"
        out[key] = [one_crash(args, root / f"{key}{i}", shm, k) for i, k in enumerate(kills)]
        print(key, [r["lost"] for r in out[key]], flush=True)
    return out


# --------------------------------------------------------------------------- 3. agreement


def _agree_worker(rank: int, world: int, port: int, steps: int, q: Any) -> None:
    import torch.distributed as dist

    from ckpt_agent.decide.scheduler import AdaptiveScheduler
    from ckpt_agent.runtime.dist.agreement import DecisionAgreement, LocalSignals
    from ckpt_agent.runtime.dist.comm import Comm

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    agreement = DecisionAgreement(Comm.new_group())
    sched = AdaptiveScheduler()
    for s in range(20):  # warm-up
        agreement.agree(sched, LocalSignals(step=s, loss=1.0 + rank))
    agreement.seconds, agreement.rounds = 0.0, 0
    for s in range(20, 20 + steps):
        agreement.agree(sched, LocalSignals(step=s, loss=1.0 / (s + 1) + rank))
    if rank == 0:
        q.put(agreement.seconds / agreement.rounds)
    dist.destroy_process_group()


def bench_agreement(steps: int) -> float:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_agree_worker, args=(r, 2, port, steps, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    return float(q.get())


# --------------------------------------------------------------------------- report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=float, default=300)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--lost-size-mb", type=float, default=100)
    p.add_argument("--step-ms", type=float, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--agree-steps", type=int, default=300)
    p.add_argument("--dir", type=Path, help="work directory (default: a temp dir)")
    p.add_argument("--write-doc", type=Path, help="write the results into this markdown file")
    p.add_argument("--inplace-mb", type=float, default=288, help="state of the in-place restart")
    p.add_argument("--only", choices=["stall", "lost", "agree", "inplace"], action="append")
    p.add_argument("--from-results", type=Path, help="render --write-doc from a results.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--shm", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shm-dir", help=argparse.SUPPRESS)
    p.add_argument(
        "--shm-root", default="/dev/shm", help="memory-backed directory for the snapshot slots"
    )
    args = p.parse_args()
    if args.child:
        return trainer(args)
    if args.from_results:
        if args.write_doc:
            write_doc(args, json.loads(args.from_results.read_text()))
        return 0
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    root = Path(tempfile.mkdtemp(prefix="bench-dist-", dir=args.dir))
    only = set(args.only or ["stall", "lost", "agree", "inplace"])
    res: dict[str, Any] = {}
    if "stall" in only:
        res["stall"] = bench_stall(args, root / "stall")
        print(json.dumps(res["stall"], indent=1))
    if "lost" in only:
        res["lost"] = bench_lost(args, root / "lost")
    if "agree" in only:
        res["agree_s"] = bench_agreement(args.agree_steps)
        print("agreement per step:", res["agree_s"])
    if "inplace" in only:
        res["inplace"] = bench_inplace(args.inplace_mb, args.repeat, root / "inplace")
        print(json.dumps(res["inplace"], indent=1))
    (root / "results.json").write_text(json.dumps(res, indent=1))
    print(f"results: {root / 'results.json'}")
    if args.write_doc:
        write_doc(args, res)
    return 0


def write_doc(args: argparse.Namespace, res: dict[str, Any]) -> None:
    rows: list[tuple[str, str, str]] = []
    st = res.get("stall")
    if st:
        ts = median(st["torch_save"])
        rows += [
            (
                "training stall: shared-memory snapshot (ours, flash)",
                f"{median(st['shm_stall']) * 1000:.1f} ms",
                f"{ts / median(st['shm_stall']):.0f}x less than torch.save; durable "
                f"{median(st['shm_persist']):.2f} s later (persister process)",
            ),
            (
                "training stall: host-buffer snapshot (ours, in process)",
                f"{median(st['host_stall']) * 1000:.1f} ms",
                f"{ts / median(st['host_stall']):.0f}x less than torch.save",
            ),
            (
                "training stall: torch.distributed.checkpoint.async_save",
                f"{median(st['dcp_async_stall']) * 1000:.1f} ms",
                f"{ts / median(st['dcp_async_stall']):.0f}x less than torch.save; durable "
                f"{median(st['dcp_async_total']):.2f} s after the call",
            ),
            ("training stall: torch.save + fsync", f"{ts * 1000:.0f} ms", "blocking"),
        ]
    lo = res.get("lost")
    if lo:
        for key, label in (
            ("in_process", "without sidecar (in-process persister)"),
            ("sidecar", "with the sidecar (shared memory)"),
        ):
            lost = [r["lost"] for r in lo[key]]
            rows.append(
                (
                    f"work lost on SIGKILL, {label}",
                    f"{statistics.mean(lost):.1f} steps (max {max(lost)})",
                    f"per trial {lost}",
                )
            )
    if "agree_s" in res:
        rows.append(
            (
                "agreement per step (2 ranks, gloo, 2 all-gathers)",
                f"{res['agree_s'] * 1000:.2f} ms",
                "on the training thread, every step",
            )
        )
    if res.get("inplace"):  # its own block: a run of --only inplace leaves the others
        write_marked(
            args.write_doc,
            "<!-- bench_distributed inplace results -->",
            [
                f"In-place restart: {args.inplace_mb:.0f} MB state (MLP 2048x2048 layers, fp32 "
                f"weights + AdamW moments), 2 ranks on this machine, {args.repeat} repetitions "
                f"interleaved, medians, load average {os.getloadavg()[0]:.1f} at the end. "
                f"Machine: {machine()}. Run on {time.strftime('%Y-%m-%d')}.",
                "",
                *results_table(inplace_rows(res["inplace"])),
            ],
        )
    if not rows:
        print(f"wrote {args.write_doc}")
        return
    mb = (st or {}).get("bytes", 0) / MIB
    write_marked(
        args.write_doc,
        "<!-- bench_distributed results -->",
        [
            f"Stall state: {mb:.0f} MiB (MLP 2048x2048 layers, fp32 weights + AdamW moments), "
            f"{args.repeat} repetitions, medians. Work lost: {args.lost_size_mb:.0f} MB state, "
            f"{args.step_ms:.0f} ms per step, a pulse every {args.every} steps, "
            f"{args.trials} SIGKILLs at random steps (seed {args.seed}), the same steps for both. "
            f"Machine: {machine()}; `/dev/shm` and a local "
            f"disk. Run on {time.strftime('%Y-%m-%d')}.",
            "",
            *results_table(rows),
        ],
    )
    print(f"wrote {args.write_doc}")


if __name__ == "__main__":
    raise SystemExit(main())
