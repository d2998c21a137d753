"""The save path of the training thread: back-pressure, hand-off, errors reported once.

A snapshot is never taken while the previous persist still owns the buffers:
:meth:`SavePath.save` *defers* a scheduled save to the next step (the scheduler
is told, the decision log says so); emergency saves, forced saves and
``backpressure="wait"`` wait for the persister instead. Failures of the
background work come back through :meth:`SavePath.collect_errors`: each is
logged, counted in ``ckpt_persist_errors_total``, and its tier is due again.

What the training thread then does is ``on_persist_error``: ``raise`` raises a
:class:`~ckpt_agent.errors.PersistError` once, ``warn`` only logs, and ``auto``
(the default) logs retryable failures (a storage outage, a reset connection: the
next save retries) and raises permanent ones, and raises the retryable ones too
once no save has committed for :data:`~ckpt_agent.tuning.PERSIST_OUTAGE_TOLERANCE_S`
(an outage that long is not riding out anymore; the job should fail visibly). A
save only logged (``warn``) is never reported as saved: ``save_now()`` returns None and
``wait()`` False. A :class:`~ckpt_agent.errors.FencedError` (a newer writer holds the run)
is raised whatever the mode, by this and every later call.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from ckpt_agent import tuning
from ckpt_agent.decide.decision import Decision, SaveOutcome
from ckpt_agent.errors import FencedError, PersistError, RetryableError
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.save.persister import Persister

__all__ = ["SavePath"]

log = logging.getLogger(__name__)


class SavePath:
    """Hands due saves to the :class:`~ckpt_agent.runtime.save.persister.Persister` (module doc)."""

    def __init__(
        self,
        engine: Engine,
        capture: StateCapture,
        persister: Persister,
        backpressure: Literal["defer", "wait"],
        on_persist_error: Literal["raise", "warn", "auto"],
    ) -> None:
        self.engine = engine
        self.capture = capture
        self.persister = persister
        self.backpressure = backpressure
        self.on_persist_error = on_persist_error
        #: Set once a newer writer fenced this one: raised by every later call.
        self.fenced: FencedError | None = None
        #: ``auto``: when the current run of retryable failures began, and the commit
        #: count then (a commit since ends the outage).
        self._outage: tuple[float, int] | None = None

    def save(
        self, decision: Decision, *, force: bool = False, busy: bool | None = None
    ) -> str | None:
        """Snapshot now (``busy``: agreed by all ranks; None = this rank's persister). A
        memory-tier snapshot never waits: busy, it is taken at the next step."""
        tier = decision.snapshot_tier
        assert tier is not None
        e = self.engine
        if busy is None:
            busy = self.persister.busy
        if busy and decision.memory_only:  # counted, no event: it may find it busy each step
            e.scheduler.settle(SaveOutcome.deferred(decision))
            e.metrics.backpressure.labels(action="memory_deferred").inc()
            return None
        if busy and not (self.backpressure == "wait" or force or decision.emergency):
            e.scheduler.settle(SaveOutcome.deferred(decision))
            e.stats.deferred += 1
            self._backpressure(
                decision,
                "deferred",
                reason="previous persist still running; the save is due again next step",
            )
            return None
        if busy:
            t0 = time.perf_counter()
            self.persister.wait_free()
            e.stats.waited += 1
            self._backpressure(decision, "waited", seconds=round(time.perf_counter() - t0, 6))
            self.raise_errors()
        return self.persister.save(decision, self.capture.files(tier))

    def _backpressure(self, decision: Decision, action: str, **fields: object) -> None:
        self.engine.metrics.backpressure.labels(action=action).inc()
        self.engine.event(
            "backpressure", step=decision.step, tier=decision.tier, action=action, **fields
        )

    def drain(self) -> None:
        """The persister's results in; their persist times to the scheduler."""
        self.persister.poll()
        self.engine.drain_feedback()

    def collect_errors(self) -> PersistError | FencedError | None:
        """One error for every background failure since the last call (None: none); once
        a newer writer fenced this one, that :class:`FencedError`, on every call."""
        errs = self.persister.take_errors()
        if not errs:
            return self.fenced
        e = self.engine
        e.metrics.persist_errors.inc(len(errs))
        for err in errs:
            e.event("error", what=err.what, error=f"{type(err.error).__name__}: {err.error}")
            if err.tier is not None:  # a save failed: that tier is due again
                e.scheduler.settle(SaveOutcome.failed(err.tier))
        fenced = next((x.error for x in errs if isinstance(x.error, FencedError)), None)
        if fenced is not None and self.fenced is None:
            self.fenced = fenced
            e.event("fenced", generation=fenced.generation, holder=fenced.holder)
            log.error("%s", fenced)
        if self.fenced is not None:
            return self.fenced
        first = errs[0]
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        out = PersistError(f"background checkpointing failed: {first.what}: {first.error}{more}")
        out.__cause__ = first.error
        out.transient = all(isinstance(x.error, RetryableError) for x in errs)
        out.saves_failed = any(x.tier is not None for x in errs)
        return out

    def raise_errors(self) -> bool:
        """Raise or log what :meth:`collect_errors` finds (``on_persist_error``: module doc);
        True when a failed save was only logged (it was never committed). A
        :class:`FencedError` is raised whatever ``on_persist_error`` says."""
        err = self.collect_errors()
        if err is None:
            return False
        if isinstance(err, PersistError) and self._tolerated(err):
            log.warning("%s (training goes on; the save is retried)", err)
            return err.saves_failed
        raise err

    def _tolerated(self, err: PersistError) -> bool:
        if self.on_persist_error != "auto":
            return self.on_persist_error == "warn"
        if not err.transient:
            return False
        now, committed = time.monotonic(), self.engine.stats.committed
        if self._outage is None or self._outage[1] != committed:
            self._outage = (now, committed)
        elapsed = now - self._outage[0]
        if elapsed < tuning.PERSIST_OUTAGE_TOLERANCE_S:
            return True
        err.add_note(
            f"no checkpoint committed for {elapsed:.0f}s of retryable storage failures "
            f"(tolerated up to {tuning.PERSIST_OUTAGE_TOLERANCE_S:.0f}s): check the storage"
        )
        return False
