"""Issue #28, "done when": 50,000 garbage COMMITs of one tenant delay another tenant's
retention by at most one per-policy budget.

The operator's retention loop (:class:`~ckpt_operator.app.loops.RetentionLoop`) over the
real retention pass (:func:`~ckpt_operator.behaviours.retention.reconcile_retention`) and
real filesystem storage in temp dirs: tenant A's run holds 50,000 step folders whose
COMMIT is garbage (built once per module with plain os calls), tenant B's a few real
checkpoints and one garbage COMMIT. Budgets are small (2 s); the assertions are about
order and start times relative to the budget, not about speed.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.format.layout import validation_key
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.owner import RunOwner, claim_owner
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions
from ckpt_operator.adapters.sources import StorageCheckpointSource
from ckpt_operator.app.loops import RetentionLoop
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.behaviours.retention import reconcile_retention
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import OperatorConfig, RetentionConfig, parse_config

GARBAGE = 50_000
BUDGET_S = 2.0
TEAM_A, TEAM_B = "team-a", "team-b"
RUN_A, RUN_B = "garbage-run", "good-run"
POLICY = "llm-finetune"  # the recorded policy's name, in both namespaces


def _garbage(root: Path, run_id: str, steps: range) -> None:
    """Step folders holding only a COMMIT that is not JSON, with os calls (50,000: seconds)."""
    steps_dir = root / run_id / "steps"
    steps_dir.mkdir(parents=True, exist_ok=True)
    for step in steps:
        folder = steps_dir / checkpoint_id(Tier.PULSE, step)
        os.mkdir(folder)
        fd = os.open(folder / "COMMIT", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"\x00 garbage")
        os.close(fd)


def _checkpoints(storage: LocalStorage, run_id: str) -> None:
    """Three validated checkpoints (full 100, pulse 200, pulse 300)."""
    writer = CheckpointWriter(storage, run_id, codec=CodecPolicy(codec="none"))
    prev: str | None = None
    for step, tier in ((100, Tier.FULL), (200, Tier.PULSE), (300, Tier.PULSE)):
        meta = CheckpointMeta(run_id=run_id, step=step, tier=tier, created_at=1e9, prev_hash=prev)
        data = memoryview(step.to_bytes(8, "little"))
        rank = writer.write_rank(meta, 0, {"s": step}, [TensorSource("w", "uint8", (8,), data)])
        prev = writer.commit(meta, [rank]).manifest_hash
        verdict = ValidationVerdict(meta.checkpoint_id, prev, CheckpointStatus.VALID)
        storage.commit(validation_key(run_id, meta.checkpoint_id), verdict.to_bytes())


@pytest.fixture(scope="module")
def tenant_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tenant A's storage: one run with 50,000 garbage COMMITs (built once per module)."""
    root = tmp_path_factory.mktemp("tenant-a")
    _garbage(root, RUN_A, range(GARBAGE))
    claim_owner(LocalStorage(root), RUN_A, RunOwner(TEAM_A, "a", "uid-a", "agent", 1.0))
    return root


@pytest.fixture
def tenant_b(tmp_path: Path) -> Path:
    """Tenant B's storage: three valid checkpoints and one garbage COMMIT to delete."""
    root = tmp_path / "tenant-b"
    storage = LocalStorage(root)
    _checkpoints(storage, RUN_B)
    _garbage(root, RUN_B, range(150, 151))
    claim_owner(storage, RUN_B, RunOwner(TEAM_B, "b", "uid-b", "agent", 1.0))
    return root


def _setup(
    world: Any, fixture: Any, roots: dict[str, Path], workers: int, budget_s: float = BUDGET_S
) -> Deps:
    sources = {
        ns: StorageCheckpointSource(LocalStorage(root, StorageOptions(fsync=False)), gc_grace_s=0)
        for ns, root in roots.items()
    }

    async def factory(namespace: str, policy: str, spec: CheckpointPolicySpec) -> Any:
        return sources[namespace]

    for namespace, run_id in ((TEAM_A, RUN_A), (TEAM_B, RUN_B)):
        policy = fixture("checkpointpolicy.json")
        policy["metadata"]["namespace"] = namespace
        policy["spec"]["storage"] = {"type": "local", "local": {"path": str(roots[namespace])}}
        world.api.add_policy(policy)
        job = fixture("pytorchjob_failed.json")
        job["metadata"]["namespace"] = namespace
        job["metadata"]["annotations"][c.ANN_RUN_ID] = run_id
        world.api.add_job(job)
    retention = RetentionConfig(budget_s=budget_s, workers=workers)
    return Deps(
        api=world.api,
        events=world.events,
        metrics=world.metrics,
        sources=factory,
        config=replace(OperatorConfig(), retention=retention),
        clock=world.clock,
    )


Times = dict[str, tuple[float, float]]


def _loop(deps: Deps, times: Times) -> RetentionLoop:
    async def reconcile(policy: dict[str, Any]) -> object:
        ns = policy["metadata"]["namespace"]
        start = time.monotonic()
        try:
            return await reconcile_retention(deps, policy)
        finally:
            times[ns] = (start, time.monotonic())

    loop = RetentionLoop.from_config(reconcile, deps.config, clock=lambda: 0.0)
    for ns in (TEAM_A, TEAM_B):  # A falls due first: the worst case for B
        loop.upsert(deps.api.policies[(ns, POLICY)])  # type: ignore[attr-defined]
    return loop


def _condition(world: Any, namespace: str) -> dict[str, Any]:
    status = world.api.policies[(namespace, POLICY)]["status"]
    (cond,) = [x for x in status["conditions"] if x["type"] == "Reconciled"]
    return dict(cond)


def _b_is_done(world: Any, root: Path) -> None:
    cond = _condition(world, TEAM_B)
    assert cond["reason"] == "RetentionApplied", cond
    assert not (root / RUN_B / "steps" / checkpoint_id(Tier.PULSE, 150)).exists()


def _a_was_cut_short(world: Any) -> None:
    cond = _condition(world, TEAM_A)
    assert cond["reason"] == "RetentionCutShort", cond
    assert "--retention-budget" in cond["message"] and f"run {RUN_A}: listing" in cond["message"]
    assert any(e.reason == "RetentionCutShort" for e in world.events.events)


def test_one_worker_a_garbage_tenant_delays_another_by_at_most_one_budget(
    world: Any, fixture: Any, tenant_a: Path, tenant_b: Path
) -> None:
    """The worst case: one worker, the garbage tenant first. Its pass stops at its budget
    (listing 50,000 garbage COMMITs and deleting them would take far longer), then B's
    starts."""
    deps = _setup(world, fixture, {TEAM_A: tenant_a, TEAM_B: tenant_b}, workers=1)
    times: Times = {}
    loop = _loop(deps, times)
    assert asyncio.run(loop.run_due()) == 2
    (a_start, a_end), (b_start, _) = times[TEAM_A], times[TEAM_B]
    assert a_end <= b_start  # one worker: B waited for A
    # B's delay: A's budget, plus the unit of work in flight when it ran out and the
    # status write (the slack, well under a budget)
    assert b_start - a_start < BUDGET_S * 1.5, times
    _a_was_cut_short(world)
    _b_is_done(world, tenant_b)
    assert loop.timeouts == 0  # the pass stopped itself; the backstop was not needed


def test_workers_a_garbage_tenant_does_not_delay_another_at_all(
    world: Any, fixture: Any, tenant_a: Path, tenant_b: Path
) -> None:
    """With workers to spare, B's pass starts with A's and is over while A's still runs."""
    deps = _setup(world, fixture, {TEAM_A: tenant_a, TEAM_B: tenant_b}, workers=2)
    times: Times = {}
    loop = _loop(deps, times)
    assert asyncio.run(loop.run_due()) == 2
    (a_start, a_end), (b_start, b_end) = times[TEAM_A], times[TEAM_B]
    assert a_start <= b_start < a_end and b_end < a_end
    _a_was_cut_short(world)
    _b_is_done(world, tenant_b)


def test_a_cut_pass_resumes_and_the_garbage_shrinks_pass_after_pass(
    world: Any, fixture: Any, tmp_path: Path, tenant_b: Path
) -> None:
    """What a pass cut short left is done by the next ones. Cut here by the entry bound
    (deterministic: 300 entries a pass) on a smaller tenant: each pass deletes the
    garbage it saw, until none is left and the pass is whole again."""
    root = tmp_path / "small-a"
    _garbage(root, RUN_A, range(1000))
    claim_owner(LocalStorage(root), RUN_A, RunOwner(TEAM_A, "a", "uid-a", "agent", 1.0))
    deps = _setup(world, fixture, {TEAM_A: root, TEAM_B: tenant_b}, workers=2, budget_s=600)
    deps = replace(
        deps, config=replace(deps.config, retention=replace(deps.config.retention, max_entries=300))
    )
    policy = world.api.policies[(TEAM_A, POLICY)]
    steps = root / RUN_A / "steps"

    def left() -> int:
        return len(os.listdir(steps)) if steps.exists() else 0  # pruned once empty

    counts, reasons = [left()], []
    while counts[-1] and len(counts) < 10:
        asyncio.run(reconcile_retention(deps, policy))
        counts.append(left())
        reasons.append(_condition(world, TEAM_A)["reason"])
    # 299 whole folders a pass (the bound cuts through the 300th), the last pass whole
    assert counts == [1000, 701, 402, 103, 0], counts
    assert reasons == ["RetentionCutShort"] * 3 + ["RetentionApplied"]
    assert world.counter("ckpt_operator_retention_deletions_total") == 1000


# --------------------------------------------------------------------------- config


def test_the_budget_flags_and_their_defaults() -> None:
    base = ["--webhook=false"]
    d = parse_config(base, environ={}).retention
    assert (d.budget_s, d.workers, d.max_entries) == (60.0, 4, 100_000)
    assert d.gc_max_manifest_bytes == 8 << 20
    flags = [
        "--retention-budget=5",
        "--retention-workers=2",
        "--retention-max-entries=10",
        "--gc-max-manifest-bytes=1024",
    ]
    r = parse_config(base + flags, environ={}).retention
    assert (r.budget_s, r.workers, r.max_entries, r.gc_max_manifest_bytes) == (5, 2, 10, 1024)
    env = {"CKPT_OPERATOR_RETENTION_BUDGET": "7", "CKPT_OPERATOR_RETENTION_WORKERS": "3"}
    e = parse_config(base, environ=env).retention
    assert (e.budget_s, e.workers) == (7.0, 3)
    for bad in ("--retention-budget=0", "--retention-workers=0", "--retention-max-entries=0"):
        with pytest.raises(SystemExit, match="retention"):
            parse_config([*base, bad], environ={})


def test_the_operators_loop_takes_its_bounds_from_the_config() -> None:
    async def reconcile(policy: dict[str, Any]) -> None:
        return None

    cfg = replace(
        OperatorConfig(storage_timeout_s=30.0),
        retention=RetentionConfig(budget_s=60.0, workers=3, tick_s=5.0),
    )
    clock: Callable[[], float] = time.time
    loop = RetentionLoop.from_config(reconcile, cfg, clock=clock)
    assert loop.workers == 3 and loop.pass_timeout_s == 90.0
