"""What the checkpointer needs from whoever persists its snapshots (:class:`Persister`).

Two implementations, chosen once when the checkpointer is built
(:func:`~ckpt_agent.runtime.checkpointer.make_persister`):

* :class:`~ckpt_agent.runtime.save.thread_persister.ThreadPersister` — host buffers and
  a persister thread in this process (plus rank 0's validator thread);
* :class:`~ckpt_agent.runtime.shm.persister.ShmPersister` — shared memory and a
  persister process (the pod's sidecar or a local subprocess): flash checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ckpt_agent.decide.decision import Decision
from ckpt_agent.runtime.core.context import Handover
from ckpt_agent.runtime.save.snapshot import JobError

__all__ = ["Persister"]


class Persister(Protocol):
    """Takes snapshots off the training thread and makes them durable.

    Every method is called on the training thread, by every rank that writes (rank 0
    alone without ``torch.distributed``); the background work runs on the persister's
    own threads or process. The call order, for one checkpointer:

    1. :meth:`start` — once, after the resume: the restore side's result arrives here and
       nowhere else (:class:`~ckpt_agent.runtime.core.context.Handover`: the chain's
       previous link, the lineage, the resumed and the newest valid step). The persister
       keeps what crosses from one persist to the next in an object of its own, owned by
       one thread (:class:`~ckpt_agent.runtime.save.chain.HashChain`); background work
       starts.
    2. :meth:`prepare` — optional, once, before the first save: it reads what the state
       looks like on the training thread and returns the rest (allocating and touching the
       buffers) for a background thread, finished before the first snapshot.
    3. Every step of the loop, in this order: :meth:`take_errors` (failures since the last
       call, each once), :meth:`poll` (results in; then the engine hands them to the
       scheduler), :meth:`system_signals`, :meth:`busy` (with several ranks every rank's
       is agreed: one busy rank defers the save everywhere). When a save is due:
       :meth:`wait_free` if busy and the save must not be deferred, then :meth:`save`
       (collective with several ranks: every writing rank saves the same step).
    4. :meth:`wait_persisted` and :meth:`wait_validated` — any time after 1
       (``save_now``, ``wait``, SIGTERM); the second only after the first returned True.
    5. :meth:`close` — once, last; also after a failed start (without 1).
    """

    def start(self, handover: Handover) -> None:
        """Step 1: take the resume's hand-over and start the background work."""

    def prepare(self, step: int) -> Callable[[], None] | None:
        """Step 2: allocate and touch the snapshot buffers once, outside the training loop.

        Called on the training thread (it reads what the state looks like); the work it
        returns — allocating and touching the buffers — runs on a background thread and
        is finished before the first snapshot (None: nothing left to do)."""

    @property
    def busy(self) -> bool:
        """The previous snapshot's buffers are still in use."""

    def wait_free(self) -> None:
        """Wait until a snapshot can be taken."""

    def save(self, decision: Decision, files: dict[str, bytes]) -> str | None:
        """Snapshot now and hand it on; the checkpoint id (None: deferred)."""

    def poll(self) -> None:
        """Take the persister's newest results (persist times, hashes, errors) in."""

    def take_errors(self) -> list[JobError]:
        """Failures since the last call, each reported once."""

    def system_signals(self) -> tuple[int | None, float | None]:
        """(GPU errors, probe write latency in ms) the persister measured, if any."""

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Wait until the last snapshot is committed (or handled by the persister)."""

    def wait_validated(self, timeout: float | None = None) -> bool:
        """Wait for the validations this process runs (True when it runs none)."""

    def close(self, timeout: float | None) -> None:
        """Step 5: finish the queued work and stop."""
