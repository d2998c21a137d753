"""Rank programs of the DCP integration tests (run inside forkserver children).

Each gets ``(rank, world_size, out_dir, *args)`` after the gloo process group is up and
writes what the test checks into ``out_dir``; :func:`entry` turns exceptions into exit
code 1 with the traceback in ``error.rank<r>.txt`` (the harness of
``tests/ckpt_agent/distributed`` launches them).
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ckpt_agent.errors import StepOrderError
from ckpt_agent.integrations.dcp import DcpReader, DcpWriter, load_latest
from ckpt_agent.policy import AgentConfig

ROWS, COLS = 256, 64
"""The sharded weight: 64 KiB, so every shard is a blob (not inline in the manifest)."""


def entry(name: str, rank: int, world: int, port: int, out: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        globals()[name](rank, world, Path(out), *args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        Path(out, f"error.rank{rank}.txt").write_text(traceback.format_exc())
        code = 1
    os._exit(code)


def config(store: Path, run: str, **over: Any) -> AgentConfig:
    data: dict[str, Any] = {
        "runId": run,
        "storageUrl": store.as_uri(),
        "validation": {"loadInSubprocess": False},
        "retention": {"routineKeep": 20, "importantKeep": 20},
    }
    data.update(over)
    return AgentConfig.model_validate(data)


def weight(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * step + step


def bias(step: int) -> torch.Tensor:
    return torch.full((COLS,), float(step), dtype=torch.float64)


_MESH: list[DeviceMesh] = []


def state(step: int, world: int) -> dict[str, Any]:
    """What a torchtitan job hands DCP: DTensor shards, a replicated plain tensor, plain values
    (built without a collective: async saves run theirs meanwhile)."""
    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (world,)))
    mesh = _MESH[0]
    rows = ROWS // world
    local = weight(step)[mesh.get_local_rank() * rows : (mesh.get_local_rank() + 1) * rows]
    return {
        "model": {
            "w": DTensor.from_local(local.clone(), mesh, [Shard(0)], run_check=False),
            "b": bias(step),
        },
        "train_state": {"step": step, "lr": 0.1 * step, "betas": (0.9, 0.95)},
    }


def save_two(rank: int, world: int, out: Path, store: str) -> None:
    """Step 1 with ``dcp.save``, step 2 with ``dcp.async_save``, one writer."""
    writer = DcpWriter(config(Path(store), "dcp1"))
    dcp.save(state(1, world), storage_writer=writer, checkpoint_id="step-1")
    fut = dcp.async_save(state(2, world), storage_writer=writer, checkpoint_id="step-2")
    fut.result()
    writer.close()
    (out / f"saved.rank{rank}").write_text(json.dumps(writer.committed))


def load_sharded(rank: int, world: int, out: Path, store: str, run: str, step: int) -> None:
    """Load the newest valid checkpoint into DTensors laid out for this world size."""
    target = state(0, world)
    reader = DcpReader(config(Path(store), run))
    loaded = load_latest(target, reader)
    w = target["model"]["w"]
    assert isinstance(w, DTensor)
    rows = ROWS // world
    expect = weight(step)[rank * rows : (rank + 1) * rows]
    got = {
        "loaded": loaded,
        "w": torch.equal(w.to_local(), expect),
        "b": torch.equal(target["model"]["b"], bias(step)),
        "train_state": target["train_state"],
    }
    (out / f"loaded.rank{rank}.json").write_text(json.dumps(got))


class MiniCheckpointManager:
    """torchtitan's ``CheckpointManager`` flow on DCP: async save every ``interval`` steps
    (waiting for the previous one first), keep the latest ``keep`` (here: retention's
    ``routineKeep``), load the latest on start."""

    def __init__(self, store: Path, interval: int, keep: int) -> None:
        cfg = config(store, "titan", retention={"routineKeep": keep, "importantKeep": keep})
        self.cfg = cfg
        self.interval = interval
        self.writer = DcpWriter(cfg)
        self.pending: Any = None
        self.pg = dist.new_group(backend="gloo")  # torchtitan's: async saves off the main group

    def save(self, step: int, sd: dict[str, Any]) -> bool:
        if step % self.interval:
            return False
        if self.pending is not None:
            self.pending.result()
        self.pending = dcp.async_save(
            sd, storage_writer=self.writer, checkpoint_id=f"step-{step}", process_group=self.pg
        )
        return True

    def load(self, sd: dict[str, Any]) -> str:
        return load_latest(sd, DcpReader(self.cfg))

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()
        self.writer.close()


def titan(rank: int, world: int, out: Path, store: str) -> None:
    mgr = MiniCheckpointManager(Path(store), interval=2, keep=2)
    saved = [s for s in range(1, 8) if mgr.save(s, state(s, world))]
    mgr.close()
    # the job restarts: a fresh manager loads the latest
    mgr = MiniCheckpointManager(Path(store), interval=2, keep=2)
    target = state(0, world)
    loaded = mgr.load(target)
    w = target["model"]["w"]
    rows = ROWS // world
    exact = torch.equal(w.to_local(), weight(6)[rank * rows : (rank + 1) * rows])
    # a counter restarted at 0 (or a step already saved) is refused, naming what to do
    refused = ""
    try:
        dcp.save(state(4, world), storage_writer=mgr.writer, checkpoint_id="step-4")
    except CheckpointException as e:
        errs = [exc for exc, _ in e.failures.values() if isinstance(exc, StepOrderError)]
        refused = str(errs[0]) if errs else repr(e)
    mgr.close()
    got = {
        "saved": saved,
        "loaded": loaded,
        "exact": exact,
        "train_state": target["train_state"],
        "refused": refused,
    }
    (out / f"titan.rank{rank}.json").write_text(json.dumps(got))


def save_and_titan(rank: int, world: int, out: Path, store: str) -> None:
    """One 2-rank job for both (a launch costs seconds on 2 cores)."""
    save_two(rank, world, out, store)
    titan(rank, world, out, store)
