"""FIT scenarios of peer replication and the memory tier (issue #31): real gloo DDP jobs.

The job is the distributed tests' (``tests/ckpt_agent/distributed``: ``ckpt_dist_workers.
train_ddp``, launched by ``ckpt_dist_harness.launch``): 2 ranks, one per "node"; a node is
a shared-memory directory ``shm.<node>`` with its sidecar (a thread of its rank's process,
so it dies with the node) pushing every snapshot to its peer. The memory tier snapshots
every :data:`EVERY` steps, a pulse goes to storage every :data:`PULSE`. A lost node is its
rank (and sidecar) SIGKILLed and its directory wiped; the other rank is SIGKILLed too (its
collective would fail) and restarts in place; the lost rank restarts on a new node ``n2``,
whose sidecar asks the peers for its replica. Where a scenario must kill or freeze the peer
alone, rank 1's peer is a bare replica server in its own process (``p``).

Every scenario checks the run ends bitwise equal to the uninterrupted one (stitched losses
of every rank and the final parameters) and that no checkpoint valid at the fault is lost.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.replica.store import ReplicaStore, StoredReplica
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.storage.fs import LocalStorage

from ..api import free_port
from ..tools import REPO_ROOT
from .core import FitContext, Outcome, scenario

#: Where the distributed tests' job and launcher live (imported by name: the forkserver
#: that starts the ranks imports them too).
DIST_DIR = REPO_ROOT / "tests" / "ckpt_agent" / "distributed"
WORLD, STEPS, EVERY, PULSE = 2, 60, 2, 10
COMPUTE_S = 0.05
"""Each step's stand-in for an accelerator's compute: a push has a step's time to finish."""
TIERS = {
    "heartbeat": {"everySteps": 1000},
    "pulse": {"baseInterval": PULSE, "minInterval": PULSE, "maxInterval": PULSE},
    "full": {"everySteps": 1000},
    "memory": {"enabled": True, "everySteps": EVERY},
}
#: The replica may be this many steps behind its rank's newest snapshot when the node is
#: lost (two memory snapshots: a push has a step's time and takes milliseconds here).
MAX_LAG_STEPS = 2 * EVERY
#: A step gap longer than this while a peer is dead or unreachable is a stall: training
#: must never wait for a push (docs/replicas.md); a push waiting out its timeout would show
#: as a gap of at least :data:`PARTITION_TIMEOUT_S`.
STALL_LIMIT_S = 1.5
PARTITION_TIMEOUT_S = 3.0
_NS, _JOB = "team-a", "job-1"  # the scope ckpt_dist_workers.node_sidecar proves

_PEER_MAIN = """
import sys, time
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.marks import MarkStore
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore
shm, run, secret, port, ns, job = sys.argv[1:7]
ReplicaServer(ReplicaStore(shm, run), JobScope.from_file(ns, job, secret),
              host="127.0.0.1", port=int(port), timeout_s=5.0,
              marks=MarkStore(shm, run)).start()
print("serving", flush=True)
while True:
    time.sleep(3600)
"""


def _dist() -> tuple[ModuleType, ModuleType]:
    """The distributed tests' launcher and rank programs (``ckpt_dist_harness``,
    ``ckpt_dist_workers``), their folder put on ``sys.path`` first."""
    if str(DIST_DIR) not in sys.path:
        sys.path.insert(0, str(DIST_DIR))
    return importlib.import_module("ckpt_dist_harness"), importlib.import_module(
        "ckpt_dist_workers"
    )


def _reference(ctx: FitContext) -> dict[str, Any]:
    """The uninterrupted run (every rank's losses, final parameters), shared by the scenarios."""

    def start() -> dict[str, Any]:
        h, w = _dist()
        out = ctx.work_dir.parent / "replicas-reference" / "job"
        h.codes_ok(h.launch(w.train_ddp, WORLD, out, STEPS, {"checkpoint": False}), out)
        return {"losses": _losses(out), "final": _finals(out)}

    got: dict[str, Any] = ctx.shared("replicas-reference", start, lambda _: None)
    return got


def _losses(out: Path) -> list[dict[int, str]]:
    h, _ = _dist()
    return [h.losses(out, r) for r in range(WORLD)]


def _finals(out: Path) -> list[Any]:
    return [json.loads((out / f"final.rank{r}.json").read_text()) for r in range(WORLD)]


class StepClock:
    """When each of rank 1's steps was logged (a thread polling its losses file)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "losses.rank1.txt"
        self.seen: list[tuple[float, int]] = []  # (time, steps logged) at every change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        count = -1
        while not self._stop.is_set():
            try:
                n = self.path.read_bytes().count(b"\n")
            except OSError:
                n = 0
            if n != count:
                count = n
                self.seen.append((time.monotonic(), n))
            self._stop.wait(0.005)

    def steps(self) -> int:
        return self.seen[-1][1] if self.seen else 0

    def max_gap(self, start: float, end: float) -> tuple[float, int]:
        """The longest time between two consecutive steps logged in ``[start, end]`` (the
        gap open at ``start`` counts from ``start``) and how many steps were logged then."""
        times = [start] + [t for t, _ in self.seen if start < t <= end]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return (max(gaps) if gaps else end - start), len(times) - 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1)


@dataclass
class NodeJob:
    """One scenario's job: its folder, the nodes' replica ports and the options it runs with."""

    root: Path
    extra: dict[str, Any] = field(default_factory=dict)
    """More of ``opts["replicated"]``: ``peers``, ``metrics_ports``, ``timeout_s``."""
    hold_at: int | None = None
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.ports = {n: free_port() for n in ("n0", "n1", "n2")}
        self.secret.write_bytes(secrets.token_hex(16).encode())

    @property
    def out(self) -> Path:
        return self.root / "job"

    @property
    def secret(self) -> Path:
        return self.root / "replica-secret"  # ckpt_dist_workers.node_sidecar's (kept if there)

    @property
    def hold(self) -> Path:
        return self.out / "hold"

    def shm(self, node: str) -> Path:
        return self.root / f"shm.{node}"

    def launch(
        self, nodes: list[str], during: Callable[[Any], None] | None = None
    ) -> list[int | None]:
        h, w = _dist()
        opts: dict[str, Any] = {
            "config": {"tiers": TIERS},
            "compute_s": COMPUTE_S,
            "hold_at": self.hold_at,
            "replicated": {"nodes": nodes, "ports": self.ports, **self.extra},
        }
        codes: list[int | None] = h.launch(
            w.train_ddp, WORLD, self.out, STEPS, opts, timeout=150, during=during
        )
        return codes

    def records(self) -> list[CheckpointRecord]:
        """What storage holds (heartbeats aside: a ring the retention rotates)."""
        return list_checkpoints(LocalStorage(self.root / "store"), "dist1", include_heartbeat=False)

    def lose(self, node: str) -> None:
        """The node's memory is gone with it."""
        shutil.rmtree(self.shm(node), ignore_errors=True)

    def replica(self, holder: Path, rank: int = 1, source: str = "n1") -> StoredReplica | None:
        """The complete replica of ``source``'s ``rank`` held in the shared memory ``holder``."""
        try:
            return ReplicaStore(holder, "dist1").current(source, rank)
        except (OSError, ValueError):
            return None

    def latest_step(self, node: str, rank: int = 1) -> int | None:
        """The step of the newest complete snapshot in ``rank``'s area on ``node``."""
        desc = ShmReader(self.shm(node), "dist1", rank).latest()
        return None if desc is None else desc.step

    def resumed(self) -> list[dict[str, Any]]:
        return [json.loads((self.out / f"resume.rank{r}.json").read_text()) for r in range(WORLD)]

    def sidecar_events(self, node: str) -> list[dict[str, Any]]:
        path = self.out / f"work.sidecar.{node}" / "sidecar.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def errors(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.out.glob("error.rank*.txt")))


def _setup(ctx: FitContext, name: str, **kw: Any) -> tuple[Outcome, dict[str, Any], NodeJob]:
    """A scenario's outcome, the reference run and its job (in the scenario's folder)."""
    ref = _reference(ctx)
    job = NodeJob(ctx.work_dir, **kw)
    return Outcome(name), ref, job


def _wait(what: str, ready: Callable[[], bool], timeout: float, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or not alive():
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.01)


def _kill_all(job: Any) -> None:
    """SIGKILL the lost node's rank first, then the other (its collective would fail)."""
    job.kill(1)
    job.kill(0)


def _restart(
    outcome: Outcome, job: NodeJob, nodes: list[str], killed_at: float, done: int
) -> list[int | None]:
    """Restart the job on ``nodes``; the recovery time is the kill to rank 1's next step."""
    seen: dict[str, float] = {}

    def first_step(running: Any) -> None:
        path = job.out / "losses.rank1.txt"
        while running.alive(1) and path.read_bytes().count(b"\n") <= done:
            time.sleep(0.01)
        seen["at"] = time.monotonic()

    job.hold.unlink(missing_ok=True)
    codes = job.launch(nodes, during=first_step)
    outcome.check_recovery_time(seen["at"] - killed_at if "at" in seen else None)
    outcome.check("the restarted job finished", codes == [0] * WORLD, f"{codes} {job.errors()}")
    return codes


def _check_bitwise(outcome: Outcome, job: NodeJob, ref: dict[str, Any]) -> None:
    got, want = _losses(job.out), ref["losses"]
    equal = got == want and _finals(job.out) == ref["final"]
    differ = [s for r in range(WORLD) for s in want[r] if got[r].get(s) != want[r][s]]
    outcome.loss_delta = 0.0 if equal else None
    outcome.check(
        "losses and final parameters bitwise the uninterrupted run's",
        equal,
        "every step of every rank and both final hashes"
        if equal
        else f"steps differing: {differ[:8]}",
    )


def _check_acknowledged(outcome: Outcome, job: NodeJob, at_fault: list[CheckpointRecord]) -> None:
    now = {r.id: r.status for r in job.records()}
    acknowledged = [r.id for r in at_fault if r.status == CheckpointStatus.VALID]
    lost = [c for c in acknowledged if now.get(c) != CheckpointStatus.VALID]
    outcome.check(
        "no acknowledged checkpoint lost",
        bool(acknowledged) and not lost,
        f"{len(acknowledged)} valid at the fault; lost: {lost}",
    )


def _check_storage_resume(
    outcome: Outcome, job: NodeJob, at_fault: list[CheckpointRecord], done: int
) -> None:
    """Every rank took the storage ladder (no memory source), from a checkpoint it may use."""
    resumed = job.resumed()
    actions = [(r["action"], r["step"], r["checkpoint"]) for r in resumed]
    outcome.check(
        "every rank resumed from storage (the ladder)",
        all(r["action"] == "resume" for r in resumed)
        and len({r["checkpoint"] for r in resumed}) == 1,
        str(actions),
    )
    first = resumed[0]
    where = "storage" if first["action"] == "resume" else first["action"]
    outcome.recovered_from = f"{where} {first['checkpoint']}"
    outcome.steps_lost = done - int(resumed[0]["step"])
    corrupted = {r.id for r in job.records() if r.status == CheckpointStatus.CORRUPTED}
    outcome.check_resume_choice(
        resumed[0]["checkpoint"], at_fault, rejected=(), corrupted_now=corrupted
    )


def _peer_process(job: NodeJob, ctx: FitContext) -> tuple[subprocess.Popen[str], str]:
    """A bare replica server (the peer ``p``) in its own process; returns it and its address."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PEER_MAIN,
            str(job.shm("p")),
            "dist1",
            str(job.secret),
            str(port),
            _NS,
            _JOB,
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )

    def stop() -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()

    ctx.cleanups.append(stop)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "serving" once it listens
    if line.strip() != "serving":
        raise RuntimeError(f"the peer replica server did not start (exit {proc.poll()})")
    return proc, f"127.0.0.1:{port}"


_PUSHES = re.compile(r'^ckpt_sidecar_replica_pushes_total\{outcome="(\w+)"\} (\S+)$', re.M)


def _pushes(port: int) -> dict[str, float]:
    """Node n1's sidecar's ``ckpt_sidecar_replica_pushes_total`` by outcome ({} if down)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {m[1]: float(m[2]) for m in _PUSHES.finditer(text)}


def _connected(port: int) -> bool:
    """A TCP connection to ``port`` on this machine is established (a push in flight)."""
    want = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[1].endswith(want) and cols[3] == "01":  # local address, ESTABLISHED
                return True
    return False


# --------------------------------------------------------------------------- node loss
def _lose_n1_at_random(
    ctx: FitContext, outcome: Outcome, job: NodeJob
) -> tuple[float, int, int | None, int | None, list[CheckpointRecord]]:
    """Run the job on n0, n1 and lose n1 at a random instant; returns the kill's time, the
    steps every rank finished, rank 1's newest snapshot step, the step of its replica on n0
    and what storage held."""
    rng = random.Random(ctx.seed)
    at, frac = rng.randint(12, STEPS - 12), rng.random()
    state: dict[str, Any] = {}

    def lose_n1(running: Any) -> None:
        _wait(f"step {at}", lambda: len(_losses(job.out)[0]) >= at, 120, running.running)
        time.sleep(frac * COMPUTE_S)
        _kill_all(running)
        state["at"] = time.monotonic()

    codes = job.launch(["n0", "n1"], during=lose_n1)
    outcome.check("the node was lost", codes == [-signal.SIGKILL] * WORLD, f"{codes}")
    done = min(len(x) for x in _losses(job.out))
    latest = job.latest_step("n1")
    held = job.replica(job.shm("n0"))
    job.lose("n1")
    outcome.injected_at = f"n1 lost after step {done - 1} (+{frac:.2f} of a step)"
    return state["at"], done, latest, None if held is None else held.desc.step, job.records()


@scenario(
    "node-loss",
    "#31 a node lost at a random instant: its rank resumes from the peer's replica",
    expected_s=25,
)
def node_loss(ctx: FitContext) -> Outcome:
    outcome, ref, job = _setup(ctx, "node-loss")
    killed, done, latest, replica, at_fault = _lose_n1_at_random(ctx, outcome, job)
    outcome.notes.append(f"rank 1's newest snapshot: step {latest}; its replica on n0: {replica}")
    _restart(outcome, job, ["n0", "n2"], killed, done)
    resumed = job.resumed()
    want = None if replica is None else replica + 1
    outcome.check(
        "every rank resumed from memory at the replica's step",
        replica is not None
        and [(r["action"], r["step"], r["exact"]) for r in resumed]
        == [("resume_shm", want, True)] * WORLD,
        str([(r["action"], r["step"]) for r in resumed]),
    )
    installed = [e for e in job.sidecar_events("n2") if e["event"] == "rehydrated"]
    outcome.check(
        "n2's sidecar installed rank 1's replica from n0",
        [(e["rank"], e["step"], e["source"]) for e in installed] == [(1, replica, "n1")],
        str([e.get("why") for e in installed]),
    )
    lag = None if latest is None or replica is None else latest - replica
    outcome.steps_lost = done - int(resumed[0]["step"])
    outcome.recovered_from = f"memory; rank 1 from n0's replica of step {replica}"
    outcome.check(
        "steps lost <= the memory interval + the replica's lag (at most 2 snapshots)",
        lag is not None and outcome.steps_lost <= EVERY + lag and lag <= MAX_LAG_STEPS,
        f"{outcome.steps_lost} lost (interval {EVERY}, the replica {lag} step(s) behind rank "
        f"1's newest snapshot; limit {MAX_LAG_STEPS})",
    )
    _check_acknowledged(outcome, job, at_fault)
    _check_bitwise(outcome, job, ref)
    return outcome


# --------------------------------------------------------------------------- corrupted replica
@scenario(
    "replica-corrupted",
    "#31 a byte of the lost rank's replica flipped on the peer: skipped, storage instead",
    expected_s=15,
)
def replica_corrupted(ctx: FitContext) -> Outcome:
    outcome, ref, job = _setup(ctx, "replica-corrupted")
    killed, done, _, replica, at_fault = _lose_n1_at_random(ctx, outcome, job)
    held = job.replica(job.shm("n0"))
    if not outcome.check("n0 held a replica of rank 1", held is not None, f"step {replica}"):
        return outcome
    assert held is not None
    info = next(iter(held.desc.tensors.values()))
    with open(held.data_path, "r+b") as f:  # a bit flipped at rest on the peer
        f.seek(info.offset + info.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x08]))
    outcome.injected_at += f"; a byte of n0's replica (step {replica}) flipped"
    _restart(outcome, job, ["n0", "n2"], killed, done)
    answers = [e for e in job.sidecar_events("n2") if e["event"].startswith("rehydrate")]
    outcome.check(
        "the recreated rank's rehydration refused the corrupted replica",
        [e["event"] for e in answers] == ["rehydrate_none"]
        and "corrupted" in str(answers[0].get("why")),
        str([(e["event"], e.get("why")) for e in answers])[:300],
    )
    _check_storage_resume(outcome, job, at_fault, done)
    _check_acknowledged(outcome, job, at_fault)
    _check_bitwise(outcome, job, ref)
    return outcome


# --------------------------------------------------------------------------- peer loss
@scenario(
    "peer-loss-during-replication",
    "#31 the peer dies with a push in flight: training goes on, a later node loss uses storage",
    expected_s=15,
)
def peer_loss(ctx: FitContext) -> Outcome:
    metrics = free_port()
    outcome, ref, job = _setup(ctx, "peer-loss-during-replication", hold_at=STEPS - 4)
    peer, address = _peer_process(job, ctx)
    job.extra = {"peers": {"n1": address, "n2": address}, "metrics_ports": {"n1": metrics}}
    job.hold.touch()
    clock = StepClock(job.out)
    ctx.cleanups.append(clock.close)
    state: dict[str, Any] = {}

    def kill_peer_then_n1(running: Any) -> None:
        _wait(
            "rank 1's replica on p",
            lambda: job.replica(job.shm("p")) is not None,
            120,
            running.running,
        )
        os.kill(peer.pid, signal.SIGSTOP)  # the next push hangs in its handshake ...
        _wait(
            "a push in flight", lambda: _connected(int(address.split(":")[1])), 30, running.running
        )
        state["in_flight"] = True
        peer.kill()  # ... and the peer dies under it
        peer.wait(10)
        state["dead"], state["step"] = time.monotonic(), clock.steps()
        _wait(
            "a failed push counted and a pulse committed after the peer's death",
            lambda: (
                _pushes(metrics).get("failed", 0) >= 1
                and any(r.step > state["step"] + 1 for r in job.records())
            ),
            60,
            running.running,
        )
        state["pushes"] = _pushes(metrics)
        # n1 is lost a few steps past that pulse: n0's memory is newer than storage
        pulse = max(r.step for r in job.records())
        _wait(
            "steps past the pulse", lambda: clock.steps() > pulse + 2 * EVERY, 30, running.running
        )
        state["gap"] = clock.max_gap(state["dead"], time.monotonic())
        _kill_all(running)
        state["at"] = time.monotonic()

    codes = job.launch(["n0", "n1"], during=kill_peer_then_n1)
    outcome.check("the peer died with a push in flight", state.get("in_flight", False))
    pushes = state.get("pushes", {})
    outcome.check(
        "the failed push was counted (ckpt_sidecar_replica_pushes_total)",
        pushes.get("failed", 0) >= 1 and pushes.get("pushed", 0) >= 1,
        str(pushes),
    )
    gap, steps = state.get("gap", (float("inf"), 0))
    outcome.check(
        "training went on without stalling, saving to storage",
        codes == [-signal.SIGKILL] * WORLD and steps >= 2 and gap <= STALL_LIMIT_S,
        f"{steps} steps after the peer died, longest gap {gap:.2f} s (limit {STALL_LIMIT_S} s)"
        f"; exits {codes}",
    )
    done = min(len(x) for x in _losses(job.out))
    at_fault = job.records()
    job.lose("n1")
    outcome.injected_at = f"p killed mid-push at step {state.get('step')}; n1 lost at {done - 1}"
    _restart(outcome, job, ["n0", "n2"], state["at"], done)
    answers = [e for e in job.sidecar_events("n2") if e["event"].startswith("rehydrate")]
    outcome.check(
        "the recreated rank found no replica (its peer is gone)",
        [e["event"] for e in answers] == ["rehydrate_none"],
        str([(e["event"], e.get("why")) for e in answers])[:300],
    )
    _check_storage_resume(outcome, job, at_fault, done)
    _check_acknowledged(outcome, job, at_fault)
    _check_bitwise(outcome, job, ref)
    return outcome


# --------------------------------------------------------------------------- partition
@scenario(
    "partition",
    "#31 the peer unreachable (frozen): pushes time out, training goes on, replication resumes",
    expected_s=10,
)
def partition(ctx: FitContext) -> Outcome:
    metrics = free_port()
    outcome, ref, job = _setup(ctx, "partition", hold_at=STEPS - 4)
    peer, address = _peer_process(job, ctx)
    job.extra = {
        "peers": {"n1": address},
        "metrics_ports": {"n1": metrics},
        "timeout_s": PARTITION_TIMEOUT_S,
    }
    job.hold.touch()
    clock = StepClock(job.out)
    ctx.cleanups.append(clock.close)
    on_p, port = job.shm("p"), int(address.rsplit(":", 1)[1])
    state: dict[str, Any] = {}

    def partition_and_heal(running: Any) -> None:
        _wait("rank 1's replica on p", lambda: job.replica(on_p) is not None, 120, running.running)
        _wait("n1's metrics", lambda: bool(_pushes(metrics)), 30, running.running)
        failed = _pushes(metrics).get("failed", 0)
        os.kill(peer.pid, signal.SIGSTOP)  # p takes connections and never answers
        state["cut"], state["step"] = time.monotonic(), clock.steps()
        _wait("a push to p", lambda: _connected(port), 30, running.running)
        pushing = time.monotonic()
        _wait(
            "a push timing out",
            lambda: _pushes(metrics).get("failed", 0) > failed,
            PARTITION_TIMEOUT_S * 4,
            running.running,
        )
        state["timed_out"] = time.monotonic() - pushing
        healed = time.monotonic()
        state["gap"] = clock.max_gap(state["cut"], healed)
        os.kill(peer.pid, signal.SIGCONT)  # the partition heals
        newest = job.latest_step("n1")
        state["newest"] = newest

        def caught_up() -> bool:
            held = job.replica(on_p)
            return held is not None and newest is not None and held.desc.step >= newest

        _wait("the newest snapshot on p", caught_up, 60, running.running)
        state["healed_in"] = time.monotonic() - healed
        held = job.replica(on_p)
        state["held"] = None if held is None else held.desc.step
        job.hold.unlink()

    codes = job.launch(["n0", "n1"], during=partition_and_heal)
    outcome.injected_at = f"p frozen (SIGSTOP) at step {state.get('step')}"
    timed_out = state.get("timed_out")
    outcome.check(
        "a push to the unreachable peer timed out within its timeout",
        timed_out is not None and timed_out <= PARTITION_TIMEOUT_S + 1.0,
        f"failed {timed_out:.1f} s after it connected (timeout {PARTITION_TIMEOUT_S:g} s)"
        if timed_out is not None
        else "no failed push",
    )
    gap, steps = state.get("gap", (float("inf"), 0))
    outcome.check(
        "training went on during the partition without stalling",
        steps >= 2 and gap <= STALL_LIMIT_S,
        f"{steps} steps during it, longest gap {gap:.2f} s (limit {STALL_LIMIT_S} s)",
    )
    outcome.check(
        "replication resumed once healed: the newest snapshot reached the peer",
        state.get("held") is not None,
        f"rank 1's snapshot of step {state.get('newest')} on p {state.get('healed_in', 0):.1f} s"
        f" after the heal (p holds step {state.get('held')})",
    )
    outcome.check("the job finished", codes == [0] * WORLD, f"{codes} {job.errors()}")
    outcome.steps_lost = 0
    outcome.recovered_from = "-"
    _check_bitwise(outcome, job, ref)
    return outcome
