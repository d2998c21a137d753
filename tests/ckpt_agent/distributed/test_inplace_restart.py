"""In-place restarts from shared memory with several ranks (real gloo jobs, real persisters).

Both ranks of a DDP job are SIGKILLed right after a shared-memory snapshot; their
persisters write it. The restart restores every rank from memory — the same save on every
rank, checked — or, when one rank's snapshot is unusable, every rank from storage. Either
way the stitched run is bitwise the uninterrupted one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest

from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage.fs import LocalStorage

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 20


_losses = h.losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("inplace-ref") / "job"
    h.codes_ok(h.launch(w.train_ddp, 2, out, STEPS, {"checkpoint": False}, timeout=120), out)
    return {
        "losses": [_losses(out, r) for r in range(2)],
        "final": [json.loads((out / f"final.rank{r}.json").read_text()) for r in range(2)],
    }


def _kill_both_after_a_snapshot(tmp_path: Path, opts: dict[str, Any]) -> int:
    """Run until both ranks SIGKILL themselves after an agreed snapshot; wait until the
    persisters wrote it and exited. Returns the newest snapshot's step."""
    out = tmp_path / "job"
    codes = h.launch(
        w.train_ddp,
        2,
        out,
        STEPS,
        {**opts, "die_rank": "all", "die_after_save_at": 8, "backpressure": "wait"},
    )
    assert all(c is not None and c != 0 for c in codes), codes
    for rank in range(2):
        pid = int((out / "work" / f"sidecar.rank{rank}.pid").read_text())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists(), f"the persister of rank {rank} is still running"
    steps = []
    for rank in range(2):
        area = ShmReader(_shm(tmp_path, rank, opts), w.RUN, rank)
        latest = area.latest()
        assert latest is not None and area.hashes(latest.slot, latest.seq) is not None
        steps.append(latest.step)
    assert steps[0] == steps[1], steps
    newest = [
        r
        for r in list_checkpoints(LocalStorage(tmp_path / "store"), w.RUN)
        if r.tier != Tier.HEARTBEAT
    ][-1]
    assert (newest.step, newest.status) == (steps[0], CheckpointStatus.VALID)
    return steps[0]


def _shm(tmp_path: Path, rank: int, opts: dict[str, Any]) -> Path:
    return tmp_path / (f"shm.rank{rank}" if opts.get("shm_per_rank") else "shm")


def _restart(
    tmp_path: Path, opts: dict[str, Any], reference: dict[str, Any]
) -> list[dict[str, Any]]:
    out = tmp_path / "job"
    h.codes_ok(h.launch(w.train_ddp, 2, out, STEPS, opts, timeout=120), out)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        assert _losses(out, rank) == reference["losses"][rank]
        assert json.loads((out / f"final.rank{rank}.json").read_text()) == reference["final"][rank]
    return resumed


def _events(tmp_path: Path, rank: int) -> list[dict[str, Any]]:
    path = tmp_path / "job" / "work" / f"decisions.rank{rank}.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [e for e in lines if e.get("event") == "inplace_restore"]


@pytest.mark.parametrize("nodes", ["one node", "a node per rank"])
def test_every_rank_restores_the_same_snapshot_from_memory(
    tmp_path: Path, reference: dict[str, Any], nodes: str
) -> None:
    """One node: rank 1 copies rank 0's shared state from rank 0's area. A node per rank
    (separate shared-memory directories): rank 0 broadcasts its checked copy."""
    opts = {"shm": True, "shm_per_rank": nodes != "one node"}
    step = _kill_both_after_a_snapshot(tmp_path, opts)
    resumed = _restart(tmp_path, opts, reference)
    for r in resumed:
        assert (r["action"], r["step"], r["exact"]) == ("resume_shm", step + 1, True), r
    for rank in range(2):
        assert [e["outcome"] for e in _events(tmp_path, rank)][-1] == "memory"


def test_one_ranks_corrupted_snapshot_sends_every_rank_to_storage(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    opts = {"shm": True}
    step = _kill_both_after_a_snapshot(tmp_path, opts)
    area = ShmReader(_shm(tmp_path, 1, opts), w.RUN, 1)
    latest = area.latest()
    assert latest is not None
    t = latest.tensors["rng/torch_cpu"]
    with open(area.data_path(latest.slot), "r+b") as f:  # one flipped bit in rank 1's RNG
        f.seek(t.offset + 100)
        b = f.read(1)
        f.seek(t.offset + 100)
        f.write(bytes([b[0] ^ 0x01]))
    resumed = _restart(tmp_path, opts, reference)
    for r in resumed:
        assert (r["action"], r["step"], r["exact"]) == ("resume", step + 1, True), r
    for rank in range(2):
        last = _events(tmp_path, rank)[-1]
        assert last["outcome"] == "storage" and "rank 1:" in last["reason"], last
