"""In-place restart from shared memory with 2 ranks vs ``torch.load`` (part of
``bench_distributed.py --only inplace``; not a benchmark on its own).

1. *train*: a 2-rank gloo job (replicated MLP + AdamW state of ``--inplace-mb``,
   flash checkpoints into ``/dev/shm``, a local persister per rank) snapshots at
   step 1 and both ranks SIGKILL themselves right after; the persisters write
   the snapshot and exit. Rank 0 also wrote ``torch.save`` of the same state
   (untimed) and each rank the SHA-256 of its state at the snapshot.
2. *memory*: both ranks restart on a fresh model and run ``Checkpointer.start()``
   (in-place restart: every rank restores the snapshot from shared memory, checked;
   timed as its ``start`` event records it), then check their state is bitwise the
   saved one. Repeated; the snapshot stays.
3. *storage*: the same restart without ``shmDir`` (restore from the checkpoint the
   persisters committed, default policy), for context.
4. *torch.load*: both ranks at once: ``torch.load(weights_only=True)`` of the file
   (page cache warm) + ``load_state_dict`` of model and optimizer.

Every figure is the slower rank's, median of ``--repeat`` (the phases interleaved).
"""

from __future__ import annotations

import cProfile
import hashlib
import json
import os
import signal
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _common import agent_config
from torch import nn

RUN = "bench-inplace"


def _sha(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(
            k.encode() + v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        )
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            if isinstance(v, torch.Tensor):
                h.update(
                    f"{i}/{k}".encode()
                    + v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                )
    return h.hexdigest()


def _config(root: Path, shm: bool) -> Any:
    over = {"shmDir": str(root / "shm")} if shm else {}
    return agent_config(root, RUN, 2, **over)


def _worker(
    rank: int, world: int, port: int, root: str, size_mb: float, phase: str, q: Any
) -> None:
    import torch.distributed as dist
    from bench_distributed import build, train_step

    from ckpt_agent.runtime.checkpointer import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    base = Path(root)
    model, opt = build(size_mb)  # seeded: the same state on both ranks
    if phase == "torch.load":
        dist.barrier()
        t0 = time.perf_counter()
        sd = torch.load(base / "state.pt", weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        q.put({"rank": rank, "seconds": time.perf_counter() - t0, "sha": _sha(model, opt)})
        dist.barrier()
        return
    ckpt = Checkpointer(
        _config(base, phase != "storage"),
        model=model,
        optimizer=opt,
        rank=rank,
        world_size=world,
        preallocate=False,
        backpressure="wait",
    )
    dist.barrier()
    prof = cProfile.Profile() if os.environ.get("CKPT_BENCH_PROFILE") else None
    if prof is not None:  # where a restart's time goes: CKPT_BENCH_PROFILE=<dir>
        prof.enable()
    resume = ckpt.start()
    if prof is not None:
        prof.disable()
        prof.dump_stats(Path(os.environ["CKPT_BENCH_PROFILE"]) / f"{phase}.rank{rank}.prof")
    if phase != "train":
        seconds = _start_seconds(base, rank)
        q.put({"rank": rank, "seconds": seconds, "action": resume.action, "sha": _sha(model, opt)})
        ckpt.close()
        dist.barrier()
        return
    for step in range(4):
        torch.manual_seed(100 + step)
        train_step(model, opt)
        d = ckpt.step(step, 1.0)
        if d.save and step >= 1:
            (base / f"saved.rank{rank}.json").write_text(
                json.dumps({"step": step, "sha": _sha(model, opt)})
            )
            if rank == 0:
                torch.save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict()}, base / "state.pt"
                )
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)  # right after the snapshot, on every rank


def _start_seconds(base: Path, rank: int) -> float:
    """The restore's time as the ``start`` event records it (owner check, groups, flush,
    choice, load, apply; not the local persister's start-up, a sidecar's in a pod)."""
    log = base / "work" / f"decisions.rank{rank}.jsonl"
    starts = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "start"]
    return float(starts[-1]["seconds"])


def _job(root: Path, size_mb: float, phase: str) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_worker, args=(r, 2, port, str(root), size_mb, phase, q))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    out = []
    while not q.empty():
        out.append(q.get())
    if phase != "train" and len(out) != 2:
        raise RuntimeError(
            f"{phase}: {len(out)} of 2 ranks answered (exit codes {[p.exitcode for p in procs]})"
        )
    return sorted(out, key=lambda r: int(r["rank"]))


def _wait_persisters(root: Path, timeout: float = 300) -> None:
    for rank in range(2):
        pid = int((root / "work" / f"sidecar.rank{rank}.pid").read_text())
        end = time.monotonic() + timeout
        while time.monotonic() < end and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)


def bench_inplace(size_mb: float, repeat: int, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    _job(root, size_mb, "train")
    _wait_persisters(root)
    saved = [json.loads((root / f"saved.rank{r}.json").read_text()) for r in range(2)]
    out: dict[str, Any] = {"step": saved[0]["step"], "bytes": (root / "state.pt").stat().st_size}
    phases = ("memory", "storage", "torch.load")
    for phase in phases:
        out[phase] = []
    for _ in range(repeat):  # interleaved: a change of the machine's load hits every phase
        for phase in phases:
            ranks = _job(root, size_mb, phase)
            for r in ranks:  # bitwise the saved state, on every rank
                if r["sha"] != saved[int(r["rank"])]["sha"]:
                    raise AssertionError(f"{phase}: rank {r['rank']} restored another state")
            seconds = max(float(r["seconds"]) for r in ranks)
            actions = sorted({str(r.get("action")) for r in ranks})
            out[phase].append({"seconds": seconds, "actions": actions})
            print(f"{phase}: {seconds:.3f} s {actions}", flush=True)
    return out


def rows(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The results table's rows."""

    def med(phase: str) -> float:
        return statistics.median(float(r["seconds"]) for r in res[phase])

    def per_round(phase: str) -> str:
        pairs = zip(res[phase], res["torch.load"], strict=True)
        return ", ".join(f"{float(a['seconds']) / float(b['seconds']):.2f}" for a, b in pairs)

    base = med("torch.load")
    mem, sto = med("memory"), med("storage")
    mib = res["bytes"] / (1024 * 1024)
    return [
        (
            f"in-place restart after SIGKILL, 2 ranks, {mib:.0f} MiB state: from shared memory",
            f"{mem:.3f} s",
            f"{mem / base:.2f}x torch.load (per round {per_round('memory')}; "
            "`Checkpointer.start()`'s restore, slower rank; every rank's copy checked, "
            "bitwise the saved state)",
        ),
        (
            "the same restart from storage (no `shmDir`, default policy)",
            f"{sto:.3f} s",
            f"{sto / base:.2f}x torch.load (per round {per_round('storage')})",
        ),
        (
            "torch.load(weights_only) + load_state_dict, both ranks at once",
            f"{base:.3f} s",
            "baseline (page cache warm)",
        ),
    ]
