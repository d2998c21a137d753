#!/usr/bin/env python
"""Goodput: what checkpointing costs a whole training run, side by side with its peers (not a timed test).

Real training loops run ``--steps`` optimizer steps, each in a fresh process,
rounds interleaved (drift in the machine's load hits every method alike):

* workloads: ``mlp`` (a plain loop; ``--mlp-mb`` of weights + AdamW moments),
  ``gpt2`` (a tiny random-init GPT-2 through Hugging Face ``Trainer``) and
  ``lightning`` (the same GPT-2 as a Lightning module);
* methods, every ``--every`` steps: ``none`` (no checkpointing), ``torch.save``
  (+ fsync, temp + rename), ``dcp.async_save`` (waits for the previous one first),
  ``framework`` (HF ``save_steps``, Lightning ``ModelCheckpoint``), ``ckpt_agent``
  (a pulse every k, everything else the defaults: heartbeats, validation) and
  ``ckpt_agent adaptive`` (the default policy as a user gets it);
* setups: ``1 thread`` and ``2 threads`` (torch threads; the other core is spare
  with one), and ``pinned`` (one torch thread, the whole process — background
  threads included — pinned to one core while a spinning process holds the other).

For each it prints steps/s, the slowdown against ``none`` of the whole run (loop
+ the final wait/close), the training thread's time inside the checkpointing
call (median and p99 on steps with no save due, median on steps with one: the
stall per save), and the CPU spent off the training thread (other threads and
child processes, seconds per run).

    python benchmarks/bench_goodput.py --workload mlp --steps 200 --every 20 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from _common import machine, mlp_layers
from torch import nn

METHODS = ["none", "torch.save", "dcp.async_save", "framework", "ckpt_agent", "ckpt_agent adaptive"]
SETUPS = ["1 thread", "2 threads", "pinned"]
WORKLOADS = ["mlp", "gpt2", "lightning"]


# --------------------------------------------------------------------------- measuring


class Probe:
    """Times the checkpointing call of every step on the training thread."""

    def __init__(self) -> None:
        self.idle: list[float] = []
        self.due: list[float] = []

    @contextmanager
    def timed(self, due: bool) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            (self.due if due else self.idle).append(time.perf_counter() - t0)

    def wrap(self, fn: Callable[..., Any], due: Callable[[Any], bool]) -> Callable[..., Any]:
        """``fn`` timed; ``due(result)`` says whether that call saved."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            (self.due if due(out) else self.idle).append(time.perf_counter() - t0)
            return out

        return timed


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------- savers


class Saver:
    """A checkpointing method in a plain loop: ``after_step`` on the training thread."""

    def __init__(self, root: Path, every: int, model: nn.Module, opt: torch.optim.Optimizer):
        self.root, self.every, self.model, self.opt = root, every, model, opt

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def start(self) -> None:
        pass

    def after_step(self, step: int, loss: float) -> bool:
        del step, loss
        return False

    def close(self) -> None:
        pass


class TorchSave(Saver):
    def after_step(self, step: int, loss: float) -> bool:
        if not self.due(step):
            return False
        torch_save_state(self.model, self.opt, self.root / "torch.pt")
        return True


class DcpAsync(Saver):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pending: Any = None
        self.n = 0

    def after_step(self, step: int, loss: float) -> bool:
        if not self.due(step):
            return False
        self.pending = dcp_async(self.model, self.opt, self.root, self.n, self.pending)
        self.n += 1
        return True

    def close(self) -> None:
        dcp_wait(self.pending)


def torch_save_state(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dcp_wait(pending: Any) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    if pending is None:
        return
    if isinstance(pending, AsyncSaveResponse):
        pending = pending.upload_completion
    pending.result()


def dcp_async(
    model: nn.Module, opt: torch.optim.Optimizer, root: Path, n: int, pending: Any
) -> Any:
    """Wait for the previous ``async_save`` (its buffers), then start the next one (two
    folders in turn)."""
    from torch.distributed.checkpoint.state_dict_saver import async_save

    dcp_wait(pending)
    path = root / f"dcp-{n % 2}"
    shutil.rmtree(path, ignore_errors=True)
    with warnings.catch_warnings():  # "no process group: single process"
        warnings.simplefilter("ignore")
        return async_save(
            {"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path
        )


def agent_config(root: Path, every: int | None) -> Any:
    """The agent's config: the defaults, with a pulse every ``every`` steps (None: the
    adaptive default policy)."""
    from ckpt_agent.policy import AgentConfig

    data: dict[str, Any] = {
        "runId": "goodput",
        "storageUrl": (root / "store").as_uri(),
        "workDir": str(root / "work"),
    }
    if every is not None:
        data["tiers"] = {
            "pulse": {"baseInterval": every, "minInterval": every, "maxInterval": every}
        }
    _merge(data, json.loads(os.environ.get(AGENT_JSON_ENV) or "{}"))
    return AgentConfig.model_validate(data)


AGENT_JSON_ENV = "CKPT_BENCH_AGENT_JSON"
"""``--agent-json``: merged into the agent's config of every child (an ablation)."""


def _merge(into: dict[str, Any], over: dict[str, Any]) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


class Agent(Saver):
    def __init__(self, *args: Any, adaptive: bool) -> None:
        super().__init__(*args)
        from ckpt_agent.runtime.checkpointer import Checkpointer

        self.ckpt = Checkpointer(
            agent_config(self.root, None if adaptive else self.every),
            model=self.model,
            optimizer=self.opt,
        )

    def start(self) -> None:
        self.ckpt.start()

    def after_step(self, step: int, loss: float) -> bool:
        d = self.ckpt.step(step, loss)
        return bool(d.save and d.tier is not None and d.tier.value != "heartbeat")

    def close(self) -> None:
        self.ckpt.close()


def make_saver(
    method: str, root: Path, every: int, model: nn.Module, opt: torch.optim.Optimizer
) -> Saver:
    if method == "none":
        return Saver(root, every, model, opt)
    if method == "torch.save":
        return TorchSave(root, every, model, opt)
    if method == "dcp.async_save":
        return DcpAsync(root, every, model, opt)
    if method in ("ckpt_agent", "ckpt_agent adaptive"):
        return Agent(root, every, model, opt, adaptive=method != "ckpt_agent")
    raise SystemExit(f"{method}: not a method of this workload")


# --------------------------------------------------------------------------- workloads


def run_mlp(args: argparse.Namespace, root: Path, probe: Probe) -> int:
    hidden = 1024
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Linear(hidden, hidden) for _ in range(mlp_layers(args.mlp_mb, hidden))]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, hidden)
    saver = make_saver(args.child_method, root, args.every, model, opt)
    saver.start()
    for step in range(args.steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss)
        t0 = time.perf_counter()
        saved = saver.after_step(step, value)
        (probe.due if saved else probe.idle).append(time.perf_counter() - t0)
    saver.close()
    return args.steps


def _gpt2(torch_seed: int = 0) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(torch_seed)
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=128, n_positions=128, vocab_size=50257)
    return GPT2LMHeadModel(cfg)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seq: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 50257, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run_gpt2(args: argparse.Namespace, root: Path, probe: Probe) -> int:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    method = args.child_method
    model = _gpt2()
    own = method == "framework"
    targs = TrainingArguments(
        output_dir=str(root / "hf"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-4,
        save_strategy="steps" if own else "no",
        save_steps=args.every,
        save_total_limit=2,
        logging_steps=10**6,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    ds = _Tokens(args.steps * args.batch, 64)
    callbacks: list[Any] = []
    holder: dict[str, Any] = {}

    class Baseline(TrainerCallback):  # type: ignore[misc]
        """torch.save / DCP every k steps, from HF's step end (timed)."""

        def __init__(self) -> None:
            self.pending: Any = None
            self.n = 0

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            tr = holder["trainer"]
            due = state.global_step % args.every == 0
            with probe.timed(due):
                if not due or method == "none":
                    return
                if method == "torch.save":
                    torch_save_state(tr.model, tr.optimizer, root / "torch.pt")
                else:
                    self.pending = dcp_async(tr.model, tr.optimizer, root, self.n, self.pending)
                    self.n += 1

        def on_train_end(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            dcp_wait(self.pending)

    agent = method.startswith("ckpt_agent")
    if agent:
        from ckpt_agent.integrations.transformers import CheckpointCallback

        cb = CheckpointCallback(
            agent_config(root, None if method.endswith("adaptive") else args.every)
        )
        callbacks.append(cb)
    elif not own:
        callbacks.append(Baseline())
    trainer = Trainer(model=model, args=targs, train_dataset=ds, callbacks=callbacks)
    holder["trainer"] = trainer
    resume = None
    if agent:
        resume = cb.resume(trainer)
        cb.ckpt.step = probe.wrap(
            cb.ckpt.step, lambda d: bool(d.save and d.tier.value != "heartbeat")
        )
    if own:
        trainer._save_checkpoint = probe.wrap(trainer._save_checkpoint, lambda _: True)
    trainer.train(resume_from_checkpoint=resume)
    return args.steps


def run_lightning(args: argparse.Namespace, root: Path, probe: Probe) -> int:
    import lightning as L  # noqa: N812
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    method = args.child_method

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _gpt2()

        def training_step(self, batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            del i
            out: torch.Tensor = self.net(**batch).loss
            return out

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Baseline(Callback):
        def __init__(self) -> None:
            self.pending: Any = None
            self.n = 0

        def on_train_batch_end(self, trainer: Any, module: Any, *rest: Any) -> None:
            due = trainer.global_step % args.every == 0
            with probe.timed(due):
                if not due or method == "none":
                    return
                opt = trainer.optimizers[0]
                if method == "torch.save":
                    torch_save_state(module, opt, root / "torch.pt")
                else:
                    self.pending = dcp_async(module, opt, root, self.n, self.pending)
                    self.n += 1

        def on_train_end(self, trainer: Any, module: Any) -> None:
            dcp_wait(self.pending)

    module = Module()
    callbacks: list[Any] = []
    if method == "framework":
        mc = ModelCheckpoint(dirpath=root / "pl", every_n_train_steps=args.every, save_top_k=-1)
        mc._save_checkpoint = probe.wrap(mc._save_checkpoint, lambda _: True)
        callbacks.append(mc)
    elif method.startswith("ckpt_agent"):
        from ckpt_agent.integrations.lightning import CheckpointCallback as PLCallback

        cb = PLCallback(agent_config(root, None if method.endswith("adaptive") else args.every))
        callbacks.append(cb)
        holder = {"cb": cb}

        class Wrap(Callback):  # times the agent's step once the callback has started it
            def on_train_start(self, trainer: Any, module: Any) -> None:
                ck = holder["cb"].ckpt
                ck.step = probe.wrap(
                    ck.step, lambda d: bool(d.save and d.tier.value != "heartbeat")
                )

        callbacks.append(Wrap())
    else:
        callbacks.append(Baseline())
    loader = torch.utils.data.DataLoader(
        _Tokens(args.steps * args.batch, 64), batch_size=args.batch
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=method == "framework",
        callbacks=callbacks,
        default_root_dir=str(root / "pl"),
    )
    trainer.fit(module, loader)
    return args.steps


RUNNERS = {"mlp": run_mlp, "gpt2": run_gpt2, "lightning": run_lightning}


def child(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    probe = Probe()
    root = Path(tempfile.mkdtemp(prefix="bench-goodput-", dir=args.dir))
    cpu0, thread0, kids0 = _cpu_self(), time.thread_time(), _cpu_children()
    t0 = time.perf_counter()
    try:
        steps = RUNNERS[args.child_workload](args, root, probe)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - t0
    train_cpu = time.thread_time() - thread0
    background = (_cpu_self() - cpu0 - train_cpu) + (_cpu_children() - kids0)
    return {
        "wall_s": wall,
        "steps_per_s": steps / wall,
        "idle_median_ms": _pct(probe.idle, 0.5) * 1e3,
        "idle_p99_ms": _pct(probe.idle, 0.99) * 1e3,
        "save_median_ms": _pct(probe.due, 0.5) * 1e3,
        "saves": len(probe.due),
        "background_cpu_s": background,
        "train_cpu_s": train_cpu,
    }


# --------------------------------------------------------------------------- driver


@contextmanager
def busy_core(cpu: int) -> Iterator[None]:
    """A process spinning on ``cpu`` for as long as the block runs."""
    spin = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        yield
    finally:
        spin.kill()
        spin.wait()


def run_child(args: argparse.Namespace, workload: str, method: str, setup: str) -> dict[str, Any]:
    threads = 2 if setup == "2 threads" else 1
    cmd = [sys.executable, __file__, "--child-workload", workload, "--child-method", method]
    cmd += ["--threads", str(threads), "--steps", str(args.steps), "--every", str(args.every)]
    cmd += ["--batch", str(args.batch), "--mlp-mb", str(args.mlp_mb)]
    if args.dir:
        cmd += ["--dir", args.dir]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    cpus = sorted(os.sched_getaffinity(0))
    if setup == "pinned" and len(cpus) >= 2:
        cmd = ["taskset", "-c", str(cpus[0]), *cmd]
        ctx: AbstractContextManager[None] = busy_core(cpus[1])
    else:
        ctx = nullcontext()
    with ctx:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _med(rs: list[dict[str, Any]], key: str) -> float:
    xs = [r[key] for r in rs if key in r and r[key] == r[key]]
    return statistics.median(xs) if xs else float("nan")


def _paired(rs: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
    """The slowdown against ``none`` of the same round (rounds are interleaved, so a pair
    shares the machine's load of its minutes): median and range over the rounds. The range
    is the noise a reader must hold any one number against."""
    pairs = [
        (r["wall_s"] / b["wall_s"] - 1) * 100
        for r, b in zip(rs, base, strict=False)
        if "error" not in r and "error" not in b
    ]
    if not pairs:
        return "–"
    return f"{statistics.median(pairs):+.1f} % ({min(pairs):+.0f}…{max(pairs):+.0f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", action="append", choices=WORKLOADS)
    p.add_argument("--method", action="append", choices=METHODS)
    p.add_argument("--setup", action="append", choices=SETUPS)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="k: a save every k steps")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mlp-mb", type=float, default=100.0, help="MLP weights + AdamW moments, MiB")
    p.add_argument("--dir", help="where checkpoints go (default: the temp dir)")
    p.add_argument(
        "--agent-json",
        help="JSON merged into ckpt_agent's config, for an ablation, e.g. "
        '\'{"validation": {"mode": "stored"}}\' or \'{"tiers": {"heartbeat": {"enabled": false}}}\'',
    )
    p.add_argument("--child-workload", help=argparse.SUPPRESS)
    p.add_argument("--child-method", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_workload:
        print(json.dumps(child(args)))
        return 0
    if args.agent_json:
        json.loads(args.agent_json)  # fail here, not in every child
        os.environ[AGENT_JSON_ENV] = args.agent_json
    workloads = args.workload or ["mlp"]
    setups = args.setup or SETUPS
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    plan = []
    for w in workloads:
        for m in args.method or METHODS:
            if w == "mlp" and m == "framework":
                continue  # a plain loop has no framework of its own
            plan += [(w, m, s) for s in setups]
    for _ in range(args.repeat):
        for key in plan:
            r = run_child(args, *key)
            results.setdefault(key, []).append(r)
            print(f"  {' / '.join(key)}: {json.dumps(r)}", file=sys.stderr, flush=True)
    print(
        f"# {machine()}, load {os.getloadavg()[0]:.1f} at the end, {args.steps} steps, a save "
        f"every {args.every}, median of {args.repeat} runs (MLP state {args.mlp_mb:.0f} MiB)"
        + (f", agent config {args.agent_json}" if args.agent_json else "")
    )
    print(
        "| workload | setup | method | steps/s | slowdown vs none | paired: median (range) "
        "| step() no save: median ms | p99 ms | stall per save ms | saves | background CPU s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in workloads:
        for s in setups:
            base = _med(results.get((w, "none", s), []), "wall_s")
            for m in args.method or METHODS:
                rs = results.get((w, m, s))
                if not rs:
                    continue
                errors = [r["error"] for r in rs if "error" in r]
                if len(errors) == len(rs):
                    print(f"| {w} | {s} | {m} | failed: {errors[0][:80]} ||||||| ")
                    continue
                wall = _med(rs, "wall_s")
                slow = (wall / base - 1) * 100 if base == base else float("nan")
                paired = _paired(rs, results.get((w, "none", s), []))
                print(
                    f"| {w} | {s} | {m} | {_med(rs, 'steps_per_s'):.2f} | {slow:+.1f} % "
                    f"| {paired} | {_med(rs, 'idle_median_ms'):.3f} | {_med(rs, 'idle_p99_ms'):.3f} "
                    f"| {_med(rs, 'save_median_ms'):.1f} | {_med(rs, 'saves'):.0f} "
                    f"| {_med(rs, 'background_cpu_s'):.2f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
