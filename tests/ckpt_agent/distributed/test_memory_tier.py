"""The memory tier with real ranks (#31): snapshots into shared memory between the durable
pulses, never written to storage, and an in-place restart that resumes from the newest one.

A 2-rank gloo DDP job (dropout, AdamW, StepLR, a data position) with flash snapshots, a
pulse every 10 steps and a memory-tier snapshot every 2. Both ranks SIGKILL themselves
right after a memory-tier snapshot at a random step past the pulse; the restart resumes
every rank from that snapshot (storage's newest is the pulse, up to 7 steps older) and the
stitched run is bitwise the uninterrupted one.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest

from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy.models import Tier
from ckpt_agent.storage.fs import LocalStorage

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 22
EVERY = 2
TIERS = {
    "heartbeat": {"everySteps": 1000},
    "pulse": {"baseInterval": 10, "minInterval": 10, "maxInterval": 10},
    "full": {"everySteps": 1000},
    "memory": {"enabled": True, "everySteps": EVERY},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("memory-ref") / "job"
    h.codes_ok(h.launch(w.train_ddp, 2, out, STEPS, {"checkpoint": False}, timeout=120), out)
    return {
        "losses": [h.losses(out, r) for r in range(2)],
        "final": [json.loads((out / f"final.rank{r}.json").read_text()) for r in range(2)],
    }


def _wait_persisters(out: Path) -> None:
    for rank in range(2):
        pid = int((out / "work" / f"sidecar.rank{rank}.pid").read_text())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists(), f"the persister of rank {rank} still runs"


def test_a_kill_after_a_memory_snapshot_resumes_from_it_bitwise(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    die_at = random.Random().randint(11, 17)  # a random step past the pulse at 10
    why = f"killed after the first memory snapshot at or after step {die_at}"
    opts: dict[str, Any] = {"shm": True, "config": {"tiers": TIERS}}
    out = tmp_path / "job"
    codes = h.launch(
        w.train_ddp,
        2,
        out,
        STEPS,
        {**opts, "die_rank": "all", "die_after_save_at": die_at, "die_after": "memory"},
    )
    assert all(c is not None and c != 0 for c in codes), (codes, why)
    died = int((out / "died_after.txt").read_text())
    assert died >= die_at, why
    _wait_persisters(out)
    for rank in range(2):
        latest = ShmReader(tmp_path / "shm", w.RUN, rank).latest()
        assert latest is not None and latest.memory_only and latest.step == died, why
    stored = [
        r.step
        for r in list_checkpoints(LocalStorage(tmp_path / "store"), w.RUN)
        if r.tier != Tier.HEARTBEAT
    ]
    assert stored and max(stored) < died, (stored, why)  # never written to storage
    assert died - max(stored) <= 10, why

    h.codes_ok(h.launch(w.train_ddp, 2, out, STEPS, opts, timeout=120), out)
    for rank in range(2):
        resumed = json.loads((out / f"resume.rank{rank}.json").read_text())
        assert (resumed["action"], resumed["step"], resumed["exact"]) == (
            "resume_shm",
            died + 1,
            True,
        ), (resumed, why)
        assert h.losses(out, rank) == reference["losses"][rank], why
        final = json.loads((out / f"final.rank{rank}.json").read_text())
        assert final == reference["final"][rank], why
    work = out / "work"
    lines = [json.loads(x) for x in (work / "decisions.rank0.jsonl").read_text().splitlines()]
    memory = [e["step"] for e in lines if e.get("event") == "snapshot" and e.get("memory_only")]
    assert memory and all(s % EVERY == 0 for s in memory), memory
