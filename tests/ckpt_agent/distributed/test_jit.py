"""Just-in-time saves (#31): a rank of a 4-rank DDP job SIGKILLed mid-step costs one step.

Every rank records each step's RNG and data position in its shared-memory area
(``jitSave``). Rank 2 is killed in step ``STALL_AT`` between its forward and backward
pass, while the other ranks wait for it in the step's all-reduce; their all-reduce fails,
and each survivor writes step ``STALL_AT - 1`` — the last one every rank finished — to its
node's memory before it exits. The restart resumes every rank at ``STALL_AT``: the
survivors from their JIT snapshot, rank 2 with the replicated state of the first survivor
and its own step heartbeat. Pulses come every 5 steps, so without JIT the restart would go
back to step 15. Real gloo processes, real persisters.

The stitched losses and the final weights equal the uninterrupted run's, bit for bit (the
job's DDP wrapper does not rebuild its buckets: docs/distributed.md, "Bitwise with more
than two ranks").
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD, STEPS = 4, 24
STALL_AT, VICTIM = 18, 2
"""Rank ``VICTIM`` is killed in step ``STALL_AT``, after its forward pass."""
JIT = {"shm": True, "config": {"agent": {"jitSave": True}}, "backpressure": "wait"}


def _finals(out: Path) -> list[Any]:
    return [json.loads((out / f"final.rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run's losses and final weights."""
    out = tmp_path_factory.mktemp("jit-ref") / "job"
    codes = h.launch(w.train_ddp, WORLD, out, STEPS, {"checkpoint": False}, timeout=150)
    h.codes_ok(codes, out)
    return {"losses": [h.losses(out, r) for r in range(WORLD)], "final": _finals(out)}


def _kill_mid_step(
    tmp_path: Path, opts: dict[str, Any], ready: Callable[[], bool] = lambda: True
) -> Path:
    out = tmp_path / "job"
    out.mkdir(parents=True)
    (out / f"stall.rank{VICTIM}").touch()

    def kill_when_stalled(job: h.Job) -> None:
        deadline = time.monotonic() + 120
        while job.running() and time.monotonic() < deadline:
            if (out / f"stalled.rank{VICTIM}").exists() and ready():
                break
            time.sleep(0.01)
        time.sleep(0.3)  # the others reach the step's all-reduce and wait there
        job.kill(VICTIM)

    codes = h.launch(
        w.train_ddp, WORLD, out, STEPS, {**opts, "stall_at": STALL_AT}, timeout=150,
        during=kill_when_stalled,
    )  # fmt: skip
    assert codes[VICTIM] == -signal.SIGKILL, codes
    assert all(c not in (0, None) for c in codes), codes  # the survivors failed too
    for rank in range(WORLD):
        assert len(h.losses(out, rank)) == STALL_AT  # nobody finished the stalled step
    return out


def _jit_events(out: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted((out / "work").glob("decisions*.jsonl")):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e.get("event") == "jit_save":
                events.append(e)
    return events


@pytest.mark.parametrize("nodes", ["one node", "a node per rank"])
def test_a_rank_killed_mid_step_costs_one_step_and_the_run_stays_bitwise(
    tmp_path: Path, reference: dict[str, Any], nodes: str
) -> None:
    opts = {**JIT, "shm_per_rank": nodes == "a node per rank"}
    out = _kill_mid_step(tmp_path, opts)
    saved = [e for e in _jit_events(out) if e["outcome"] == "saved"]
    assert sorted(e["step"] for e in saved) == [STALL_AT - 1] * (WORLD - 1), _jit_events(out)

    h.codes_ok(h.launch(w.train_ddp, WORLD, out, STEPS, opts, timeout=150), out)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["action"] for r in resumed] == ["resume_shm"] * WORLD, resumed
    assert [r["step"] for r in resumed] == [STALL_AT] * WORLD  # only the failed step lost
    assert all(r["exact"] for r in resumed), resumed
    assert [h.losses(out, r) for r in range(WORLD)] == reference["losses"]
    assert _finals(out) == reference["final"]


def test_without_jit_the_same_failure_goes_back_to_the_last_pulse(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    opts = {"shm": True, "backpressure": "wait"}
    out = _kill_mid_step(tmp_path, opts)
    assert _jit_events(out) == []
    h.codes_ok(h.launch(w.train_ddp, WORLD, out, STEPS, opts, timeout=150), out)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(WORLD)]
    assert len({r["step"] for r in resumed}) == 1 and resumed[0]["step"] < STALL_AT - 1, resumed
    assert [h.losses(out, r) for r in range(WORLD)] == reference["losses"]
    assert _finals(out) == reference["final"]
