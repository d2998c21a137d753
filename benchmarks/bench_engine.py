#!/usr/bin/env python
"""Checkpoint engine benchmark: stall, persist throughput, bytes, restore (not a timed test).

On one run and the same state (an MLP whose weights + AdamW moments total
``--size-mb``), it measures:

* **training stall per checkpoint** (``Checkpointer.save_now(wait=False)``:
  the copy into the reusable host buffers) vs ``torch.save`` + fsync of the
  same state, and the raw memory-copy time of the same bytes into
  preallocated buffers (the floor);
* **persist throughput** (background: chunk, hash, de-duplicate, compress,
  write, fsync, commit) vs a raw sequential write + fsync of the same byte
  count (the disk ceiling), with the policy's zstd and without compression;
* **bytes on disk** vs ``torch.save``: a full training checkpoint, and the
  next checkpoint of a frozen-backbone fine-tune (only the head trains);
* **restore time** (``Checkpointer.start()`` on a fresh process state:
  list, verify every hash, decode, ``load_state_dict``) vs ``torch.load`` +
  ``load_state_dict``.

    python benchmarks/bench_engine.py --size-mb 300 --write-doc docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import MIB, machine, median, mlp_layers, results_table, state_bytes, write_marked
from torch import nn

from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer


def build(
    size_mb: float, hidden: int, *, frozen_backbone: bool
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP whose fp32 weights are ~size_mb/3 (AdamW adds 2x that), one AdamW step taken.

    With ``frozen_backbone`` every layer but a small head is frozen (not in the optimizer).
    """
    layers = mlp_layers(size_mb, hidden)
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(hidden, hidden) for _ in range(layers - 1)]
    # fine-tune: a frozen backbone and a small task head (64 outputs)
    head = nn.Linear(hidden, 64 if frozen_backbone else hidden)
    model = nn.Sequential(*blocks, head)
    if frozen_backbone:
        for b in blocks:
            for p in b.parameters():
                p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    train_step(model, opt)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)
    return time.perf_counter() - t0, path.stat().st_size


def torch_load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> float:
    t0 = time.perf_counter()
    sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    return time.perf_counter() - t0


def memcpy_floor(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    tensors = list(model.state_dict().values())
    for st in opt.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    bufs = [torch.empty_like(t) for t in tensors]
    for b, t in zip(bufs, tensors, strict=True):  # touch once
        b.copy_(t)
    t0 = time.perf_counter()
    for b, t in zip(bufs, tensors, strict=True):
        b.copy_(t)
    return time.perf_counter() - t0


def raw_write(nbytes: int, path: Path) -> float:
    block = os.urandom(4 * MIB)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        os.fsync(f.fileno())
    fsync_dir(path.parent)
    return time.perf_counter() - t0


def config(root: Path, codec: str, run: str) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "runId": run,
            "storageUrl": (root / "store").as_uri(),
            "workDir": str(root / f"work-{run}"),
            "compression": {"codec": codec, "level": 3, "byteShuffle": True},
            "tiers": {"pulse": {"baseInterval": 1000, "minInterval": 1000, "maxInterval": 1000}},
            "retention": {"routineKeep": 10, "importantKeep": 10},
        }
    )


def events(cfg: AgentConfig, name: str) -> list[dict[str, Any]]:
    path = Path(cfg.work_dir or "") / "decisions.rank0.jsonl"
    return [e for line in path.read_text().splitlines() if (e := json.loads(line))["event"] == name]


def ours(
    root: Path, codec: str, model: nn.Module, opt: torch.optim.Optimizer, repeat: int
) -> dict[str, Any]:
    """Stall, persist and bytes of ``repeat`` full checkpoints (one train step apart)."""
    run = f"bench-{codec}"
    cfg = config(root, codec, run)
    ckpt = Checkpointer(cfg, model=model, optimizer=opt)
    ckpt.start()
    for i in range(repeat):
        if i:
            train_step(model, opt)
        ckpt.save_now(f"bench {i}", step=i, wait=False)
        ckpt.wait(600)
    ckpt.close()
    snaps = events(cfg, "snapshot")
    commits = events(cfg, "committed")
    return {
        "cfg": cfg,
        "stall_s": median([e["stall_s"] for e in snaps]),
        "stalls": [e["stall_s"] for e in snaps],
        "persist_s": median([e["persist_s"] for e in commits]),
        "bytes_first": commits[0]["bytes_new"],
        "raw_bytes": snaps[0]["bytes"],
        "validate_s": median([e["seconds"] for e in events(cfg, "validated")]),
    }


def restore(cfg: AgentConfig, make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]) -> float:
    model, opt = make()
    t0 = time.perf_counter()
    ckpt = Checkpointer(cfg, model=model, optimizer=opt, preallocate=False)
    point = ckpt.start()
    elapsed = time.perf_counter() - t0
    assert point.resumed
    ckpt.close()
    return elapsed


def fine_tune_bytes(root: Path, size_mb: float, hidden: int) -> tuple[int, int, int]:
    """(first full checkpoint bytes, next checkpoint bytes after one head-only step, torch.save bytes)."""
    model, opt = build(size_mb, hidden, frozen_backbone=True)
    cfg = config(root, "zstd", "bench-finetune")
    ckpt = Checkpointer(cfg, model=model, optimizer=opt)
    ckpt.start()
    ckpt.save_now("first", step=0)
    train_step(model, opt)
    ckpt.save_now("second", step=1)
    ckpt.wait(600)
    ckpt.close()
    commits = events(cfg, "committed")
    _, ts = torch_save(model, opt, root / "finetune.pt")
    return commits[0]["bytes_new"], commits[1]["bytes_new"], ts


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mb", type=float, default=300.0, help="weights + AdamW moments, MiB")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", type=Path, help="where to write (default: a temp dir, removed after)")
    p.add_argument("--write-doc", type=Path, help="write the results into this markdown file")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        model, opt = build(args.size_mb, args.hidden, frozen_backbone=False)
        nbytes = state_bytes(model, opt)
        print(
            f"state: {nbytes / MIB:.0f} MiB (weights + AdamW moments), {len(list(model.children()))} layers"
        )

        saves = [torch_save(model, opt, root / "ref.pt") for _ in range(args.repeat)]
        t_save = median([s[0] for s in saves])
        save_bytes = saves[0][1]
        t_memcpy = median([memcpy_floor(model, opt) for _ in range(args.repeat)])
        t_raw = median([raw_write(nbytes, root / "raw.bin") for _ in range(args.repeat)])
        (root / "raw.bin").unlink()
        t_load = median([torch_load(model, opt, root / "ref.pt") for _ in range(args.repeat)])

        z = ours(root, "zstd", model, opt, args.repeat)
        n = ours(root, "none", model, opt, args.repeat)

        def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
            return build(args.size_mb, args.hidden, frozen_backbone=False)

        t_restore_z = median([restore(z["cfg"], fresh) for _ in range(2)])
        t_restore_n = median([restore(n["cfg"], fresh) for _ in range(2)])
        ft_first, ft_next, ft_save = fine_tune_bytes(root, args.size_mb, args.hidden)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    def mbps(b: int, s: float) -> float:
        return b / MIB / s if s > 0 else float("nan")

    rows = [
        (
            "training stall per checkpoint (ours: copy into reusable host buffers)",
            f"{z['stall_s'] * 1000:.1f} ms",
            f"{t_save / z['stall_s']:.0f}x less than torch.save+fsync",
        ),
        (
            "torch.save + fsync, same state",
            f"{t_save * 1000:.0f} ms",
            "what a blocking save stalls",
        ),
        (
            "memcpy of the same bytes into preallocated buffers (floor)",
            f"{t_memcpy * 1000:.1f} ms",
            f"ours = {z['stall_s'] / t_memcpy:.2f}x the floor",
        ),
        (
            "persist, zstd-3 + shuffle (background)",
            f"{z['persist_s']:.2f} s = {mbps(nbytes, z['persist_s']):.0f} MiB/s",
            f"{z['persist_s'] / t_raw:.1f}x raw write time",
        ),
        (
            "persist, no compression (background)",
            f"{n['persist_s']:.2f} s = {mbps(nbytes, n['persist_s']):.0f} MiB/s",
            f"{n['persist_s'] / t_raw:.1f}x raw write time",
        ),
        (
            "raw sequential write + fsync, same byte count (ceiling)",
            f"{t_raw:.2f} s = {mbps(nbytes, t_raw):.0f} MiB/s",
            "",
        ),
        (
            "bytes, full checkpoint, zstd-3 + shuffle",
            f"{z['bytes_first'] / MIB:.1f} MiB",
            f"{z['bytes_first'] / save_bytes:.2f}x torch.save ({save_bytes / MIB:.1f} MiB)",
        ),
        (
            "bytes, full checkpoint, no compression",
            f"{n['bytes_first'] / MIB:.1f} MiB",
            f"{n['bytes_first'] / save_bytes:.2f}x torch.save",
        ),
        (
            "bytes, frozen-backbone fine-tune, next checkpoint",
            f"{ft_next / MIB:.2f} MiB",
            f"{ft_next / ft_save:.3f}x torch.save ({ft_save / MIB:.1f} MiB; first: {ft_first / MIB:.1f} MiB)",
        ),
        (
            "restore (start(): list, verify hashes, decode, load_state_dict), zstd",
            f"{t_restore_z:.2f} s",
            f"{t_restore_z / t_load:.1f}x torch.load",
        ),
        (
            "restore, no compression",
            f"{t_restore_n:.2f} s",
            f"{t_restore_n / t_load:.1f}x torch.load",
        ),
        ("torch.load + load_state_dict (weights_only)", f"{t_load:.2f} s", ""),
        (
            "validation after commit (separate process: re-read, decode, hash, shapes)",
            f"{z['validate_s']:.2f} s",
            "background, off the training thread",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>22}  {note}")
    if args.write_doc:
        write_doc(args, nbytes, rows, z, n)
    return 0


def write_doc(
    args: argparse.Namespace,
    nbytes: int,
    rows: list[tuple[str, str, str]],
    z: dict[str, Any],
    n: dict[str, Any],
) -> None:
    import numpy
    import zstandard

    write_marked(
        args.write_doc,
        "<!-- bench_engine results -->",
        [
            f"State: {nbytes / MIB:.0f} MiB (MLP {args.hidden}x{args.hidden} layers, fp32 weights + "
            f"AdamW moments), {args.repeat} repetitions, medians. Machine: {machine()}, "
            f"numpy {numpy.__version__}, zstandard {zstandard.__version__}; storage: local disk "
            f"(`--dir` {args.dir or 'a temp dir'}). Run on {time.strftime('%Y-%m-%d')}.",
            "",
            *results_table(rows),
            "",
            f"Stalls of each save (s): zstd {[round(s, 4) for s in z['stalls']]}, "
            f"none {[round(s, 4) for s in n['stalls']]}.",
        ],
    )
    print(f"\nwrote {args.write_doc}")


if __name__ == "__main__":
    raise SystemExit(main())
