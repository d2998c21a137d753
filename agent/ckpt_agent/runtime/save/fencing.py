"""The checkpointer's writer generation: claimed at start, handed to the writer, the
finalize pipeline and the heartbeat ring (:mod:`ckpt_agent.persist.fencing`,
:mod:`ckpt_agent.format.fence`).

Rank 0 with the in-process persister claims, before the resume. With several ranks the
others *follow*: once the resume's collective returned (rank 0 claimed before it
entered), each reads the run's highest generation and checks it like rank 0 does, so a
zombie job's every rank stops at its next save. With flash checkpoints the sidecar
persists and claims for itself (:mod:`ckpt_agent.flash.sidecar.commit`): the trainer
holds nothing.

Once fenced, the container's termination report says so (:func:`report_fenced`).
"""

from __future__ import annotations

from ckpt_agent.format.fence import Fence, WriterRecord, claim, fenced_report, holder_of
from ckpt_agent.format.termination import TerminationLog
from ckpt_agent.persist.builder import PersistParts
from ckpt_agent.runtime.core.context import Engine

__all__ = ["claim_writer", "follow_writer", "hold", "report_fenced"]


def report_fenced(report: TerminationLog | None, fence: Fence) -> None:
    """Once ``fence`` is found fenced, the container's termination report (this
    checkpointer's, which knows its checkpoints) says so, naming the holder: the operator
    tells this exit from a crash (an Event, no restart)."""
    if report is None:
        return

    def tell(holder: WriterRecord | None) -> None:
        assert report is not None
        report.mark_fenced(fence.run_id, fenced_report(fence, holder))

    fence.on_fenced = tell


def hold(parts: PersistParts, fence: Fence) -> None:
    """Hand ``fence`` to the parts that write and delete (writer, finalize pipeline)."""
    parts.writer.fence = fence
    parts.finalizer.fence = fence
    report_fenced(parts.finalizer.report, fence)


def claim_writer(engine: Engine, *, persists_here: bool) -> Fence | None:
    """Rank 0, before the resume: claim the run's next generation for this process."""
    if not (persists_here and engine.ranks.coordinator):
        return None
    fence = claim(engine.storage, engine.run_id)
    hold(engine.parts, fence)
    engine.event("writer_claimed", generation=fence.generation)
    return fence


def follow_writer(engine: Engine, *, persists_here: bool) -> Fence | None:
    """The other ranks, after the resume's collective: check rank 0's generation (the
    run's highest; None when no writer ever claimed the run)."""
    if not persists_here or engine.ranks.coordinator or not engine.ranks.distributed:
        return None
    holder = holder_of(engine.storage, engine.run_id)
    if holder is None:
        return None
    fence = Fence(engine.storage, engine.run_id, WriterRecord.here(holder.generation))
    hold(engine.parts, fence)
    return fence
