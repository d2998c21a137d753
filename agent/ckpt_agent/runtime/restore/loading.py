"""Reading and checking one candidate before anything is applied (:class:`CandidateLoader`).

:meth:`CandidateLoader.load` reads a checkpoint (or a heartbeat), decodes the whole
tree, checks it against the live objects and memory (:mod:`.preflight`) and returns
either a :class:`~ckpt_agent.runtime.restore.resume_point.Candidate` or the
:class:`~ckpt_agent.runtime.restore.resume_point.Rejection` that says why not. Everything
a candidate raises is a rejection, never a crash; a transient storage failure is retried
and, when the storage keeps failing, fails the start instead
(:class:`~ckpt_agent.errors.ResumeStorageError`).
"""

from __future__ import annotations

import logging
import time

from ckpt_agent import tuning
from ckpt_agent.errors import (
    CandidateRejectedError,
    CheckpointNotFoundError,
    RejectionKind,
    ResumeStorageError,
    RetryableError,
    StorageError,
)
from ckpt_agent.format.heartbeat import read_heartbeat
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.format.readers import read_checkpoint, read_rank_manifest
from ckpt_agent.format.statecheck import check_state
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.core.serialization import LoadedState, load_tensors
from ckpt_agent.runtime.restore.bookkeeping import record_verdict
from ckpt_agent.runtime.restore.compat import compat_problems
from ckpt_agent.runtime.restore.preflight import (
    LiveState,
    check_budget,
    check_heartbeat,
    check_loaded,
    memory_budget,
    rejection_kind,
)
from ckpt_agent.runtime.restore.resume_point import Candidate, Rejection
from ckpt_agent.text import clean

__all__ = ["CandidateLoader"]

log = logging.getLogger(__name__)

#: Compatibility problems quoted in a rejection (the rest are counted).
_PROBLEMS_QUOTED = 4


def _unsharded(manifest: RankManifest) -> list[str]:
    """The tensors of a rank part except its shards (those are read by resharding)."""
    return [n for n in manifest.tensors if not n.startswith("sharded/")]


class _TransientReadError(Exception):
    """A retryable storage error while a candidate was read (retried by :meth:`load`)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class CandidateLoader:
    """Loads and checks candidates against this process's live objects (module doc)."""

    def __init__(self, engine: Engine, capture: StateCapture) -> None:
        self.engine = engine
        self.capture = capture
        self.memory_budget: int | None = memory_budget()
        """Most bytes one candidate may decode to (None: no limit known)."""
        self._live: LiveState | None = None

    def compat(self, manifest: RankManifest) -> list[str]:
        """Why this checkpoint does not fit the live model/optimizer (empty: it fits)."""
        c = self.capture
        return compat_problems(manifest, c.model, c.optimizer, sharded=self.engine.ranks.sharded)

    def live(self, *, fresh: bool = False) -> LiveState:
        """The live objects' shapes, taken once per resume before any candidate is read: an
        error here is the training script's, raised as is (it must not condemn checkpoints)."""
        if self._live is None or fresh:
            self._live = LiveState.of(self.capture, sharded=self.engine.ranks.sharded)
        return self._live

    def load(self, rec: CheckpointRecord) -> Candidate | Rejection:
        """Load and check one checkpoint: the candidate, or why it is unusable.

        Everything a candidate raises while it is read, decoded and checked is a
        rejection, never a crash (``KeyboardInterrupt``/``SystemExit`` excepted):
        its :class:`~ckpt_agent.errors.RejectionKind` is returned and, when the
        checkpoint itself is at fault, it is marked corrupted. A transient storage
        failure is not the checkpoint's fault: the read is retried
        (:data:`~ckpt_agent.tuning.RESTORE_READ_ATTEMPTS`), and when the storage keeps
        failing the start fails (:class:`~ckpt_agent.errors.ResumeStorageError`) instead
        of giving the checkpoint up for an older one.
        """
        attempts = tuning.RESTORE_READ_ATTEMPTS
        delay = tuning.RESTORE_READ_BACKOFF_S
        for attempt in range(1, attempts + 1):
            try:
                return self._load_once(rec)
            except _TransientReadError as err:
                if attempt == attempts:
                    raise ResumeStorageError(
                        f"the storage kept failing while {rec.id} was read "
                        f"({attempts} attempts; last: {err.cause}); nothing was "
                        "marked and no older checkpoint was chosen: the start fails so the "
                        "restart tries again — check the storage"
                    ) from err.cause
                log.warning(
                    "reading %s failed (%s); retrying in %.1fs",
                    clean(rec.id),
                    clean(err.cause),
                    delay,
                )
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _load_once(self, rec: CheckpointRecord) -> Candidate | Rejection:
        e = self.engine
        e.metrics.recovery_attempts.inc()
        live = self.live()
        if rec.tier == Tier.HEARTBEAT:
            return self._load_heartbeat(rec)
        rank = e.ranks.rank
        t0 = time.perf_counter()
        try:
            committed, manifest = read_checkpoint(e.storage, e.run_id, rec.id, 0)
            check_state(manifest)  # the whole tree decodes (before it is compared or loaded)
            problems = self.compat(manifest)
            if problems:
                n = len(problems) - _PROBLEMS_QUOTED
                return Rejection(
                    RejectionKind.INCOMPATIBLE,
                    "does not fit the live model (different model/optimizer shape): "
                    + "; ".join(problems[:_PROBLEMS_QUOTED])
                    + (f" (+{n} more)" if n > 0 else ""),
                )
            parts = [(manifest, _unsharded(manifest))]
            mine: RankManifest | None = None
            if rank != 0 and rank in {r.rank for r in committed.commit.ranks}:
                # this rank's RNG and data position
                mine = read_rank_manifest(e.storage, e.run_id, committed, rank)
                parts.append((mine, _unsharded(mine)))
            check_budget(rec.id, parts, self.memory_budget)
            loaded = load_tensors(e.storage, e.run_id, manifest, _unsharded(manifest))
            own: LoadedState | None = None
            if mine is not None:
                own = load_tensors(e.storage, e.run_id, mine, _unsharded(mine))
            check_loaded(rec.id, loaded, own, live)
        except CheckpointNotFoundError as err:
            return Rejection(RejectionKind.MISSING, str(err))
        except Exception as err:  # anything the candidate makes the readers raise
            if isinstance(err, StorageError) and isinstance(err, RetryableError):
                raise _TransientReadError(err) from err
            kind = rejection_kind(err)
            reason = f"{type(err).__name__}: {err}"
            if isinstance(err, CandidateRejectedError):
                reason = err.reason
            if kind.corrupted:
                record_verdict(e, rec, CheckpointStatus.CORRUPTED, reason, time.perf_counter() - t0)
            return Rejection(kind, reason)
        if rec.status == CheckpointStatus.PENDING:
            seconds = time.perf_counter() - t0
            record_verdict(e, rec, CheckpointStatus.VALID, "", seconds, committed.manifest_hash)
        return Candidate(
            record=rec, loaded=loaded, manifest_hash=committed.manifest_hash, own=own, checked=True
        )

    def _load_heartbeat(self, rec: CheckpointRecord) -> Candidate | Rejection:
        e = self.engine
        try:
            ring = read_heartbeat(e.storage, e.run_id, e.ranks.rank)
            hb = next((h for h in reversed(ring) if h.step == rec.step), None)
            if hb is not None:
                check_heartbeat(hb)
        except Exception as err:  # an unreadable ring is a rejection, never a crash
            kind = RejectionKind.STORAGE if isinstance(err, StorageError) else RejectionKind.FORMAT
            return Rejection(kind, f"heartbeat unreadable: {type(err).__name__}: {err}")
        if hb is None:
            return Rejection(RejectionKind.MISSING, "heartbeat ring no longer holds this step")
        return Candidate(record=rec, heartbeat=hb, checked=True)
