"""The job the replica FIT scenarios (:mod:`.replicas`) run, and the checks they share.

The job is the distributed tests' (``tests/ckpt_agent/distributed``: ``ckpt_dist_workers.
train_ddp``, launched by ``ckpt_dist_harness.launch``): 2 ranks, one per "node"; a node is
a shared-memory directory ``shm.<node>`` with its sidecar (a thread of its rank's process,
so it dies with the node) pushing every snapshot to its peer (:class:`NodeJob`). Where a
scenario must kill or freeze the peer alone, rank 1's peer is a bare replica server in its
own process (:func:`peer_process`). :class:`StepClock` times rank 1's steps (stalls);
``check_*`` are the checks every scenario ends with.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
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
from .core import FitContext, Outcome

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


def dist() -> tuple[ModuleType, ModuleType]:
    """The distributed tests' launcher and rank programs (``ckpt_dist_harness``,
    ``ckpt_dist_workers``), their folder put on ``sys.path`` first."""
    if str(DIST_DIR) not in sys.path:
        sys.path.insert(0, str(DIST_DIR))
    return importlib.import_module("ckpt_dist_harness"), importlib.import_module(
        "ckpt_dist_workers"
    )


def reference(ctx: FitContext) -> dict[str, Any]:
    """The uninterrupted run (every rank's losses, final parameters), shared by the scenarios."""

    def start() -> dict[str, Any]:
        h, w = dist()
        out = ctx.work_dir.parent / "replicas-reference" / "job"
        h.codes_ok(h.launch(w.train_ddp, WORLD, out, STEPS, {"checkpoint": False}), out)
        return {"losses": losses(out), "final": finals(out)}

    got: dict[str, Any] = ctx.shared("replicas-reference", start, lambda _: None)
    return got


def losses(out: Path) -> list[dict[int, str]]:
    h, _ = dist()
    return [h.losses(out, r) for r in range(WORLD)]


def finals(out: Path) -> list[Any]:
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
        h, w = dist()
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


def setup(ctx: FitContext, name: str, **kw: Any) -> tuple[Outcome, dict[str, Any], NodeJob]:
    """A scenario's outcome, the reference run and its job (in the scenario's folder)."""
    ref = reference(ctx)
    job = NodeJob(ctx.work_dir, **kw)
    return Outcome(name), ref, job


def wait_for(
    what: str, ready: Callable[[], bool], timeout: float, alive: Callable[[], bool]
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or not alive():
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.01)


def kill_all(job: Any) -> None:
    """SIGKILL the lost node's rank first, then the other (its collective would fail)."""
    job.kill(1)
    job.kill(0)


def restart(
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


def check_bitwise(outcome: Outcome, job: NodeJob, ref: dict[str, Any]) -> None:
    got, want = losses(job.out), ref["losses"]
    equal = got == want and finals(job.out) == ref["final"]
    differ = [s for r in range(WORLD) for s in want[r] if got[r].get(s) != want[r][s]]
    outcome.loss_delta = 0.0 if equal else None
    outcome.check(
        "losses and final parameters bitwise the uninterrupted run's",
        equal,
        "every step of every rank and both final hashes"
        if equal
        else f"steps differing: {differ[:8]}",
    )


def check_acknowledged(outcome: Outcome, job: NodeJob, at_fault: list[CheckpointRecord]) -> None:
    now = {r.id: r.status for r in job.records()}
    acknowledged = [r.id for r in at_fault if r.status == CheckpointStatus.VALID]
    lost = [c for c in acknowledged if now.get(c) != CheckpointStatus.VALID]
    outcome.check(
        "no acknowledged checkpoint lost",
        bool(acknowledged) and not lost,
        f"{len(acknowledged)} valid at the fault; lost: {lost}",
    )


def check_fell_back_to_storage(
    outcome: Outcome,
    job: NodeJob,
    ref: dict[str, Any],
    at_fault: list[CheckpointRecord],
    done: int,
    title: str,
    *,
    why_has: str = "",
) -> None:
    """A restart whose recreated rank (on n2) got no replica (the answer's reason naming
    ``why_has``): every rank took storage's ladder, nothing acknowledged lost, bitwise."""
    answers = [e for e in job.sidecar_events("n2") if e["event"].startswith("rehydrate")]
    outcome.check(
        title,
        [e["event"] for e in answers] == ["rehydrate_none"]
        and why_has in str(answers[0].get("why")),
        str([(e["event"], e.get("why")) for e in answers])[:300],
    )
    check_storage_resume(outcome, job, at_fault, done)
    check_acknowledged(outcome, job, at_fault)
    check_bitwise(outcome, job, ref)


def check_storage_resume(
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


def peer_process(job: NodeJob, ctx: FitContext) -> tuple[subprocess.Popen[str], str]:
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


def pushes(port: int) -> dict[str, float]:
    """Node n1's sidecar's ``ckpt_sidecar_replica_pushes_total`` by outcome ({} if down)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {m[1]: float(m[2]) for m in _PUSHES.finditer(text)}


def connected(port: int) -> bool:
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
