"""Who holds a generation in a checkpointer: rank 0 claims before the resume, the other
ranks follow rank 0's claim after it, a flash trainer holds nothing (its sidecar claims)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ckpt_agent.errors import FencedError
from ckpt_agent.format.fence import claim, generations
from ckpt_agent.format.termination import TerminationLog, parse_report
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.runtime.save.fencing import claim_writer, follow_writer
from ckpt_agent.storage.fs import LocalStorage


def _engine(
    store: LocalStorage, rank: int, distributed: bool, report: TerminationLog | None = None
) -> Any:
    return SimpleNamespace(
        storage=store,
        run_id="run1",
        ranks=SimpleNamespace(coordinator=rank == 0, distributed=distributed),
        parts=SimpleNamespace(
            writer=SimpleNamespace(fence=None), finalizer=SimpleNamespace(fence=None, report=report)
        ),
        event=lambda *a, **k: None,
    )


def test_rank0_claims_and_the_other_ranks_follow(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "s")
    r0, r1 = _engine(store, 0, True), _engine(store, 1, True)
    assert follow_writer(r0, persists_here=True) is None  # rank 0 claims, never follows
    assert claim_writer(r1, persists_here=True) is None  # only rank 0 claims
    f0 = claim_writer(r0, persists_here=True)
    f1 = follow_writer(r1, persists_here=True)
    assert f0 is not None and f1 is not None
    assert f0.generation == f1.generation == 1 and generations(store, "run1") == [1]
    assert r1.parts.writer.fence is f1 and r0.parts.finalizer.fence is f0
    claim(store, "run1")  # the restarted job: every rank of the old one is fenced
    for f in (f0, f1):
        with pytest.raises(FencedError):
            cast(Any, f).check()


def test_a_flash_trainer_and_a_lone_rank_hold_nothing(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "s")
    assert claim_writer(_engine(store, 0, False), persists_here=False) is None
    claim(store, "run1")
    assert follow_writer(_engine(store, 1, True), persists_here=False) is None
    assert follow_writer(_engine(store, 1, False), persists_here=True) is None
    assert generations(store, "run1") == [1]


def test_a_fenced_writer_says_so_in_its_termination_report(tmp_path: Path) -> None:
    """The operator tells a fenced exit from a crash by the report (#28): every rank's
    report names the holder (generation, pod, node) and keeps the last checkpoints."""
    store = LocalStorage(tmp_path / "s")
    logs = [TerminationLog(tmp_path / f"term-{r}") for r in (0, 1)]
    r0, r1 = (_engine(store, r, True, logs[r]) for r in (0, 1))
    valid = CheckpointRecord(
        id="full_step_5", step=5, tier=Tier.FULL, status=CheckpointStatus.VALID, created_at=1.0
    )
    logs[0].write("run1", [valid])
    f0, f1 = claim_writer(r0, persists_here=True), follow_writer(r1, persists_here=True)
    assert f0 is not None and f1 is not None
    f0.check()  # holding: nothing reported
    assert parse_report((tmp_path / "term-0").read_text()).fenced is None
    claim(store, "run1", environ={"CKPT_POD_NAME": "llm-r1-worker-0", "CKPT_NODE_NAME": "n2"})
    for f in (f0, f1):
        for _ in range(2):  # sticky; reported once
            with pytest.raises(FencedError):
                f.check()
    for r in (0, 1):
        report = parse_report((tmp_path / f"term-{r}").read_text())
        assert report.run_id == "run1" and report.fenced is not None
        assert (report.fenced.generation, report.fenced.holder) == (1, 2)
        assert (report.fenced.pod, report.fenced.node) == ("llm-r1-worker-0", "n2")
        assert report.fenced.describe() == "generation 2, pod llm-r1-worker-0 on node n2"
    assert [c.step for c in parse_report((tmp_path / "term-0").read_text()).checkpoints] == [5]
    logs[0].write("run1", [valid])  # a later rewrite (a verdict) still says fenced
    assert parse_report((tmp_path / "term-0").read_text()).fenced is not None
