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

from ckpt_agent.decide.scheduler import Decision
from ckpt_agent.runtime.restore.restorer import Restorer
from ckpt_agent.runtime.restore.resume_point import ResumePoint
from ckpt_agent.runtime.save.snapshot import JobError

__all__ = ["JobError", "Persister"]


class Persister(Protocol):
    """Takes snapshots off the training thread and makes them durable."""

    def flush_previous(self) -> None:
        """Before resuming: let snapshots a dead trainer left behind be persisted first."""

    def resume_point(self, restorer: Restorer) -> ResumePoint | None:
        """A resume this persister can serve itself (None: resume from storage as usual);
        collective with several ranks (every rank gets the same answer)."""

    def start(self, resume: ResumePoint) -> None:
        """Start the background work (after the resume)."""

    def prepare(self, step: int) -> Callable[[], None] | None:
        """Allocate and touch the snapshot buffers once, outside the training loop.

        Called on the training thread (it reads what the state looks like); the work it
        returns — allocating and touching the buffers — runs on a background thread and
        is finished before the first snapshot (None: nothing left to do)."""

    @property
    def busy(self) -> bool:
        """The previous snapshot's buffers are still in use."""

    def wait_free(self) -> None:
        """Wait until a snapshot can be taken."""

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Wait until the last snapshot is committed (or handled by the persister)."""

    def wait_validated(self, timeout: float | None = None) -> bool:
        """Wait for the validations this process runs (True when it runs none)."""

    def save(self, decision: Decision, files: dict[str, bytes]) -> str | None:
        """Snapshot now and hand it on; the checkpoint id (None: deferred)."""

    def poll(self) -> None:
        """Take the persister's newest results (persist times, hashes, errors) in."""

    def take_errors(self) -> list[JobError]:
        """Failures since the last call, each reported once."""

    def system_signals(self) -> tuple[int | None, float | None]:
        """(GPU errors, probe write latency in ms) the persister measured, if any."""

    def close(self, timeout: float | None) -> None:
        """Finish the queued work and stop."""
