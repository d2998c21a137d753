"""Several ranks resume alike: rank 0 chooses, every rank restores exactly its choice.

:func:`agreed_resume_point` is what :meth:`Checkpointer.start
<ckpt_agent.runtime.checkpointer.Checkpointer.start>` runs with several ranks (after an
in-place restart from shared memory declined): rank 0 walks its
:meth:`~ckpt_agent.runtime.restore.restorer.Restorer.resume_point` and broadcasts the
choice (:class:`~ckpt_agent.runtime.restore.resume_point.ResumeRequest`: checkpoint,
weights source, action, the lineage the new checkpoints carry) over the rank group's
control group; every other rank restores exactly that checkpoint, or fails loudly with
rank 0's reason. Collective: every rank calls it once.
"""

from __future__ import annotations

from ckpt_agent.errors import ResumeError
from ckpt_agent.runtime.dist.rank_group import RankGroup
from ckpt_agent.runtime.restore.restorer import Restorer
from ckpt_agent.runtime.restore.resume_point import ResumePoint, ResumeRequest

__all__ = ["agreed_resume_point"]


def agreed_resume_point(restorer: Restorer, group: RankGroup) -> ResumePoint:
    """Rank 0 walks the ladder; every rank restores exactly its choice (collective)."""
    assert group.ready
    if group.engine.ranks.coordinator:
        try:
            point = restorer.resume_point()
        except BaseException as e:
            group.broadcast({"ok": False, "error": f"{type(e).__name__}: {e}"})
            raise
        if point.checkpoint_id is None:
            group.broadcast({"ok": True, "id": None, "reason": point.reason})
        else:
            choice = ResumeRequest(
                checkpoint_id=point.checkpoint_id,
                weights_from=restorer.weights_from,
                action=point.action,
                lineage=point.lineage,
            )
            group.broadcast({"ok": True, **choice.to_json(), "reason": point.reason})
        return point
    msg = group.broadcast(None)
    if not isinstance(msg, dict) or not msg.get("ok"):
        error = msg.get("error") if isinstance(msg, dict) else msg
        raise ResumeError(f"rank 0 could not choose a checkpoint: {error}")
    if not msg.get("id"):
        return ResumePoint(step=0, reason=str(msg.get("reason") or "fresh start (rank 0)"))
    return restorer.resume_point(ResumeRequest.from_json(msg))
