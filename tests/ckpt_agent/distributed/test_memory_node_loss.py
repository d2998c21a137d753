"""A lost node's ranks resume from their peer's replica of a memory-tier snapshot (#31).

Real gloo DDP jobs whose nodes are shared-memory directories, each with its sidecar (a
thread of the node's first rank) pushing every snapshot to the next node. The memory tier
snapshots every 2 steps, the pulse every 10. The job is held at step 15, after the memory
snapshot of step 14; once that snapshot of every rank of node n1 is on n0, every process
is SIGKILLed and n1 is lost with its memory. The job restarts with n1's ranks on a new
node n2: n0's ranks resume in place from their own memory, n2's from n0's replicas, all at
step 15 — storage's newest being the pulse of step 10 — and the run ends bitwise equal to
an uninterrupted one. Two layouts: 2 nodes × 1 rank and 2 nodes × 2 ranks.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest

from ckpt_agent.flash.replica.store import ReplicaStore
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.storage.fs import LocalStorage
from ckpt_e2e.api import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

STEPS, HOLD = 20, 15
TIERS = {
    "heartbeat": {"everySteps": 1000},
    "pulse": {"baseInterval": 10, "minInterval": 10, "maxInterval": 10},
    "full": {"everySteps": 1000},
    "memory": {"enabled": True, "everySteps": 2},
}
LAYOUTS = {"2 nodes x 1 rank": ["n0", "n1"], "2 nodes x 2 ranks": ["n0", "n0", "n1", "n1"]}


def _finals(out: Path, world: int) -> list[Any]:
    return [json.loads((out / f"final.rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    refs = {}
    for world in (2, 4):
        out = tmp_path_factory.mktemp(f"memory-node-ref{world}") / "job"
        h.codes_ok(h.launch(w.train_ddp, world, out, STEPS, {"checkpoint": False}), out)
        refs[world] = {
            "losses": [h.losses(out, r) for r in range(world)],
            "final": _finals(out, world),
        }
    return refs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_lost_nodes_ranks_resume_from_the_memory_tier_replica_bitwise(
    tmp_path: Path, references: dict[int, dict[str, Any]], layout: str
) -> None:
    nodes = LAYOUTS[layout]
    world = len(nodes)
    lost = [r for r, n in enumerate(nodes) if n == "n1"]
    ports = {n: free_port() for n in ("n0", "n1", "n2")}
    opts: dict[str, Any] = {"config": {"tiers": TIERS}, "hold_at": HOLD}
    out = tmp_path / "job"
    out.mkdir(parents=True)
    (out / "hold").touch()
    on_n0 = ReplicaStore(tmp_path / "shm.n0", w.RUN)

    def replicated() -> bool:  # the memory snapshot of step 14 of n1's every rank
        held = {(r.source, r.desc.rank, r.desc.step) for r in on_n0.replicas()}
        return all(("n1", r, HOLD - 1) in held for r in lost)

    def lose_n1_when_replicated(job: h.Job) -> None:
        deadline = time.monotonic() + 150
        while job.running() and not replicated():
            assert time.monotonic() < deadline, "n1's memory snapshot never reached n0"
            time.sleep(0.02)
        for rank in range(world):  # every process: n1 is lost, n0's ranks restart
            job.kill(rank)

    first = {**opts, "replicated": {"nodes": nodes, "ports": ports}}
    codes = h.launch(
        w.train_ddp, world, out, STEPS, first, timeout=200, during=lose_n1_when_replicated
    )
    assert codes == [-signal.SIGKILL] * world, (codes, h.Job([], out, 0).errors())
    shutil.rmtree(tmp_path / "shm.n1")  # the node is lost with its memory
    stored = [r.step for r in list_checkpoints(LocalStorage(tmp_path / "store"), w.RUN)]
    assert max(stored) == 10, stored  # memory snapshots never reach storage

    (out / "hold").unlink()
    moved = ["n2" if n == "n1" else n for n in nodes]
    again = {**opts, "replicated": {"nodes": moved, "ports": ports}}
    h.codes_ok(h.launch(w.train_ddp, world, out, STEPS, again, timeout=200), out)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(world)]
    assert [(r["action"], r["step"], r["exact"]) for r in resumed] == [
        ("resume_shm", HOLD, True)
    ] * world, resumed  # the memory tier's snapshot of step 14: nothing after it lost
    ref = references[world]
    assert [h.losses(out, r) for r in range(world)] == ref["losses"]
    assert _finals(out, world) == ref["final"]
    events = (out / "work.sidecar.n2" / "sidecar.jsonl").read_text().splitlines()
    installed = [e for e in map(json.loads, events) if e["event"] == "rehydrated"]
    assert sorted((e["rank"], e["step"]) for e in installed) == [(r, HOLD - 1) for r in lost]
