"""Rank programs of the multi-process tests (run inside forkserver children).

Every program gets ``(rank, world_size, out_dir, *args)`` after the gloo
process group is up, writes what the test checks into ``out_dir`` (losses as
``float.hex`` lines, decisions, final parameter hashes: files survive a
SIGKILL) and returns; :func:`entry` turns exceptions into exit code 1 with the
traceback in ``error.rank<r>.txt``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as nnf
from torch import nn

from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions

RUN = "dist1"


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
    os._exit(code)  # no atexit/destroy: a dead peer must not make the exit hang


# --------------------------------------------------------------------------- helpers


def tiers(base: int, lo: int, hi: int) -> dict[str, Any]:
    """A heartbeat every step, pulses every ``base`` steps (adapted within ``lo``..``hi``),
    no routine full checkpoint."""
    return {
        "heartbeat": {"everySteps": 1},
        "pulse": {"baseInterval": base, "minInterval": lo, "maxInterval": hi},
        "full": {"everySteps": 1000},
    }


def config(out: Path, **over: Any) -> AgentConfig:
    data: dict[str, Any] = {
        "runId": RUN,
        "storageUrl": (out.parent / "store").as_uri(),
        "workDir": str(out / "work"),
        "tiers": tiers(5, 2, 6),
        "scheduler": {"risk": {"enabled": False}},
        "validation": {"loadInSubprocess": False},
        "retention": {"routineKeep": 20, "importantKeep": 20},
    }
    data.update(over)
    return AgentConfig.model_validate(data)


class KillingStorage(LocalStorage):
    """Local storage that SIGKILLs its own process when it is about to publish ``kill_key``."""

    kill_suffix: str | None = None
    kill_after: int = 0

    def commit(self, key: str, data: bytes) -> None:
        self._maybe_die(key)
        super().commit(key, data)

    def create_exclusive(self, key: str, data: bytes) -> bool:  # a fenced writer's publish
        self._maybe_die(key)
        return super().create_exclusive(key, data)

    def _maybe_die(self, key: str) -> None:
        if self.kill_suffix and key.endswith(self.kill_suffix) and "/steps/" in key:
            self.kill_after -= 1
            if self.kill_after < 0:
                os.kill(os.getpid(), signal.SIGKILL)


def store(out: Path, kill_suffix: str | None = None, kill_after: int = 0) -> LocalStorage:
    s = KillingStorage(out.parent / "store", StorageOptions(fsync=False))
    s.kill_suffix = kill_suffix
    s.kill_after = kill_after
    return s


def params_sha(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Position:
    """The data position: the next step's batch index (tiny, exact)."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.pos = int(d["pos"])


# --------------------------------------------------------------------------- MLP training


def resume_record(resume: Any, *fields: str) -> str:
    """JSON of a ResumePoint: step and checkpoint, then ``fields`` (attribute names)."""
    rec: dict[str, Any] = {"step": resume.step, "checkpoint": resume.checkpoint_id}
    for f in fields:
        value = getattr(resume, f)
        rec[f] = list(value) if f == "warnings" else value
    return json.dumps(rec)


class MlpRun:
    """The training program of ``train_ddp``/``train_flash``: an MLP with dropout (per-rank
    RNG), AdamW, StepLR and a data position; every step's loss goes to
    ``losses.rank<r>.txt`` and the final parameter hash to ``final.rank<r>.json``."""

    def __init__(self, rank: int, out: Path, *, ddp: bool, compute_s: float = 0.0) -> None:
        self.rank = rank
        self.out = out
        self.compute_s = compute_s
        """Seconds each step sleeps between its forward and backward pass (a benchmark's
        stand-in for an accelerator's compute time; 0: none)."""
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
        self.net: nn.Module = self.model
        if ddp:
            from torch.nn.parallel import DistributedDataParallel

            # No bucket rebuild: DDP rebuilds its buckets after a wrapper's first iteration,
            # and with 3+ ranks gloo's all-reduce sums a value in another order when it sits
            # elsewhere in the buffer, so a restarted wrapper's first step would differ in
            # the last bits (docs/distributed.md, "Bitwise with more than two ranks").
            self.net = DistributedDataParallel(self.model, find_unused_parameters=True)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 7, 0.5)
        torch.manual_seed(1000 + self.rank)  # each rank its own dropout stream
        self.pos = Position()

    def checkpointer(
        self,
        cfg: AgentConfig,
        world: int,
        storage: LocalStorage,
        opts: dict[str, Any],
        resume_fields: tuple[str, ...],
        **kw: Any,
    ) -> tuple[Checkpointer, int]:
        """Start a Checkpointer over this run; writes ``resume.rank<r>.json``, returns the
        checkpointer and the step to go on from."""
        ckpt = Checkpointer(
            cfg,
            model=self.model,
            optimizer=self.opt,
            lr_scheduler=self.sched,
            dataloader_state=self.pos,
            rank=self.rank,
            world_size=world,
            storage=storage,
            handle_sigterm=bool(opts.get("sigterm")),
            preallocate=False,
            backpressure=opts.get("backpressure", "defer"),
            **kw,
        )
        resume = ckpt.start()
        Path(self.out, f"resume.rank{self.rank}.json").write_text(
            resume_record(resume, *resume_fields)
        )
        return ckpt, resume.step

    def train(
        self,
        start: int,
        steps: int,
        ckpt: Checkpointer | None,
        die: Callable[[int, Any], bool],
        hold_at: int | None = None,
        stall_at: int | None = None,
    ) -> None:
        """Steps ``start`` .. ``steps - 1``; SIGKILL itself after a step that took a snapshot
        and where ``die(step, decision)`` (the step is written to ``died_after.txt`` first).
        A save deferred by back-pressure (a loaded machine) took none: not that step.
        ``hold_at``: before that step, wait while ``<out>/hold`` exists (a test holds the
        run there to kill it mid-run however fast or slow the machine is). ``stall_at``:
        in that step, between the forward and the backward pass, write
        ``<out>/stalled.rank<r>`` and wait while ``<out>/stall.rank<r>`` exists (a test
        kills the rank there: mid-step, the other ranks blocked in the step's all-reduce).
        A failure out of the loop is handed to ``save_on_failure`` (a JIT save), then raised."""
        try:
            self._train(start, steps, ckpt, die, hold_at, stall_at)
        except Exception as err:
            if ckpt is not None:
                ckpt.save_on_failure(err)
            raise

    def _train(
        self,
        start: int,
        steps: int,
        ckpt: Checkpointer | None,
        die: Callable[[int, Any], bool],
        hold_at: int | None,
        stall_at: int | None,
    ) -> None:
        rank, out = self.rank, self.out
        with open(out / f"losses.rank{rank}.txt", "a") as log:
            for step in range(start, steps):
                while step == hold_at and (out / "hold").exists():
                    time.sleep(0.01)
                g = torch.Generator().manual_seed(step * 100 + rank)
                x = torch.randn(8, 16, generator=g)
                y = torch.randn(8, 4, generator=g)
                loss = nnf.mse_loss(self.net(x), y)
                if self.compute_s:
                    time.sleep(self.compute_s)
                self.opt.zero_grad()
                if step == stall_at and (out / f"stall.rank{rank}").exists():
                    (out / f"stalled.rank{rank}").touch()
                    while (out / f"stall.rank{rank}").exists():
                        time.sleep(0.01)
                loss.backward()
                self.opt.step()
                self.sched.step()
                self.pos.pos = step + 1
                log.write(f"{step} {loss.item().hex()}\n")
                log.flush()
                if ckpt is None:
                    continue
                taken = ckpt.stats.saves
                decision = ckpt.step(step, loss.item())
                if ckpt.stats.saves > taken and die(step, decision):
                    Path(out, "died_after.txt").write_text(str(step))
                    os.kill(os.getpid(), signal.SIGKILL)
        if ckpt is not None:
            ckpt.wait()
            ckpt.close()
        Path(out, f"final.rank{rank}.json").write_text(json.dumps({"sha": params_sha(self.model)}))


def node_sidecar(
    out: Path, rank: int, world: int, over: dict[str, Any], rep: dict[str, Any]
) -> None:
    """Rank ``rank`` runs on node ``rep["nodes"][rank]`` (its shared memory
    ``shm.<node>`` beside ``out``) in sidecar mode; that node's sidecar runs in a daemon
    thread of the node's first rank's process (it dies with it, as with its node), serves
    replicas on ``rep["ports"][node]`` and pushes to the next node (several ranks may share
    a node: one sidecar serves all their areas). Optional, per node: ``rep["peers"]``
    a ``host:port`` pushed to instead of the next node (a peer outside the job, e.g. a
    replica server a test can freeze or kill), ``rep["metrics_ports"]`` the port its
    sidecar serves ``/metrics`` and ``/healthz`` on (default: none); ``rep["timeout_s"]``
    the replication's per-operation timeout (default 10 s)."""
    from ckpt_agent.flash.replica.replicator import ReplicaOptions
    from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions

    nodes, ports = rep["nodes"], rep["ports"]
    del world
    node = nodes[rank]
    distinct = list(dict.fromkeys(nodes))
    peer = distinct[(distinct.index(node) + 1) % len(distinct)]
    over["shmDir"] = str(out.parent / f"shm.{node}")
    over["agent"] = {**over.get("agent", {}), "sidecar": True}
    if nodes.index(node) != rank:
        return  # the node's first rank runs its sidecar
    secret = out.parent / "replica-secret"
    if not secret.exists():
        secret.write_bytes(b"0123456789abcdef0123456789abcdef")
    options = ReplicaOptions(
        node=node,
        namespace="team-a",
        job_id="job-1",
        secret_file=str(secret),
        peers=(rep.get("peers", {}).get(node, f"127.0.0.1:{ports[peer]}"),),
        listen_host="127.0.0.1",
        listen_port=ports[node],
        timeout_s=float(rep.get("timeout_s", 10.0)),
    )
    own = config(out, **{**over, "workDir": str(out / f"work.sidecar.{node}")})
    metrics_port = int(rep.get("metrics_ports", {}).get(node, 0))
    sidecar = Sidecar(own, SidecarOptions(metrics_port=metrics_port, poll_s=0.01, replicas=options))
    threading.Thread(target=sidecar.run, daemon=True).start()


def _saved(d: Any) -> bool:
    return bool(d.save and d.tier in ("pulse", "full"))


def _memory_saved(d: Any) -> bool:
    return bool(d.memory_only)


def train_ddp(rank: int, world: int, out: Path, steps: int, opts: dict[str, Any]) -> None:
    """A 2-rank DDP run with dropout (per-rank RNG), AdamW, StepLR and a data position."""
    run = MlpRun(rank, out, ddp=True, compute_s=float(opts.get("compute_s", 0.0)))
    ckpt: Checkpointer | None = None
    start = 0
    if opts.get("checkpoint", True):
        over = dict(opts.get("config", {}))
        if opts.get("shm"):  # flash checkpoints: every rank's own local persister
            over["shmDir"] = str(out.parent / "shm")
            if opts.get("shm_per_rank"):  # as if every rank ran on its own node
                over["shmDir"] = str(out.parent / f"shm.rank{rank}")
        if opts.get("replicated"):  # every rank on its own node, with a replicating sidecar
            node_sidecar(out, rank, world, over, opts["replicated"])
        storage = store(
            out,
            opts.get("kill_suffix") if rank == opts.get("kill_rank") else None,
            int(opts.get("kill_after", 0)),
        )
        ckpt, start = run.checkpointer(
            config(out, **over),
            world,
            storage,
            opts,
            ("exact", "warnings", "action"),
            dist_timeout_s=30.0,
        )
        assert run.pos.pos == start, (run.pos.pos, start)
    die_at = opts.get("die_after_save_at")
    # "memory": after a memory-tier snapshot (memory only), else after a pulse or full
    saved = _memory_saved if opts.get("die_after") == "memory" else _saved

    def die(step: int, d: Any) -> bool:
        dies = opts.get("die_rank") in (rank, "all")
        return die_at is not None and dies and step >= die_at and saved(d)

    run.train(start, steps, ckpt, die, opts.get("hold_at"), opts.get("stall_at"))


# --------------------------------------------------------------------------- agreement


def agree(rank: int, world: int, out: Path, first: int, last: int, swap: bool) -> None:
    """Skewed per-rank losses; rank 1 asks for a save through its signal file at step 25."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    signal_file = out / f"signal.rank{rank}"
    signal_file.write_text("")
    cfg = config(
        out,
        signalFile=str(signal_file),
        tiers=tiers(10, 2, 12),
    )
    ckpt = Checkpointer(
        cfg,
        model=model,
        optimizer=opt,
        rank=rank,
        world_size=world,
        storage=store(out),
        preallocate=False,
        dist_timeout_s=30.0,
        # every agreed save is taken (a loaded machine must not turn one into a deferral:
        # the test checks that the last saves are in storage, not back-pressure)
        backpressure="wait",
    )
    resume = ckpt.start()
    after_start = ckpt.scheduler.state_dict()
    profile = (1 - rank) if swap else rank
    decisions = []
    for step in range(max(first, resume.step), last):
        if profile == 0:
            loss = 2.0 / (1 + 0.05 * step)
        else:
            loss = (2.0 / (1 + 0.05 * step)) * (1 + 0.6 * ((step * 7919) % 13) / 13)
            if step == 32:
                loss *= 80.0  # a spike on this rank only
        if profile == 1 and step == 25:
            signal_file.write_text("save-now-1")
        d = ckpt.step(step, loss)
        decisions.append(d.to_dict())
    ckpt.wait()
    ckpt.close()
    Path(out, f"agree.rank{rank}.json").write_text(
        json.dumps(
            {
                "resume": resume.step,
                "resumed_from": resume.checkpoint_id,
                "after_start": after_start,
                "decisions": decisions,
                "final": ckpt.scheduler.state_dict(),
            },
            default=str,
        )
    )


# --------------------------------------------------------------------------- sharded (FSDP2)


def fsdp_save(rank: int, world: int, out: Path, steps: int) -> None:
    """FSDP2 (fully_shard) on CPU/gloo: train a few steps, save sharded with DCP planning."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ckpt_agent.format.manifest import CheckpointMeta
    from ckpt_agent.persist.writer import CheckpointWriter
    from ckpt_agent.policy.models import Tier
    from ckpt_agent.runtime.core.serialization import library_versions
    from ckpt_agent.runtime.core.sharded import plan_save
    from ckpt_agent.runtime.dist.comm import Comm
    from ckpt_agent.runtime.dist.commit import TwoPhaseCommit
    from ckpt_agent.runtime.save.snapshot import HostArena, take_snapshot

    model, opt = _fsdp_model(world)
    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = model(torch.randn(4, 16, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    full = _full_hashes(state)  # collective: every rank gathers
    if rank == 0:
        Path(out, "saved_full.json").write_text(json.dumps(full, sort_keys=True))
    plan = plan_save(state, coordinator=rank == 0)
    snap = take_snapshot(steps, Tier.FULL, {"sharded": plan.section()}, HostArena())
    comm = Comm.new_group(timeout_s=30)
    writer = CheckpointWriter(store(out), RUN)
    meta = CheckpointMeta(
        run_id=RUN,
        step=steps,
        tier=Tier.FULL,
        world_size=world,
        sections=tuple(snap.tree),
        versions=library_versions(),
    )
    result = TwoPhaseCommit(comm, writer).run(meta, snap.tree, snap.sources(), snap.files)
    writer.close()
    Path(out, f"saved.rank{rank}.json").write_text(
        json.dumps(
            {"hash": result.manifest_hash, "bytes": plan.nbytes, "chunks": sorted(plan.chunks)}
        )
    )


def fsdp_load(rank: int, world: int, out: Path, ckpt_id: str) -> None:
    """Build the same model at another world size and load the sharded checkpoint into it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckpt_agent.runtime.core.sharded import load_sharded

    model, opt = _fsdp_model(world)
    # one step so that the optimizer has state to load into (AdamW creates it lazily)
    model(torch.zeros(1, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    loaded = load_sharded(store(out), RUN, ckpt_id, {"model": msd, "optimizer": osd})
    set_state_dict(
        model,
        opt,
        model_state_dict=loaded["model"],  # type: ignore[arg-type]
        optim_state_dict=loaded["optimizer"],
    )  # type: ignore[arg-type]
    msd2, osd2 = get_state_dict(model, opt)
    full = _full_hashes({"model": msd2, "optimizer": osd2})
    if rank == 0:
        Path(out, "loaded_full.json").write_text(json.dumps(full, sort_keys=True))
    # and it trains on from there
    loss = model(torch.ones(2, 16)).pow(2).mean()
    loss.backward()
    opt.step()


def _fsdp_model(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, 5)
    )
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _full_hashes(state: dict[str, Any]) -> dict[str, Any]:
    """name → SHA-256 of the full (gathered) tensor, plus the JSON values (collective)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k], f"{path}/{k}")
        elif isinstance(v, list | tuple):
            for i, x in enumerate(v):
                walk(x, f"{path}/{i}")
        elif isinstance(v, torch.Tensor):
            t = v.full_tensor() if isinstance(v, DTensor) else v
            t = t.detach().contiguous().reshape(-1)
            out[path] = [
                str(t.dtype),
                list(t.shape),
                hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest(),
            ]
        else:
            out[path] = repr(v)

    walk(state, "")
    return out


# --------------------------------------------------------------------------- flash (shared memory)


def train_flash(rank: int, world: int, out: Path, steps: int, opts: dict[str, Any]) -> None:
    """One trainer with ``shm_dir``: snapshots go to shared memory, a persister does the rest.

    ``die_after_save_at``: SIGKILL this process right after the first snapshot taken at or
    after that step (the step is written to ``died_after.txt`` first).
    """
    run = MlpRun(rank, out, ddp=False)
    ckpt: Checkpointer | None = None
    start = 0
    if opts.get("checkpoint", True):
        cfg = config(
            out,
            shmDir=str(out.parent / "shm"),
            validation={"loadInSubprocess": False},
            **opts.get("config", {}),
        )
        ckpt, start = run.checkpointer(cfg, world, store(out), opts, ("action", "exact", "reason"))
    die_at = opts.get("die_after_save_at")

    def die(step: int, d: Any) -> bool:
        saved = _saved(d) and ckpt is not None and ckpt.stats.saves
        return die_at is not None and step >= die_at and bool(saved)

    run.train(start, steps, ckpt, die)


def shm_half_write(rank: int, world: int, out: Path, shm: str) -> None:
    """Write one complete snapshot (step 1), then die (SIGKILL) in the middle of the second."""
    from ckpt_agent.policy.models import Tier
    from ckpt_agent.runtime.shm.writer import ShmWriter

    writer = ShmWriter(shm, RUN, 0)
    state = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(4096)}
    assert writer.write(1, Tier.PULSE, {"model": state}) is not None
    Path(out, "first_done").write_text("1")
    calls = {"n": 0}
    original = ShmWriter._copy

    def dying_copy(mm: Any, t: Any, value: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the first tensor is in, the second is not
            os.kill(os.getpid(), signal.SIGKILL)
        original(mm, t, value)

    ShmWriter._copy = staticmethod(dying_copy)  # type: ignore[method-assign]
    state2 = {"a": torch.full((4096,), 7.0), "b": torch.full((4096,), 9.0)}
    writer.write(2, Tier.PULSE, {"model": state2})


def fsdp_ckpt(rank: int, world: int, out: Path, steps: int, phase: str) -> None:
    """FSDP2 through ``Checkpointer``: "save" trains and checkpoints (recording the full
    state at every checkpointed step); "load" resumes at another world size."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp_model(world)
    ckpt = Checkpointer(
        config(
            out,
            tiers=tiers(3, 2, 4),
        ),
        model=model,
        optimizer=opt,
        rank=rank,
        world_size=world,
        storage=store(out),
        dist_timeout_s=60.0,
    )
    assert ckpt.sharded
    resume = ckpt.start()
    if phase == "load":
        msd, osd = get_state_dict(model, opt)
        full = _full_hashes({"model": msd, "optimizer": osd})
        if rank == 0:
            Path(out, "loaded_full.json").write_text(json.dumps(full, sort_keys=True))
            Path(out, "resume.json").write_text(resume_record(resume, "exact", "warnings"))
    for step in range(resume.step, resume.step + steps):
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = model(torch.randn(4, 16, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        d = ckpt.step(step, loss.item())
        if d.save and d.tier in ("pulse", "full"):
            msd, osd = get_state_dict(model, opt)
            full = _full_hashes({"model": msd, "optimizer": osd})  # collective
            if rank == 0:
                Path(out, f"full_at_{step}.json").write_text(json.dumps(full, sort_keys=True))
    ckpt.wait()
    ckpt.close()
