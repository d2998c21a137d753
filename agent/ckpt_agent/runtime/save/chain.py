"""The hash chain of one rank's checkpoints, owned by one thread (:class:`HashChain`)."""

from __future__ import annotations

from ckpt_agent.records import Lineage
from ckpt_agent.runtime.core.context import Handover

__all__ = ["HashChain"]


class HashChain:
    """What the next checkpoint of this rank links to: the previous one's manifest hash
    (``prev_hash``) and the resume lineage it carries.

    The only state a persist needs from the previous one. A persister makes it in
    :meth:`~ckpt_agent.runtime.save.persister.Persister.start` from the resume's
    :class:`~ckpt_agent.runtime.core.context.Handover` (before the thread that owns it
    runs); from then on exactly one thread reads and advances it, the one that learns
    the commit hashes:

    * :class:`~ckpt_agent.runtime.save.thread_persister.ThreadPersister`: its persister
      thread (it builds every manifest and commits it);
    * :class:`~ckpt_agent.runtime.shm.persister.ShmPersister`: the training thread (it
      hands each snapshot's metadata over in ``save`` and takes the persister process's
      hashes in through ``poll``).

    Nothing else holds a copy: a failed persist does not advance it, so the next
    checkpoint links to the last one that committed.
    """

    __slots__ = ("lineage", "prev_hash")

    def __init__(self, handover: Handover) -> None:
        self.prev_hash: str | None = handover.prev_hash
        self.lineage: Lineage = handover.lineage

    def advance(self, manifest_hash: str | None) -> None:
        """A checkpoint committed with ``manifest_hash``: the next one links to it."""
        self.prev_hash = manifest_hash
