"""The checkpointer's writer generation: claimed at start, handed to the writer and the
finalize pipeline (:mod:`ckpt_agent.persist.fencing`, :mod:`ckpt_agent.format.fence`).

The process that writes and deletes in the run claims: rank 0 with the in-process
persister. With flash checkpoints the sidecar persists and claims for itself
(:mod:`ckpt_agent.flash.sidecar`); ranks that are not the coordinator write only their
own rank manifests and never delete, and rank 0's COMMIT (checked, exclusive) decides.
"""

from __future__ import annotations

from ckpt_agent.format.fence import Fence, claim
from ckpt_agent.persist.builder import PersistParts

__all__ = ["claim_writer", "hold"]


def hold(parts: PersistParts, fence: Fence) -> None:
    """Hand ``fence`` to the parts that write and delete (writer, finalize pipeline)."""
    parts.writer.fence = fence
    parts.finalizer.fence = fence


def claim_writer(parts: PersistParts, run_id: str, *, coordinator: bool) -> Fence | None:
    """Claim the next generation of ``run_id`` for this process (the coordinator only)."""
    if not coordinator:
        return None
    fence = claim(parts.storage, run_id)
    hold(parts, fence)
    return fence
