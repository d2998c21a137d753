"""A retention pass bounded by its budget (issue #28): it stops between whole checkpoint
deletions, says so (condition and Event), keeps what it could not look at, and never lets
the blob GC parse a rank manifest over the operator's limit."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

from ckpt_agent.format.owner import RunOwner, claim_owner
from ckpt_agent.persist.housekeeping import GcResult
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage
from ckpt_operator.adapters.sources import StorageCheckpointSource
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.behaviours.retention import DELETE_BATCH, DELETE_CHUNK, reconcile_retention
from ckpt_operator.model import constants as c
from ckpt_operator.planners.retention_plan import PassBudget

NS = "ml-team"


class Clock:
    """Seconds that pass only when a checkpoint is deleted (one each)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        with self.lock:
            self.now += 1.0


def _job(fixture: Any, name: str, run_id: str) -> dict[str, Any]:
    job: dict[str, Any] = fixture("pytorchjob_failed.json")
    job["metadata"]["name"] = name
    job["metadata"]["uid"] = f"uid-{name}"
    job["metadata"]["annotations"][c.ANN_RUN_ID] = run_id
    return job


def _condition(world: Any) -> dict[str, Any]:
    status = world.api.policies[(NS, "llm-finetune")]["status"]
    (cond,) = [x for x in status["conditions"] if x["type"] == "Reconciled"]
    return dict(cond)


def test_a_pass_stops_between_deletions_at_its_budget_small_runs_first(
    world: Any, fixture: Any, rec: Any
) -> None:
    clock = Clock()
    real_delete = world.source.delete_checkpoint

    def delete(run_id: str, ckpt_id: str) -> None:
        real_delete(run_id, ckpt_id)
        clock.tick()

    world.source.delete_checkpoint = delete
    garbage = [rec("pulse", s, status=CheckpointStatus.CORRUPTED) for s in range(250)]
    world.source.runs["a-garbage"] = [*garbage, rec("full", 1000)]
    world.source.runs["b-small"] = [
        rec("pulse", 1, status=CheckpointStatus.CORRUPTED),
        rec("pulse", 2, status=CheckpointStatus.CORRUPTED),
        rec("full", 10),
    ]
    world.api.add_job(_job(fixture, "job-a", "a-garbage"))
    world.api.add_job(_job(fixture, "job-b", "b-small"))
    budget = PassBudget(50.0, None, clock=clock)
    policy = fixture("checkpointpolicy.json")
    status = asyncio.run(reconcile_retention(world.deps, policy, budget=budget))
    deleted = world.source.deleted
    # the small run first (whole), then the garbage run a chunk at a time until the clock
    # reached 50: the chunk begun before then is finished (whole checkpoints), no other
    small = [("b-small", checkpoint_id(Tier.PULSE, s)) for s in (2, 1)]  # newest first
    assert deleted[:2] == small
    n = 2 + DELETE_CHUNK * -(-48 // DELETE_CHUNK)
    assert len(deleted) == n and {r for r, _ in deleted[2:]} == {"a-garbage"}
    assert deleted[2:] == [
        ("a-garbage", checkpoint_id(Tier.PULSE, s)) for s in range(249, 251 - n, -1)
    ]
    assert status is not None and status["deletedByRetention"] == n
    cond = _condition(world)
    assert cond["status"] == "False" and cond["reason"] == "RetentionCutShort"
    assert f"{n} of 252 planned deletion(s) done" in cond["message"]
    assert f"{252 - n} deletion(s) left for the next pass" in cond["message"]
    assert world.events.reasons() == ["RetentionApplied", "RetentionCutShort"]
    assert world.source.gc_runs == ["b-small"]  # right after its deletions; a-garbage: no time
    # the next pass (a fresh budget) goes on where this one stopped
    asyncio.run(reconcile_retention(world.deps, policy, budget=PassBudget(None, None)))
    assert len(world.source.deleted) == 252
    assert _condition(world)["reason"] == "RetentionApplied"


def test_runs_not_reached_keep_their_last_valid(world: Any, fixture: Any, rec: Any) -> None:
    world.source.runs["r1"] = [rec("full", 10)]
    world.source.runs["r2"] = [rec("full", 20)]
    world.api.add_job(_job(fixture, "job-1", "r1"))
    world.api.add_job(_job(fixture, "job-2", "r2"))
    policy = fixture("checkpointpolicy.json")
    asyncio.run(reconcile_retention(world.deps, policy, budget=PassBudget(None, None)))
    before = world.api.policies[(NS, "llm-finetune")]["status"]["lastValid"]
    assert set(before) == {"r1", "r2"}
    spent = PassBudget(0.0, None)  # nothing left from the start
    status = asyncio.run(reconcile_retention(world.deps, policy, budget=spent))
    assert status is not None and status["lastValid"] == before
    assert world.source.listed.count(("r1", False)) == 1
    cond = _condition(world)
    assert (
        cond["reason"] == "RetentionCutShort"
        and "not listed this pass: r1, r2" in (cond["message"])
    )


class _SpyGc(StorageCheckpointSource):
    gc_runs: list[str]

    def collect_garbage(self, run_id: str) -> GcResult:
        self.gc_runs.append(run_id)
        return super().collect_garbage(run_id)


def test_no_blob_gc_over_a_rank_manifest_past_the_limit(
    world: Any, fixture: Any, tmp_path: Path
) -> None:
    """A 24 MiB rank manifest (sparse: no disk) beside a garbage COMMIT to delete: the pass
    deletes the garbage, refuses the GC naming the manifest and the flag, parses nothing."""
    root = tmp_path / "store"
    steps = root / "big-run" / "steps"
    for step in (1, 2):
        (steps / checkpoint_id(Tier.PULSE, step)).mkdir(parents=True)
    (steps / checkpoint_id(Tier.PULSE, 1) / "COMMIT").write_bytes(b"garbage")
    with open(steps / checkpoint_id(Tier.PULSE, 2) / "rank_00000.json", "wb") as f:
        os.truncate(f.fileno(), 24 << 20)
    storage = LocalStorage(root)
    claim_owner(storage, "big-run", RunOwner(NS, "job-big", "uid", "agent", 1.0))
    source = _SpyGc(storage, gc_grace_s=0)
    source.gc_runs = []

    async def factory(namespace: str, policy: str, spec: Any) -> Any:
        return source

    deps = Deps(
        api=world.api,
        events=world.events,
        metrics=world.metrics,
        sources=factory,
        config=world.deps.config,
        clock=world.clock,
    )
    world.api.add_job(_job(fixture, "job-big", "big-run"))
    asyncio.run(reconcile_retention(deps, fixture("checkpointpolicy.json")))
    assert not (steps / checkpoint_id(Tier.PULSE, 1)).exists()  # the garbage went
    assert source.gc_runs == []  # the 24 MiB manifest was never parsed
    cond = _condition(world)
    assert cond["reason"] == "StorageErrors"
    assert "rank_00000.json is 24.0 MiB, over the operator's limit of 8.0 MiB" in cond["message"]
    assert "--gc-max-manifest-bytes" in cond["message"]
    assert "RetentionErrors" in world.events.reasons()


def test_batches_are_whole_checkpoints_of_one_run(world: Any, fixture: Any, rec: Any) -> None:
    """Every planned deletion is done, DELETE_BATCH checkpoints per worker-thread call."""
    threads: dict[int, list[str]] = {}
    real_delete = world.source.delete_checkpoint

    def delete(run_id: str, ckpt_id: str) -> None:
        threads.setdefault(threading.get_ident(), []).append(run_id)
        real_delete(run_id, ckpt_id)

    world.source.delete_checkpoint = delete
    n = DELETE_BATCH + 5
    world.source.runs["r"] = [
        *(rec("pulse", s, status=CheckpointStatus.CORRUPTED) for s in range(n)),
        rec("full", 10**6),
    ]
    world.api.add_job(_job(fixture, "job-r", "r"))
    asyncio.run(reconcile_retention(world.deps, fixture("checkpointpolicy.json")))
    assert len(world.source.deleted) == n


def test_real_storage_gets_a_chunks_commits_in_one_batched_delete(
    world: Any, fixture: Any, tmp_path: Path
) -> None:
    """25 garbage checkpoints: 3 batched COMMIT deletes (S3: 3 DeleteObjects), not 25."""
    root = tmp_path / "store"
    for step in range(25):
        folder = root / "g-run" / "steps" / checkpoint_id(Tier.PULSE, step)
        folder.mkdir(parents=True)
        (folder / "COMMIT").write_bytes(b"garbage")
    calls: list[int] = []

    class Counting(LocalStorage):
        def delete_many(self, keys: Any) -> int:
            keys = list(keys)
            calls.append(len(keys))
            return super().delete_many(keys)

    storage = Counting(root)
    claim_owner(storage, "g-run", RunOwner(NS, "job-g", "uid", "agent", 1.0))
    source = StorageCheckpointSource(storage, gc_grace_s=0)

    async def factory(namespace: str, policy: str, spec: Any) -> Any:
        return source

    deps = Deps(
        api=world.api,
        events=world.events,
        metrics=world.metrics,
        sources=factory,
        config=world.deps.config,
        clock=world.clock,
    )
    world.api.add_job(_job(fixture, "job-g", "g-run"))
    asyncio.run(reconcile_retention(deps, fixture("checkpointpolicy.json")))
    assert calls[:3] == [DELETE_CHUNK, DELETE_CHUNK, 25 - 2 * DELETE_CHUNK]
    assert not (root / "g-run" / "steps").exists()
