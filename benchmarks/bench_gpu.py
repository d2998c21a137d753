#!/usr/bin/env python
"""The GPU path: stall, persist, restore and peak host memory of a state on one GPU (not a
timed test). Skips cleanly (exit 0) where ``torch.cuda.is_available()`` is False.

On one run and the same state (an MLP on ``cuda:0`` whose fp32 weights + AdamW moments
total ``--size-gb``, a few GB of GPU memory), side by side:

* **stall**: ``Checkpointer.save_now(wait=False)`` — the device-to-host copy into
  pinned host buffers (asserted pinned) — vs ``torch.save`` + fsync of the same state;
  and the stall into shared memory (flash checkpoints, ``/dev/shm``);
* **persist**: from the call to the commit (``Checkpointer.wait()``), default policy;
* **restore**: ``Checkpointer.start()`` of a fresh run state onto the GPU, from storage
  and in place from shared memory (timed as its ``start`` event records it), vs
  ``torch.load(map_location="cuda")`` + ``load_state_dict``; every restore is checked
  bitwise against the saved state;
* **peak host memory** during the saves and during a restore, above the process's
  baseline (``VmHWM`` after ``clear_refs``);
* **CUDA RNG round trip**: the generator state a checkpoint captured is the state after
  its restore, and the next draws on the GPU are identical (asserted).

Sized to finish in under 5 minutes on one GPU (``--budget-s`` stops early, saying so):

    python benchmarks/bench_gpu.py --size-gb 3 --write-doc docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import (
    agent_config,
    machine,
    median,
    results_table,
    state_bytes,
    timed_torch_save,
    write_marked,
)
from torch import nn

from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.checkpointer import Checkpointer

GIB = 1024**3
RUN = "bench-gpu"


# --------------------------------------------------------------------------- helpers


def build(size_gb: float, hidden: int, device: torch.device) -> tuple[nn.Module, Any]:
    """An MLP on ``device`` whose weights are ~size_gb/3 (AdamW's moments add 2x that)."""
    layers = max(2, round(size_gb * GIB / 3 / (hidden * hidden * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt)
    return model, opt


def train_step(model: nn.Module, opt: Any) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3  # the CUDA generator advances
    opt.step()
    opt.zero_grad(set_to_none=True)


def peak_reset() -> None:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


def rss(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def peak_above(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the peak RSS it added above the RSS before it."""
    peak_reset()
    base = rss()
    out = fn()
    return out, max(0, rss("VmHWM") - base)


def snapshot_of(model: nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """A GPU copy of the state (to check a restore bitwise)."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{i}/{k}"] = v.detach().clone()
    return out


def same_state(model: nn.Module, opt: Any, ref: dict[str, torch.Tensor]) -> bool:
    got = snapshot_of(model, opt)
    return got.keys() == ref.keys() and all(
        got[k].device == ref[k].device and torch.equal(got[k], ref[k]) for k in ref
    )


def scramble(model: nn.Module, opt: Any, dev: Dev) -> None:
    """A fresh process's state: other weights, other moments, another CUDA RNG state."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.add_(1.0)
    dev.reseed(987654)


def config(root: Path, shm_dir: str | None = None) -> AgentConfig:
    """Saves only when asked (``save_now``)."""
    return agent_config(root, RUN, 100000, **({"shmDir": shm_dir} if shm_dir else {}))


class Dev:
    """The device under test: ``cuda:0``, or the CPU for ``--smoke-cpu`` (a quick run of the
    script's logic where there is no GPU; its figures mean nothing)."""

    def __init__(self, smoke_cpu: bool) -> None:
        self.cuda = not smoke_cpu
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.name = torch.cuda.get_device_name(0) if self.cuda else "CPU (smoke run)"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def rng_state(self) -> list[torch.Tensor]:
        return list(torch.cuda.get_rng_state_all()) if self.cuda else [torch.get_rng_state()]

    def reseed(self, seed: int) -> None:
        if self.cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0


class Budget:
    """Stops the run early (saying so) rather than overrun the time it was sized for."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.skipped: list[str] = []

    def allows(self, what: str) -> bool:
        if time.monotonic() < self.end:
            return True
        self.skipped.append(what)
        print(f"time budget spent: {what} skipped", flush=True)
        return False


# --------------------------------------------------------------------------- phases


def bench_torch(model: nn.Module, opt: Any, root: Path, repeat: int, dev: Dev) -> dict[str, Any]:
    """torch.save + fsync, and torch.load(map_location=cuda) + load_state_dict."""
    path = root / "torch.pt"
    saves, loads = [], []
    ref = snapshot_of(model, opt)
    for _ in range(repeat):
        saves.append(timed_torch_save(model, opt, path))
    load_peaks = []
    for _ in range(repeat):
        scramble(model, opt, dev)
        dev.sync()

        def load() -> None:
            sd = torch.load(path, map_location=dev.device, weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
            dev.sync()

        t0 = time.perf_counter()
        _, peak = peak_above(load)
        loads.append(time.perf_counter() - t0)
        load_peaks.append(peak)
        assert same_state(model, opt, ref), "torch.load restored another state"
    path.unlink()
    return {"save": saves, "load": loads, "load_peak_rss": load_peaks}


def bench_ours(
    model: nn.Module,
    opt: Any,
    root: Path,
    args: argparse.Namespace,
    shm_dir: str | None,
    dev: Dev,
    budget: Budget,
) -> dict[str, Any]:
    """Our saves (stall, persist) and restores (storage, or in place from shared memory)."""
    out: dict[str, Any] = {"stall": [], "persist": [], "restore": [], "restore_peak_rss": []}
    ckpt = Checkpointer(config(root, shm_dir), model=model, optimizer=opt, rank=0, world_size=1)
    rng_at_save: list[torch.Tensor] = []

    def start_and_save() -> None:
        ckpt.start()  # allocates (and touches) the host buffers: part of the staging memory
        if shm_dir is None and dev.cuda:  # the in-process path: the buffers must be pinned
            arena = getattr(ckpt._persister, "arena", None)  # a private look: the check
            bufs = [
                b for b in getattr(arena, "_buffers", {}).values() if isinstance(b, torch.Tensor)
            ]
            assert bufs and all(b.is_pinned() for b in bufs), "host buffers are not pinned"
            out["pinned_buffers"] = len(bufs)
        for i in range(args.repeat):
            train_step(model, opt)
            dev.sync()
            rng_at_save[:] = dev.rng_state()
            t0 = time.perf_counter()
            cid = ckpt.save_now(f"bench {i}", tier=Tier.PULSE, step=i + 1, wait=False)
            out["stall"].append(ckpt.stats.stalls[-1])
            ckpt.wait(validation=False)
            out["persist"].append(time.perf_counter() - t0)
            settle(ckpt, root, str(cid), shm_dir is not None)  # validation: not timed

    _, out["save_peak_rss"] = peak_above(start_and_save)
    ref = snapshot_of(model, opt)
    expected_draw = torch.rand(16, device=dev.device)  # the run's next draws after the save
    ckpt.close()
    for i in range(args.repeat):
        if i and not budget.allows(f"restore {i + 1} ({'shm' if shm_dir else 'storage'})"):
            break
        scramble(model, opt, dev)
        dev.sync()
        again = Checkpointer(
            config(root, shm_dir),
            model=model,
            optimizer=opt,
            rank=0,
            world_size=1,
            preallocate=False,  # the peak is the restore's, not the next saves' buffers
        )
        resume, peak = peak_above(again.start)
        dev.sync()
        out["restore"].append(start_seconds(root))
        out["restore_peak_rss"].append(peak)
        out["action"] = resume.action
        assert same_state(model, opt, ref), f"{resume.action} restored another state"
        got_rng = dev.rng_state()
        assert all(torch.equal(a, b) for a, b in zip(got_rng, rng_at_save, strict=True)), (
            "RNG state not restored exactly"
        )
        assert torch.equal(torch.rand(16, device=dev.device), expected_draw), (
            "the draws after the restore differ from the original run's"
        )
        again.close()
    return out


def start_seconds(root: Path) -> float:
    """The last restore's time as its ``start`` event records it (choose, read, check, load
    onto the GPU; not the start-up of a local persister process, a sidecar's in a pod)."""
    log = root / "work" / "decisions.rank0.jsonl"
    starts = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "start"]
    return float(starts[-1]["seconds"])


def settle(ckpt: Checkpointer, root: Path, ckpt_id: str, shm: bool, timeout: float = 300) -> None:
    """Let the validation of ``ckpt_id`` finish (so the next save is not measured against it)."""
    if not shm:
        ckpt.wait()
        return
    log = root / "work" / "sidecar.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text().splitlines():
                ev = json.loads(line)
                if ev.get("checkpoint") == ckpt_id and ev.get("event") in (
                    "validated",
                    "corrupted",
                ):
                    return
        time.sleep(0.02)


# --------------------------------------------------------------------------- report


def rows(res: dict[str, Any]) -> list[tuple[str, str, str]]:
    tt, ours = res["torch"], res["ours"]
    ts, tl = median(tt["save"]), median(tt["load"])
    mib = 1024 * 1024
    out = [
        (
            "stall: device-to-host copy into pinned host buffers (ours)",
            f"{median(ours['stall']) * 1000:.0f} ms",
            f"{ts / median(ours['stall']):.0f}x less than torch.save + fsync",
        ),
        (
            "persist: call to commit (ours, default policy)",
            f"{median(ours['persist']):.2f} s",
            f"{median(ours['persist']) / ts:.2f}x torch.save + fsync (which stalls for all of it)",
        ),
        ("torch.save + fsync", f"{ts:.2f} s", "blocking"),
        (
            "restore onto the GPU from storage (ours, `Checkpointer.start()`)",
            f"{median(ours['restore']):.2f} s",
            f"{median(ours['restore']) / tl:.2f}x torch.load",
        ),
        ("torch.load(map_location=cuda) + load_state_dict", f"{tl:.2f} s", "baseline"),
        (
            "peak host memory above baseline: saves / restore (ours)",
            f"{ours['save_peak_rss'] / mib:.0f} / {median(ours['restore_peak_rss']) / mib:.0f} MiB",
            f"torch.load: {median(tt['load_peak_rss']) / mib:.0f} MiB; state "
            f"{res['bytes'] / mib:.0f} MiB",
        ),
    ]
    flash = res.get("flash")
    if flash and flash["restore"]:
        out += [
            (
                "stall: device-to-host copy into shared memory (flash)",
                f"{median(flash['stall']) * 1000:.0f} ms",
                f"{ts / median(flash['stall']):.0f}x less than torch.save + fsync",
            ),
            (
                "in-place restore from shared memory onto the GPU (flash)",
                f"{median(flash['restore']):.2f} s",
                f"{median(flash['restore']) / tl:.2f}x torch.load",
            ),
        ]
    out.append(("CUDA RNG round trip", "exact", "asserted after every restore"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-gb", type=float, default=3.0, help="weights + AdamW moments")
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=270.0, help="stop early after this")
    p.add_argument("--dir", type=Path, help="work directory (default: a temp dir)")
    p.add_argument("--shm-root", default="/dev/shm", help="memory-backed directory (flash)")
    p.add_argument("--write-doc", type=Path, help="write the results into this markdown file")
    p.add_argument("--smoke-cpu", action="store_true", help="run the logic on the CPU (no GPU)")
    args = p.parse_args()
    if not torch.cuda.is_available() and not args.smoke_cpu:
        print("bench_gpu: skipped: no CUDA GPU here (torch.cuda.is_available() is False)")
        return 0
    dev = Dev(args.smoke_cpu)
    budget = Budget(args.budget_s)
    root = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=args.dir))
    model, opt = build(args.size_gb, args.hidden, dev.device)
    res: dict[str, Any] = {"bytes": state_bytes(model, opt), "gpu": dev.name}
    print(f"state {res['bytes'] / GIB:.2f} GiB on {res['gpu']}", flush=True)
    res["torch"] = bench_torch(model, opt, root, args.repeat, dev)
    print("torch", json.dumps(res["torch"]), flush=True)
    res["ours"] = bench_ours(model, opt, root / "ours", args, None, dev, budget)
    print("ours", json.dumps(res["ours"]), flush=True)
    if budget.allows("flash checkpoints"):
        shm = tempfile.mkdtemp(prefix="bench-gpu-shm-", dir=args.shm_root)
        try:
            res["flash"] = bench_ours(model, opt, root / "flash", args, shm, dev, budget)
            assert res["flash"]["action"] == "resume_shm", res["flash"]["action"]
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        print("flash", json.dumps(res["flash"]), flush=True)
    res["skipped"] = budget.skipped
    res["peak_gpu_bytes"] = dev.peak_bytes()
    (root / "results.json").write_text(json.dumps(res, indent=1))
    table = results_table(rows(res))
    print("\n".join(table))
    print(f"results: {root / 'results.json'}")
    if args.write_doc and not args.smoke_cpu:
        write_marked(
            args.write_doc,
            "<!-- bench_gpu results -->",
            [
                f"State {res['bytes'] / GIB:.2f} GiB (MLP {args.hidden}x{args.hidden} layers, fp32 "
                f"weights + AdamW moments) on {res['gpu']}, peak GPU memory "
                f"{res['peak_gpu_bytes'] / GIB:.1f} GiB; {args.repeat} repetitions, medians; "
                f"local disk and `/dev/shm`. Machine: {machine()}. Run on "
                f"{time.strftime('%Y-%m-%d')}."
                + (
                    f" Skipped (time budget): {', '.join(budget.skipped)}."
                    if budget.skipped
                    else ""
                ),
                "",
                *table,
            ],
        )
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
