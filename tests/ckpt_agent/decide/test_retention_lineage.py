"""Retention's "newest" is by resume lineage first, then step (issue #26): a rewind's new
lineage holds the newer checkpoints even when their step numbers are lower."""

from __future__ import annotations

from ckpt_agent.decide.retention import plan_retention
from ckpt_agent.policy.models import RetentionSpec, Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Lineage


def _rec(step: int, epoch: int, t: float) -> CheckpointRecord:
    return CheckpointRecord(
        id=f"full_step_{step:012d}",
        step=step,
        tier=Tier.FULL,
        status=CheckpointStatus.VALID,
        created_at=t,
        lineage=Lineage(epoch=epoch),
    )


def test_a_newer_lineage_with_lower_steps_is_kept_over_the_old_one() -> None:
    old = [_rec(4, 0, 1.0), _rec(6, 0, 2.0)]
    new = [_rec(2, 1, 3.0), _rec(3, 1, 4.0)]
    plan = plan_retention(old + new, RetentionSpec(routine_keep=2))
    assert set(plan.keep) == {r.id for r in new}
    assert set(plan.delete) == {r.id for r in old}
    assert plan.deletion_order == ("full_step_000000000006", "full_step_000000000004")
