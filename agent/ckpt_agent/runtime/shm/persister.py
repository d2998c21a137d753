"""Flash checkpoints: snapshots into shared memory, a persister process does the rest.

:class:`ShmPersister` is the :class:`~ckpt_agent.runtime.save.persister.Persister`
used with ``config.shm_dir`` (``CKPT_SHM_DIR``): the training thread copies
the state into a shared-memory slot (:class:`~ckpt_agent.runtime.shm.target.FlashTarget`);
the pod's sidecar — or a local subprocess — writes, validates and records it.
Its results (persist times, commit hashes, errors: every save's) come back through
:meth:`ShmPersister.poll`; a local persister's metrics are served by the trainer
(:meth:`~ckpt_agent.metrics.Metrics.relay`). Everything here runs on the training
thread, which therefore owns the rank's :class:`~ckpt_agent.runtime.save.chain.HashChain`:
each save hands the persister process the chain's previous link and lineage, and
:meth:`ShmPersister.poll` advances it with the commit hashes that come back. An in-place
restart from checked shared-memory snapshots is the restore side's
(:func:`~ckpt_agent.runtime.shm.in_place.resume_from_memory`, over the same
:attr:`ShmPersister.flash` target).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ckpt_agent import tuning
from ckpt_agent.decide.decision import Decision, SaveOutcome
from ckpt_agent.decide.retention import classify
from ckpt_agent.flash.protocol import Descriptor, PersistedMark, read_file
from ckpt_agent.format.fence import fenced_from_text
from ckpt_agent.format.manifest import lineage_to_json
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Json, checkpoint_id
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine, Handover
from ckpt_agent.runtime.core.serialization import library_versions
from ckpt_agent.runtime.dist.rank_group import RankGroup
from ckpt_agent.runtime.save.chain import HashChain
from ckpt_agent.runtime.save.snapshot import JobError
from ckpt_agent.runtime.shm.target import FlashTarget

__all__ = ["ShmPersister", "jit_token"]

log = logging.getLogger(__name__)


def jit_token(step: int, epoch: int) -> str:
    """The token of a just-in-time save: the same on every survivor, derived without talking
    to the others (the step and the resume lineage epoch)."""
    return f"{step}-jit-{epoch}"


class ShmPersister:
    """The shared-memory :class:`~ckpt_agent.runtime.save.persister.Persister` (module doc)."""

    def __init__(
        self,
        engine: Engine,
        capture: StateCapture,
        group: RankGroup | None,
        *,
        flash: FlashTarget | None = None,
    ) -> None:
        """``flash``: the shared-memory target (default: this rank's, from the config)."""
        self.engine = engine
        self.capture = capture
        self.group = group
        self.flash = flash or FlashTarget(
            engine.config,
            engine.ranks.rank,
            engine.ranks.live_world_size,
            work_dir=engine.work_dir,
        )
        self._errors: list[JobError] = []
        self._pending: dict[int, tuple[Tier, bool]] = {}
        """Saves in flight: their tier and whether memory-only (a memory-tier snapshot)."""
        self._resume_step = -1
        self._chain = HashChain(Handover())
        """The training thread's (replaced by :meth:`start`)."""
        if self.flash.local_persister:  # no sidecar container: serve the persister's metrics
            path = self.flash.reader.metrics_path
            engine.metrics.relay(lambda: read_file(path))

    @property
    def _live(self) -> bool:
        """The area is ours (after :meth:`start`, before :meth:`close`)."""
        return self.flash.writer is not None

    # ------------------------------------------------------------------ lifecycle

    def start(self, handover: Handover) -> None:
        if handover.checkpoint_step is not None:
            self._resume_step = handover.checkpoint_step
        self._chain = HashChain(handover)
        # the trainer's pipeline never validates here: the seed is what summary() reports
        self.engine.finalizer.seed_last_valid_step(handover.last_valid_step)
        self.flash.start()  # the persister (sidecar / subprocess) validates and records

    def prepare(self, step: int) -> Callable[[], None] | None:
        """Size, map and touch the slots: returned as work for a background thread (the
        first snapshot joins it), so that ``start()`` returns without it — after a restart
        the first step begins 0.1–0.3 s sooner for a few hundred MiB of state."""
        sections = self.capture.sections(lightweight=False, step=step)
        files_bytes = len(self.capture.train_config_bytes or b"")

        def work() -> None:
            self.flash.prepare(sections, files_bytes)

        return work

    def close(self, timeout: float | None) -> None:
        self._settle()
        if not self.flash.close(timeout if timeout is not None else tuning.SHM_CLOSE_TIMEOUT_S):
            self._errors.append(
                JobError(
                    "persisting (local persister)",
                    RuntimeError("the local persister did not finish in time"),
                    Tier.PULSE,
                )
            )

    # ------------------------------------------------------------------ state

    @property
    def busy(self) -> bool:
        return self._live and self.flash.busy

    def wait_free(self) -> None:
        if self._live:
            self.flash.wait_free()
            self._settle()

    def wait_persisted(self, timeout: float | None = None) -> bool:
        if not self._live or self.flash.last_seq <= 0:
            return True  # nothing written to wait for
        ok = self.flash.wait(timeout=timeout) is not None
        self._settle()
        return ok

    def wait_validated(self, timeout: float | None = None) -> bool:
        del timeout
        return True  # the persister process validates

    def take_errors(self) -> list[JobError]:
        errs, self._errors = self._errors, []
        return errs

    def system_signals(self) -> tuple[int | None, float | None]:
        return self.flash.system_signals() if self._live else (None, None)

    # ------------------------------------------------------------------ saving

    def save(self, decision: Decision, files: dict[str, bytes]) -> str | None:
        """Copy the snapshot into shared memory; the persister process does the rest."""
        e = self.engine
        tier, step = decision.snapshot_tier, decision.step
        assert tier is not None
        memory_only = decision.memory_only
        sections = self.capture.sections(lightweight=decision.lightweight, step=step)
        token = f"{step}-{'memory' if memory_only else tier.value}-{time.time_ns()}"
        if self.group is not None:  # one token for all ranks: parts of the same save
            token = str(self.group.broadcast(token))
        progress = sections.get("progress")
        if isinstance(progress, dict):
            progress["token"] = token
        meta = self._meta(decision, token)
        if memory_only:  # its persister records and replicates it, never writes it to storage
            meta["memory_only"] = True
        desc = self.flash.write(step, tier, sections, files=files, meta=meta)
        if desc is None:  # the slots were taken between the check and now: wait once
            self.flash.wait_free()
            desc = self.flash.write(step, tier, sections, files=files, meta=meta)
        if desc is None:
            e.scheduler.settle(SaveOutcome.deferred(decision))
            e.event(
                "backpressure",
                step=step,
                tier=tier,
                action="deferred",
                reason="no free shared-memory slot",
            )
            return None
        self._pending[desc.seq] = (tier, memory_only)
        e.book_snapshot(
            decision,
            desc.stall_s,
            bytes=desc.data_size,
            approximate=False,
            shm_seq=desc.seq,
            shm_slot=desc.slot,
        )
        return checkpoint_id(tier, step)

    def _meta(self, decision: Decision, token: str) -> dict[str, Json]:
        """What the persister records of a save: the decision, the chain's link and lineage."""
        return {
            "score": decision.score,
            "components": dict(decision.components),
            "retention_class": classify(decision.score, self.engine.config.retention).value,
            "reason": decision.reason,
            "anomaly": decision.anomaly,
            "lightweight": decision.lightweight,
            "approximate": False,
            "emergency": decision.emergency,
            "prev_hash": self._chain.prev_hash,
            "resume_step": self._resume_step,
            "lineage": lineage_to_json(self._chain.lineage),
            "versions": library_versions(),
            "token": token,
        }

    @property
    def epoch(self) -> int:
        """The resume lineage epoch this process's saves are taken in."""
        return self._chain.lineage.epoch

    def save_jit(self, decision: Decision, sections: dict[str, object]) -> Descriptor | None:
        """A just-in-time snapshot (:mod:`ckpt_agent.runtime.shm.jit`): no collective, the
        token every survivor derives alone, ``jit`` in its metadata (its persister records
        its hashes and replicates it, but never writes it to storage: the dead rank's part
        is missing). Waits :data:`~ckpt_agent.tuning.JIT_SLOT_WAIT_S` at most for a slot;
        None when none freed."""
        token = jit_token(decision.step, self.epoch)
        progress = sections.get("progress")
        if isinstance(progress, dict):
            progress["token"] = token
        meta = {**self._meta(decision, token), "jit": True}
        deadline = time.monotonic() + tuning.JIT_SLOT_WAIT_S
        while True:
            desc = self.flash.write(decision.step, Tier.PULSE, sections, files={}, meta=meta)
            if desc is not None or time.monotonic() > deadline:
                return desc
            time.sleep(0.02)

    @property
    def newest_step(self) -> int | None:
        """The step of this rank's newest complete snapshot in memory (None: none)."""
        latest = self.flash.reader.latest()
        return None if latest is None else latest.step

    def poll(self) -> None:
        """The persister's results since the last poll: persist times, commit hashes, errors.
        Nothing to look at (not even a ``stat``) while no save of this process is in flight:
        results only come for those."""
        if not self._live or not self._pending:
            return
        for mark in self.flash.poll():
            self._handled(mark)

    def _handled(self, mark: PersistedMark) -> None:
        """One save's result (every save's latency is observed, not only the newest's)."""
        e = self.engine
        tier, memory_only = Tier.PULSE, False
        for seq in [s for s in self._pending if s <= mark.seq]:
            tier, memory_only = self._pending.pop(seq)
        if memory_only:
            self._recorded(mark)
            return
        if not mark.ok:
            what = f"persisting {tier.value} of step {mark.step} (shared memory)"
            # the persister holds the run's generation: fenced there is fenced here (fatal)
            error = fenced_from_text(mark.error) or RuntimeError(mark.error)
            self._errors.append(JobError(what, error, tier))
            return
        e.stats.committed += 1 if mark.committed else 0
        e.stats.bytes_written += mark.size_bytes
        e.feedback.put(SaveOutcome.persisted(tier, mark.persist_s))
        if mark.manifest_hash:
            self._chain.advance(mark.manifest_hash)
        e.metrics.save_latency.labels(tier=tier.value).observe(mark.persist_s)
        e.event(
            "persisted",
            checkpoint=mark.checkpoint_id,
            step=mark.step,
            committed=mark.committed,
            manifest_hash=mark.manifest_hash,
            persist_s=round(mark.persist_s, 6),
            by="shared-memory persister",
        )

    def _settle(self) -> None:
        """Results in, and their persist times to the scheduler right away."""
        self.poll()
        self.engine.drain_feedback()

    def _recorded(self, mark: PersistedMark) -> None:
        """A memory-tier snapshot's result: recorded (hashed for an in-place restart, pushed
        to the replicas) or not. Never an error of the run: the next one is due again."""
        e = self.engine
        if not mark.ok:
            log.warning("recording memory snapshot of step %d failed: %s", mark.step, mark.error)
            e.feedback.put(SaveOutcome.failed(Tier.PULSE, step=mark.step, memory=True))
            e.event("memory_recorded", step=mark.step, ok=False, error=mark.error)
            return
        e.feedback.put(SaveOutcome.persisted(Tier.PULSE, mark.persist_s, memory=True))
        e.event("memory_recorded", step=mark.step, ok=True, seconds=round(mark.persist_s, 6))
