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
  list, read + verify + decode every chunk in parallel, ``load_state_dict``)
  with the default policy, zstd and no compression, vs ``torch.load`` +
  ``load_state_dict`` and ``torch.distributed.checkpoint.load`` of the same
  state; each restore runs in a fresh child process (page cache warm) that
  reports its **peak RSS above its baseline** (the fresh model and optimizer:
  ``VmHWM`` after ``clear_refs``), rounds interleaved;
* ``torch.distributed.checkpoint`` ``save`` / ``async_save`` (single process,
  no process group) of the same state, next to ours.

    python benchmarks/bench_engine.py --size-mb 300 --write-doc docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from _common import MIB, machine, median, mlp_layers, results_table, state_bytes, write_marked
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load_into
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save_sync

from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.storage.fs import LocalStorage


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
    """The benchmark's policy; codec ``default``: the policy's own compression settings."""
    compression = {} if codec == "default" else {"codec": codec, "level": 3, "byteShuffle": True}
    return AgentConfig.model_validate(
        {
            "runId": run,
            "storageUrl": (root / "store").as_uri(),
            "workDir": str(root / f"work-{run}"),
            "compression": compression,
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
    raws = []
    for i in range(repeat):
        if i:
            train_step(model, opt)
        # the disk's speed right now (a loaded machine's changes from minute to minute)
        raws.append(raw_write(state_bytes(model, opt), root / "raw-pair.bin"))
        ckpt.save_now(f"bench {i}", step=i, wait=False)
        ckpt.wait(600)
    ckpt.close()
    snaps = events(cfg, "snapshot")
    commits = events(cfg, "committed")
    return {
        "cfg": cfg,
        "codecs": codec_mix(cfg),
        "vs_raw": median(
            [c["persist_s"] / r for c, r in zip(commits[-repeat:], raws, strict=True)]
        ),
        "stall_s": median([e["stall_s"] for e in snaps]),
        "stalls": [e["stall_s"] for e in snaps],
        "persist_s": median([e["persist_s"] for e in commits]),
        "bytes_first": commits[0]["bytes_new"],
        "raw_bytes": snaps[0]["bytes"],
        "validate_s": median([e["seconds"] for e in events(cfg, "validated")]),
    }


def codec_mix(cfg: AgentConfig) -> dict[str, int]:
    """Codec → blobs of the newest checkpoint (what ``auto`` chose)."""
    with LocalStorage.from_url(cfg.storage_url) as store:
        newest = list_checkpoints(store, cfg.run_id, include_heartbeat=False)[-1]
        _, manifest = read_checkpoint(store, cfg.run_id, newest.id)
    out: dict[str, int] = {}
    for blob in manifest.blobs.values():
        out[blob.codec.codec] = out.get(blob.codec.codec, 0) + 1
    return out


def restore(cfg: AgentConfig, model: nn.Module, opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    ckpt = Checkpointer(cfg, model=model, optimizer=opt)  # the defaults a user gets
    point = ckpt.start()
    elapsed = time.perf_counter() - t0
    assert point.resumed
    ckpt.close()
    return elapsed


def _proc_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def restore_child(args: argparse.Namespace) -> int:
    """One restore in this (fresh) process; prints seconds and peak RSS above the baseline."""
    kind, root = args.restore_child, args.dir
    model, opt = build(args.size_mb, args.hidden, frozen_backbone=False)
    base_kib = _proc_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    cpu0 = time.process_time()
    if kind == "torch":
        seconds = torch_load(model, opt, root / "ref.pt")
    elif kind == "dcp":
        seconds = dcp_load(model, opt, root / "dcp")
    elif kind.startswith("save-"):  # one save (snapshot → COMMIT) from this fresh process
        codec = kind.removeprefix("save-")
        cfg = config(root, codec, f"peak-{codec}")
        ckpt = Checkpointer(cfg, model=model, optimizer=opt)
        ckpt.start()
        ckpt.save_now("peak", step=0)
        ckpt.close()
        seconds = events(cfg, "committed")[0]["persist_s"]
    else:
        seconds = restore(config(root, kind, f"bench-{kind}"), model, opt)
    cpu = time.process_time() - cpu0  # every thread's CPU time: the work, whatever the load
    peak = (_proc_kib("VmHWM") - base_kib) * 1024
    print(json.dumps({"seconds": seconds, "peak_bytes": peak, "cpu_s": cpu}))
    return 0


def drop_page_cache() -> None:
    """Write back and drop the page cache (root only): the next read comes from the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"--cold needs root to drop the page cache: {e}") from None


def restores(
    args: argparse.Namespace, root: Path, kinds: list[str], repeat: int, *, cold: bool = False
) -> dict[str, tuple[float, float, float]]:
    """Kind → (median seconds, median peak RSS above baseline, median CPU seconds), each
    run in a fresh child, rounds interleaved so that the machine's load spreads over every
    kind alike; ``cold``: the page cache dropped before each."""
    got: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(repeat):
        for kind in kinds:
            if cold:
                drop_page_cache()
            cmd = [sys.executable, __file__, "--restore-child", kind, "--dir", str(root)]
            cmd += ["--size-mb", str(args.size_mb), "--hidden", str(args.hidden)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got[kind].append(json.loads(out.strip().splitlines()[-1]))
    return {
        k: (
            median([r["seconds"] for r in v]),
            median([r["peak_bytes"] for r in v]),
            median([r["cpu_s"] for r in v]),
        )
        for k, v in got.items()
    }


def _dcp_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def dcp_save(model: nn.Module, opt: torch.optim.Optimizer, path: Path, *, wait: bool) -> float:
    """``dcp.save`` (``wait``) or the stall of ``dcp.async_save`` (not ``wait``; then waited)."""
    shutil.rmtree(path, ignore_errors=True)
    with warnings.catch_warnings():  # "no process group: single process"
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        if wait:
            dcp_save_sync(_dcp_state(model, opt), checkpoint_id=path)
            return time.perf_counter() - t0
        pending = dcp_async_save(_dcp_state(model, opt), checkpoint_id=path)
        stall = time.perf_counter() - t0
        if isinstance(pending, AsyncSaveResponse):
            pending = pending.upload_completion
        pending.result()
        return stall


def dcp_load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        state = _dcp_state(model, opt)
        dcp_load_into(state, checkpoint_id=path)  # in place, into the live tensors
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        return time.perf_counter() - t0


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
    p.add_argument(
        "--cold",
        action="store_true",
        help="also measure every restore with the page cache dropped before it (root)",
    )
    p.add_argument("--restore-child", help=argparse.SUPPRESS)  # one restore, in a child
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    if args.restore_child:
        return restore_child(args)

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

        z = ours(root, "zstd", model, opt, args.repeat)
        n = ours(root, "none", model, opt, args.repeat)
        d = ours(root, "default", model, opt, args.repeat)
        t_dcp_save = median([dcp_save(model, opt, root / "dcp", wait=True) for _ in range(3)])
        t_dcp_stall = median([dcp_save(model, opt, root / "dcp", wait=False) for _ in range(3)])
        kinds = ["default", "zstd", "none", "torch", "dcp"]
        rs = restores(args, root, kinds, args.repeat)
        rs_cold = restores(args, root, kinds, args.repeat, cold=True) if args.cold else None
        peaks = restores(args, root, ["save-default", "save-zstd", "save-none"], 1)
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
            f"{z['persist_s'] / t_raw:.2f}x raw write time ({z['vs_raw']:.2f}x paired)",
        ),
        (
            "persist, no compression (background)",
            f"{n['persist_s']:.2f} s = {mbps(nbytes, n['persist_s']):.0f} MiB/s",
            f"{n['persist_s'] / t_raw:.2f}x raw write time ({n['vs_raw']:.2f}x paired)",
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
            "persist, default policy (background)",
            f"{d['persist_s']:.2f} s = {mbps(nbytes, d['persist_s']):.0f} MiB/s",
            f"{d['persist_s'] / t_raw:.2f}x raw write time ({d['vs_raw']:.2f}x a raw write "
            f"just before each save), {d['persist_s'] / t_save:.2f}x torch.save+fsync; "
            f"codec auto chose {d['codecs']} blobs",
        ),
        (
            "peak RSS during the first save above the trainer's baseline, default policy",
            f"{peaks['save-default'][1] / MIB:.0f} MiB",
            f"{peaks['save-default'][1] / nbytes:.2f}x state (host buffers = 1x, + chunks in "
            f"flight); zstd {peaks['save-zstd'][1] / MIB:.0f} MiB, "
            f"none {peaks['save-none'][1] / MIB:.0f} MiB (fresh process each)",
        ),
        (
            "torch.distributed.checkpoint.save, same state (single process)",
            f"{t_dcp_save:.2f} s",
            f"{t_dcp_save / t_raw:.1f}x raw write time; ours: default policy "
            f"{d['persist_s'] / t_dcp_save:.2f}x, none {n['persist_s'] / t_dcp_save:.2f}x",
        ),
        (
            "torch.distributed.checkpoint.async_save: training stall",
            f"{t_dcp_stall * 1000:.0f} ms",
            f"ours = {z['stall_s'] / t_dcp_stall:.2f}x",
        ),
        (
            "validation after commit (separate process: re-read, decode, hash, shapes)",
            f"{z['validate_s']:.2f} s",
            "background, off the training thread",
        ),
    ]
    restore_rows = restore_table(rs, nbytes)
    if rs_cold is not None:
        restore_rows += ["", *restore_table(rs_cold, nbytes, cache="page cache dropped")]
    width = max(len(r[0]) for r in rows)
    print()
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>22}  {note}")
    print()
    print("\n".join(restore_rows))
    if args.write_doc:
        write_doc(args, nbytes, rows, restore_rows, z, n)
    return 0


#: Restore kinds, as the table names them.
_RESTORES = {
    "default": "ours, default policy (`Checkpointer.start()`)",
    "zstd": "ours, zstd-3 + shuffle",
    "none": "ours, no compression",
    "torch": "`torch.load(weights_only=True)` + `load_state_dict`",
    "dcp": "`torch.distributed.checkpoint.load` + `load_state_dict`",
}


def restore_table(
    rs: dict[str, tuple[float, float, float]], nbytes: int, *, cache: str = "page cache warm"
) -> list[str]:
    """Markdown table: restore time and CPU time (all threads), their ratios to torch.load,
    peak RSS above the baseline."""
    t_load, _, cpu_load = rs["torch"]
    lines = [
        f"| restore (fresh process, {cache}) | time | × torch.load | CPU time "
        "(all threads) | × torch.load | peak RSS above baseline |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, (seconds, peak, cpu) in rs.items():
        lines.append(
            f"| {_RESTORES[kind]} | {seconds:.3f} s | {seconds / t_load:.2f}x | {cpu:.3f} s | "
            f"{cpu / cpu_load:.2f}x | {peak / MIB:.0f} MiB = {peak / nbytes:.2f}x state |"
        )
    return lines


def write_doc(
    args: argparse.Namespace,
    nbytes: int,
    rows: list[tuple[str, str, str]],
    restore_rows: list[str],
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
            *restore_rows,
            "",
            f"Stalls of each save (s): zstd {[round(s, 4) for s in z['stalls']]}, "
            f"none {[round(s, 4) for s in n['stalls']]}.",
        ],
    )
    print(f"\nwrote {args.write_doc}")


if __name__ == "__main__":
    raise SystemExit(main())
