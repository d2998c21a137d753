"""One FIT training run on this machine: its agent config, its processes, its storage.

A :class:`FitRun` is what a pod plus its controller are in a cluster: the example
trainer (``examples/train_mnist_like.py`` with the agent, see :mod:`ckpt_e2e.training`)
started as a separate process over one storage folder, killed, and started again by
the harness the way a controller restarts a failed pod. Trainers are forked from a
server that preloaded torch (:mod:`ckpt_e2e.fit.child`); the persister a flash-mode
trainer starts is a plain subprocess (``python -m ckpt_agent.cli sidecar``).

:func:`verify_recovery` holds the checks every local scenario shares (issue #14).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.persist.validate import load_check
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.storage import Storage
from ckpt_agent.storage.fs import LocalStorage

from ..procs import clean_env
from ..tools import REPO_ROOT
from ..training import Training
from .core import FitContext, Outcome
from .faults import ENV as FAULT_ENV
from .faults import INJECT_DIR

RUN_ID = "fit"
#: A small, fast run: ~0.5 s of training, a pulse every 4 steps.
SMALL = Training(steps=32, seed=11, step_sleep=0.02, batch_size=32, hidden=64, samples=512)


class Zygote:
    """The trainer factory (``python -m ckpt_e2e.fit.child``, see there); one per harness."""

    def __init__(self) -> None:
        self.log = Path(tempfile.gettempdir()) / f"ckpt-fit-zygote-{os.getpid()}.log"
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckpt_e2e.fit.child"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=child_env(),
                start_new_session=True,
            )
        self.lock = threading.Lock()

    def call(self, request: Mapping[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(dict(request)).encode() + b"\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the FIT trainer zygote died; see {self.log}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.log.exists() and not self.log.stat().st_size:
            self.log.unlink()  # kept only when the zygote had something to say


_zygote: list[Zygote] = []


def zygote() -> Zygote:
    """The process-wide zygote (started on first use, stopped at exit)."""
    if not _zygote or _zygote[0].proc.poll() is not None:
        _zygote[:] = [Zygote()]
        atexit.register(_zygote[0].close)
    return _zygote[0]


class Trainer:
    """One trainer process forked by the zygote (``multiprocessing.Process``-like)."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log: Path) -> None:
        self.pid: int = zygote().call(
            {"op": "spawn", "argv": argv, "env": dict(env), "log": str(log)}
        )["pid"]
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None:
            self._exitcode = zygote().call({"op": "status", "pid": self.pid})["exitcode"]
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.01)


def child_env(
    extra: Mapping[str, str] | None = None, *, pythonpath: tuple[Path, ...] = ()
) -> dict[str, str]:
    """The harness environment minus ``CKPT_*``, with the FIT hooks on ``PYTHONPATH``
    (then the caller's ``PYTHONPATH``, absolute, then this checkout's ``e2e`` and ``agent``)."""
    env = {k: v for k, v in clean_env().items() if not k.startswith("CKPT_")}
    own = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [
        *map(str, pythonpath),
        str(INJECT_DIR),
        *own,
        str(REPO_ROOT / "e2e"),
        str(REPO_ROOT / "agent"),
    ]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONHASHSEED"] = "0"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def fit_config(
    root: Path, *, shm: bool = False, pulse_every: int = 4, **overrides: Any
) -> AgentConfig:
    """A test-sized agent config: a pulse every ``pulse_every`` steps, nothing expires."""
    data: dict[str, Any] = {
        "runId": RUN_ID,
        "storageUrl": (root / "store").as_uri(),
        "workDir": str(root / "work"),
        "tiers": {
            "heartbeat": {"everySteps": 1},
            "pulse": {
                "baseInterval": pulse_every,
                "minInterval": pulse_every,
                "maxInterval": pulse_every,
            },
            "full": {"everySteps": 1000},
        },
        "scheduler": {"risk": {"enabled": False}},
        "validation": {"loadInSubprocess": False},
        "retention": {"routineKeep": 1000, "importantKeep": 1000},
    }
    if shm:
        data["shmDir"] = str(root / "shm")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return AgentConfig.model_validate(data)


@dataclass
class Attempt:
    """One start of the trainer."""

    number: int
    proc: Trainer
    started: float
    log: Path
    out: Path
    lines_before: int

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def alive(self) -> bool:
        return self.proc.is_alive()


@dataclass
class FitRun:
    """A training run over one storage folder, started and restarted by the harness."""

    root: Path
    training: Training = SMALL
    config: AgentConfig | None = None
    env: dict[str, str] = field(default_factory=dict)
    pythonpath: tuple[Path, ...] = ()
    attempts: list[Attempt] = field(default_factory=list)
    storage: Storage | None = None
    """Where to look at the checkpoints (default: the config's local storage folder)."""
    pace: float | None = None
    """``--step-sleep`` of the current attempt when not the training's (set by start)."""

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.config is None:
            self.config = fit_config(self.root)
        self.config_path = self.root / "ckpt-config.json"
        self.config_path.write_text(self.config.to_json())
        self.loss_log = self.root / "losses.jsonl"
        self.store: Storage = self.storage or LocalStorage(
            Path(self.config.storage_url.removeprefix("file://"))
        )

    @property
    def work_dir(self) -> Path:
        assert self.config is not None and self.config.work_dir
        return Path(self.config.work_dir)

    # ------------------------------------------------------------------ processes
    def argv(self, out: Path) -> list[str]:
        """The example's arguments (``self.pace``, when set, overrides ``--step-sleep``:
        pacing, not numbers)."""
        t = self.training
        return [
            *t.numeric_args(),
            "--step-sleep",
            str(t.step_sleep if self.pace is None else self.pace),
            "--out",
            str(out),
            "--loss-log",
            str(self.loss_log),
        ]

    def start(
        self,
        *,
        fault: Mapping[str, Any] | None = None,
        resume_from: str | None = None,
        pace: float | None = None,
    ) -> Attempt:
        n = len(self.attempts)
        extra = {**self.env, "CKPT_CONFIG": str(self.config_path)}
        if fault:
            extra[FAULT_ENV] = json.dumps(dict(fault))
        if resume_from:
            extra["CKPT_RESUME_FROM"] = resume_from
        env = child_env(extra, pythonpath=self.pythonpath)
        out = self.root / f"result.{n}.json"
        log = self.root / f"trainer.{n}.log"
        lines = len(self._lines())
        started = time.monotonic()
        self.pace = pace
        proc = Trainer(self.argv(out), env, log)
        attempt = Attempt(n, proc, started, log, out, lines)
        self.attempts.append(attempt)
        return attempt

    @property
    def current(self) -> Attempt:
        return self.attempts[-1]

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Signal the current trainer; returns when it is gone (the failure is detected then)."""
        a = self.current
        if a.proc.pid is not None and a.alive():
            try:
                os.kill(a.proc.pid, sig)
            except ProcessLookupError:
                pass
        a.proc.join(30)
        return time.monotonic()

    def wait_exit(self, timeout: float = 120.0) -> int | None:
        self.current.proc.join(timeout)
        return self.current.exitcode

    def persister_pid(self) -> int | None:
        path = self.work_dir / "sidecar.rank0.pid"
        try:
            pid = int(path.read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid

    def close(self) -> None:
        """Kill whatever this run left running (trainers, persister)."""
        for a in self.attempts:
            if a.alive() and a.proc.pid is not None:
                with_suppress_kill(a.proc.pid)
                a.proc.join(10)
        pid = self.persister_pid()
        if pid is not None:
            with_suppress_kill(pid)
        self.store.close()

    # ------------------------------------------------------------------ observations
    def _lines(self) -> list[dict[str, Any]]:
        try:
            text = self.loss_log.read_text()
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # the line being written when the process died
        return out

    def losses(self) -> dict[int, float]:
        """Every step's loss, the last run of a step winning (a resume re-runs steps)."""
        return {int(d["step"]): float.fromhex(d["loss"]) for d in self._lines()}

    def last_step(self) -> int:
        lines = self._lines()
        return int(lines[-1]["step"]) if lines else -1

    def stepped_since_start(self) -> bool:
        """The current attempt logged a step (training is running again)."""
        return len(self._lines()) > self.current.lines_before

    def records(self, heartbeat: bool = False) -> list[CheckpointRecord]:
        return list_checkpoints(self.store, RUN_ID, include_heartbeat=heartbeat)

    def valid(self) -> list[CheckpointRecord]:
        return [
            r
            for r in self.records()
            if r.status == CheckpointStatus.VALID and r.tier in (Tier.PULSE, Tier.FULL)
        ]

    def events(self, name: str) -> list[dict[str, Any]]:
        """The decision log's events called ``name`` (all attempts, oldest first)."""
        out = []
        try:
            text = (self.work_dir / "decisions.rank0.jsonl").read_text()
        except OSError:
            return []
        for line in text.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                out.append(event)
        return out

    def result(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.current.out.read_text())
        except (OSError, ValueError):
            return None
        return data

    def wait_for(self, what: str, pred: Callable[[], bool], timeout: float = 60.0) -> None:
        """Poll ``pred``; raises if the trainer exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not pred():
            if not self.current.alive():
                raise RuntimeError(
                    f"the trainer exited (code {self.current.exitcode}) before {what}; "
                    f"log: {self.current.log}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.01)

    def restart_and_time(
        self, detected_at: float, *, pace: float | None = 0.0, **start: Any
    ) -> float | None:
        """Start again (as a controller would) and return seconds from ``detected_at`` until
        the new process logged a step (None: it never did). The restarted run is unpaced
        by default (``--step-sleep 0``: pacing, not numbers), so its rest runs at full speed."""
        self.start(pace=pace, **start)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.stepped_since_start():
                return time.monotonic() - detected_at
            if not self.current.alive():
                return None
            time.sleep(0.01)
        return None


def with_suppress_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------- reference
def reference(ctx: FitContext, training: Training) -> dict[str, Any]:
    """The uninterrupted run of ``training`` (no agent), cached per config in the context."""
    cache: dict[tuple[str, ...], dict[str, Any]] = ctx.services.setdefault("fit-references", {})
    key = tuple(training.numeric_args())
    if key not in cache:
        folder = (
            ctx.work_dir / "references" / hashlib.sha256(" ".join(key).encode()).hexdigest()[:12]
        )
        run = FitRun(folder, replace(training, step_sleep=0.0))
        out = folder / "reference.json"
        proc = Trainer([*run.argv(out), "--no-checkpoint"], child_env(), folder / "reference.log")
        proc.join(300)
        if proc.exitcode != 0:
            raise RuntimeError(f"the reference run failed; see {folder / 'reference.log'}")
        data = json.loads(out.read_text())
        cache[key] = {
            "losses": {int(s): float.fromhex(v) for s, v in data["losses"].items()},
            "params": data["final_params_sha256"],
        }
    return cache[key]


# --------------------------------------------------------------------------- checks
def corrupt_valid(run: FitRun) -> list[str]:
    """Checkpoints marked valid that do not load (must always be empty)."""
    bad = []
    for r in run.valid():
        report = load_check(run.store, RUN_ID, r.id)
        if not report.ok:
            bad.append(r.id)
    return bad


@dataclass
class Expectations:
    """What a scenario knows about its run when it verifies the recovery."""

    acknowledged: list[str]
    """Checkpoints valid when the fault hit (must all survive)."""
    damaged: set[str] = field(default_factory=set)
    """Checkpoints the scenario corrupted (never loaded, never valid afterwards)."""
    unreadable: set[str] = field(default_factory=set)
    """Checkpoints storage failed to read at the restart (never loaded; may stay valid)."""
    last_step_before: int = -1
    """The last step logged before the fault."""
    at_fault: list[CheckpointRecord] | None = None
    """The committed checkpoints listed once the trainer was gone (:meth:`FitRun.records`
    after the kill): with them, which checkpoint the restart took is checked against
    :func:`~ckpt_e2e.fit.core.restart_may_resume` (the shared criterion)."""


def verify_recovery(
    outcome: Outcome, run: FitRun, ref: Mapping[str, Any], expect: Expectations
) -> None:
    """The shared pass criteria: finished, exact losses and params, nothing lost or corrupt."""
    code = run.wait_exit(180)
    result = run.result()
    outcome.check(
        "recovered automatically",
        code == 0 and result is not None,
        f"final attempt #{run.current.number} exit {code}",
    )
    if result is None:
        return
    resume = result.get("resume") or {}
    ckpt_id = resume.get("checkpoint_id")
    outcome.recovered_from = ckpt_id or "(fresh start)"
    start_step = int(result.get("first_step", 0))
    if expect.last_step_before >= 0:
        outcome.steps_lost = max(0, expect.last_step_before + 1 - start_step)
    outcome.check_losses(run.losses(), ref["losses"], exact=bool(resume.get("exact", True)))
    outcome.check(
        "final parameters == reference",
        result.get("final_params_sha256") == ref["params"],
        str(result.get("final_params_sha256", ""))[:16],
    )
    valid_now = {r.id for r in run.valid()}
    lost = [c for c in expect.acknowledged if c not in valid_now]
    outcome.check(
        "no acknowledged checkpoint lost",
        not lost,
        f"{len(expect.acknowledged)} acknowledged, lost: {lost or 'none'}",
    )
    bad = corrupt_valid(run)  # a damaged id valid again was saved anew by the resumed run
    outcome.check("no corrupt checkpoint marked valid", not bad, f"{bad or 'none'}")
    avoid = expect.damaged | expect.unreadable
    outcome.check(
        "no corrupt checkpoint loaded",
        ckpt_id not in avoid,
        f"resumed from {ckpt_id}; damaged/unreadable: {sorted(avoid) or 'none'}",
    )
    if expect.at_fault is not None:
        outcome.check_resume_choice(
            ckpt_id,
            expect.at_fault,
            rejected={str(r[0]) for r in resume.get("rejected") or []},
            corrupted_now={r.id for r in run.records() if r.status == CheckpointStatus.CORRUPTED},
            avoid=avoid,
        )
