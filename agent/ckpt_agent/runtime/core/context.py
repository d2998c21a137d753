"""What the parts of one :class:`~ckpt_agent.runtime.checkpointer.Checkpointer` share.

:class:`Ranks` says who this process is (rank, world size, whether it writes,
whether the state is sharded); :class:`Engine` opens and owns the services
every part uses — storage, catalog, writer, validator and the post-commit
pipeline (built by :class:`~ckpt_agent.persist.builder.PersistBuilder`, or by the
``persist`` factory a test passes: fakes, no storage or SQLite opened),
scheduler, metrics, the decision log. Engine holds services only: what the
threads exchange goes through thread-safe ones (the feedback queue, the anomaly
log, the write-latency sample, each behind its lock), and :class:`Stats` has one
writing thread per field. What one persist needs from the previous one (the hash
chain, the lineage) is the persister's own
(:class:`~ckpt_agent.runtime.save.chain.HashChain`), handed over once from the
restore side as a :class:`Handover`. :class:`Stats` and the pipeline's counters
are what :meth:`Checkpointer.summary` reports.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from ckpt_agent import tuning
from ckpt_agent.decide.decision import Decision, SaveOutcome
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.errors import CheckpointFormatError, StorageError
from ckpt_agent.format.layout import validate_run_id
from ckpt_agent.format.owner import check_owner, owner_from_env
from ckpt_agent.metrics import DecisionLog, Metrics
from ckpt_agent.persist.builder import PersistBuilder, PersistParts
from ckpt_agent.persist.finalize import AnomalySource, EventSink
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import AnomalyEvent, CheckpointRecord, Lineage
from ckpt_agent.runtime.core.sharded import is_dtensor
from ckpt_agent.runtime.core.tensorboard import ScalarWriter, TensorBoard
from ckpt_agent.storage.base import Storage

__all__ = [
    "OWNER_PID",
    "Engine",
    "Handover",
    "PersistFactory",
    "Ranks",
    "Stats",
    "sweep_stale_work_dirs",
]

log = logging.getLogger(__name__)

#: Anomalies kept for retention (the newest).
_ANOMALIES_KEPT = 100
#: Stall samples kept for the summary (the newest).
_STALLS_KEPT = 1000


@dataclass
class Stats:
    """Counters of the saving side of one checkpointer (the verdicts are the pipeline's).

    Each field has one writing thread: ``saves``, ``stalls``, ``deferred`` and ``waited``
    the training thread; ``committed`` and the byte counts the thread that learns of a
    commit (the in-process persister thread, or the training thread taking a shared-memory
    persister's results in). Others only read them."""

    saves: int = 0
    deferred: int = 0
    waited: int = 0
    committed: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    stalls: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Handover:
    """What the restore side hands the save side, once: where this rank's chain of
    checkpoints continues (:meth:`ResumePoint.handover
    <ckpt_agent.runtime.restore.resume_point.ResumePoint.handover>` →
    :meth:`Persister.start <ckpt_agent.runtime.save.persister.Persister.start>`).
    The default is a fresh start."""

    prev_hash: str | None = None
    """The manifest hash the next checkpoint links to (None: the chain starts here)."""
    lineage: Lineage = field(default_factory=Lineage)
    """The resume lineage the run's next checkpoints carry."""
    checkpoint_step: int | None = None
    """The step of the checkpoint restored (None: fresh start)."""
    last_valid_step: int = -1
    """The newest valid weights checkpoint storage held at the resume (-1: none known)."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else None


def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return bool(dist.is_available() and dist.is_initialized())


@dataclass(frozen=True)
class Ranks:
    """This process among the ranks of the job."""

    rank: int
    world_size: int
    distributed: bool
    """Several ranks with torch.distributed: agreed decisions, every rank writes its part,
    two-phase commit (:mod:`ckpt_agent.runtime.dist.commit`). Without an initialized process
    group, rank 0 writes the (replicated) state alone."""
    sharded: bool
    """FSDP2/DTensor state: every rank writes its own shards, planned by DCP
    (:mod:`ckpt_agent.runtime.core.sharded`); a resume may use another world size."""

    @property
    def coordinator(self) -> bool:
        """Rank 0: commits, validates, applies retention, records verdicts."""
        return self.rank == 0

    @property
    def writes(self) -> bool:
        return self.coordinator or self.distributed

    @property
    def live_world_size(self) -> int:
        """The world size a checkpoint written now records (1 without torch.distributed)."""
        return self.world_size if self.distributed else 1

    @classmethod
    def resolve(cls, rank: int | None, world_size: int | None, model: torch.nn.Module) -> Ranks:
        """Explicit values, else ``RANK``/``WORLD_SIZE``, else 0/1."""
        r = rank if rank is not None else (_env_int("RANK") or 0)
        w = world_size if world_size is not None else (_env_int("WORLD_SIZE") or 1)
        if not 0 <= r < max(w, 1):
            raise ValueError(f"rank {r} outside world size {w}")
        distributed = w > 1 and _dist_initialized()
        return cls(r, w, distributed, distributed and _has_dtensors(model))


def _has_dtensors(model: torch.nn.Module) -> bool:
    return any(is_dtensor(v) for v in model.state_dict().values())


class PersistFactory(Protocol):
    """Builds the persisting parts for an :class:`Engine` (the signature of
    :meth:`PersistBuilder.build <ckpt_agent.persist.builder.PersistBuilder.build>`)."""

    def __call__(
        self,
        catalog_path: str | Path,
        *,
        metrics: Metrics,
        emit: EventSink | None = None,
        anomalies: AnomalySource | None = None,
        gc_grace_s: float | None = None,
        store_lock: threading.Lock | None = None,
    ) -> PersistParts: ...


class _LatencySample:
    """The newest small write's latency, from whichever thread wrote (storage's hook), while
    it is recent: a sample older than :data:`~ckpt_agent.tuning.LATENCY_SAMPLE_MAX_AGE_S`
    is no evidence. Writes come in bursts (a save), so without the age one slow write at
    the end of a save, then seconds without writes, would read as latency *sustained* that
    long and raise the system layer's alarm (a busy node's slow fsync is not a sick disk)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._ms: float | None = None
        self._at = 0.0
        self._clock = clock

    def put(self, ms: float) -> None:
        at = self._clock()
        with self._lock:
            self._ms, self._at = ms, at

    def get(self) -> float | None:
        with self._lock:
            ms, at = self._ms, self._at
        if ms is None or self._clock() - at > tuning.LATENCY_SAMPLE_MAX_AGE_S:
            return None
        return ms


class _AnomalyLog:
    """The newest anomalies the scheduler saw (training thread), for retention (validator
    thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[AnomalyEvent] = []

    def add(self, event: AnomalyEvent) -> None:
        with self._lock:
            self._events.append(event)
            del self._events[:-_ANOMALIES_KEPT]

    def for_retention(self, records: Sequence[CheckpointRecord]) -> list[AnomalyEvent]:
        """The anomalies this run's scheduler saw (retention protects checkpoints before
        them)."""
        del records
        with self._lock:
            return list(self._events)


OWNER_PID = "owner.pid"
"""In a temporary work dir: the pid of the process that made it."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _in_use(folder: Path, ignore_pid: int | None = None) -> bool:
    """A live process owns ``folder``: its maker (``owner.pid``) or a local persister it
    started (``sidecar.rank<r>.pid``, which may outlive a crashed trainer)."""
    for f in (folder / OWNER_PID, *folder.glob("sidecar.rank*.pid")):
        try:
            pid = int(f.read_text().strip())
        except (OSError, ValueError):
            continue
        if pid != ignore_pid and _alive(pid):
            return True
    return False


def sweep_stale_work_dirs(run_id: str, tmp: Path | None = None) -> list[Path]:
    """Remove this user's temporary work dirs of ``run_id`` left by processes that died
    (a crash's restart makes a new one); returns those removed. Folders without an
    ``owner.pid`` (made by another version) are left alone."""
    removed: list[Path] = []
    root = tmp if tmp is not None else Path(tempfile.gettempdir())
    for d in root.glob(f"ckpt-{run_id}-*"):
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not (d / OWNER_PID).is_file() or _in_use(d):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    if removed:
        log.info("removed %d work dirs of run %s left by processes that died", len(removed), run_id)
    return removed


class Engine:
    """The services of one checkpointer (opened here, closed by :meth:`close`).

    ``persist`` builds the persisting parts (default: :class:`PersistBuilder` over
    ``storage`` or the config's URL); a test passes one that returns fakes.
    """

    def __init__(
        self,
        config: AgentConfig,
        ranks: Ranks,
        storage: Storage | None,
        *,
        gc_grace_s: float,
        summary_writer: ScalarWriter | None = None,
        persist: PersistFactory | None = None,
    ) -> None:
        self.config = config
        self.run_id = validate_run_id(config.run_id)
        self.ranks = ranks
        self.own_work_dir = not config.work_dir
        """The work dir is a temporary one made here: removed by :meth:`close`."""
        if config.work_dir:
            self.work_dir = Path(config.work_dir)
        else:
            sweep_stale_work_dirs(self.run_id)
            self.work_dir = Path(tempfile.mkdtemp(prefix=f"ckpt-{self.run_id}-"))
            (self.work_dir / OWNER_PID).write_text(f"{os.getpid()}\n")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        rank = ranks.rank
        self.metrics = Metrics()
        self.decisions = DecisionLog(self.work_dir / f"decisions.rank{rank}.jsonl", background=True)
        """Written by its own thread: a decision costs the training thread one queue append."""
        # ranks of one pod share the work dir: one catalog file each (rank 0 keeps the usual name)
        name = "catalog.sqlite" if rank == 0 else f"catalog.rank{rank}.sqlite"
        self.store_lock = threading.Lock()
        """Held by whoever writes or deletes in the run's storage area (persist, retention)."""
        self._anomalies = _AnomalyLog()
        build = persist if persist is not None else PersistBuilder(config, storage=storage).build
        self.parts = build(
            self.work_dir / name,
            metrics=self.metrics,
            emit=self.event,
            anomalies=self._anomalies.for_retention,
            gc_grace_s=gc_grace_s,
            store_lock=self.store_lock,
        )
        self.storage = self.parts.storage
        self.catalog = self.parts.catalog
        self.finalizer = self.parts.finalizer
        """Validate → verdict → catalog → retention → blob GC (rank 0's validator thread)."""
        self.tensorboard = TensorBoard(self.work_dir / "tensorboard", summary_writer)
        self.scheduler = AdaptiveScheduler(config.scheduler, config.tiers)
        self.apply_run_facts()
        self.stats = Stats()
        self.feedback: queue.SimpleQueue[SaveOutcome] = queue.SimpleQueue()
        """Persist outcomes of background threads, for the scheduler (training thread)."""
        self._latency = _LatencySample()
        self._signals = SystemSignals()
        """The last :meth:`system_signals` (handed out again while nothing changed)."""
        self.storage.on_write_latency = self._on_write_latency

    # ------------------------------------------------------------------ events and bookings

    def event(self, event: str, **fields: Any) -> None:
        """One line of the decision log (tiers as their values); flushed unless a decision."""
        out: dict[str, Any] = {"event": event, "time": time.time(), "rank": self.ranks.rank}
        for k, v in fields.items():
            out[k] = v.value if isinstance(v, Tier) else v
        self.decisions.write(out)
        if event != "decision":
            self.decisions.flush()

    def record_decision(self, decision: Decision, *, loss: float | None = None) -> None:
        """The scheduler's decision of one step (and its loss): log, gauges, TensorBoard,
        anomalies. The log line, the gauges and the scalars are done by the log's thread
        (:meth:`_decision_line`): the training thread only queues the decision."""
        self.decisions.write(partial(self._decision_line, decision, time.time(), loss))
        if decision.anomaly is None:
            return
        resolved = decision.step + self.config.tiers.pulse.base_interval
        self._anomalies.add(
            AnomalyEvent(step=decision.step, kind=decision.anomaly, resolved_step=resolved)
        )

    def _decision_line(self, decision: Decision, at: float, loss: float | None) -> dict[str, Any]:
        """The decision's log line; updates the gauges and TensorBoard on the way."""
        logged = {"event": "decision", "time": at, **decision.to_dict()}
        if loss is not None:
            logged["loss"] = loss if math.isfinite(loss) else str(loss)
        self.metrics.score.set(decision.score)
        self.metrics.interval.set(decision.interval)
        self.tensorboard.scalars(decision)
        return logged

    def summary(self) -> dict[str, Any]:
        s, f = self.stats, self.finalizer
        stalls = sorted(s.stalls)
        return {
            "saves": s.saves,
            "deferred": s.deferred,
            "waited": s.waited,
            "committed": s.committed,
            "valid": f.valid,
            "corrupted": f.corrupted,
            "bytes_written": s.bytes_written,
            "bytes_reused": s.bytes_reused,
            "stall_p50_s": stalls[len(stalls) // 2] if stalls else None,
            "stall_max_s": stalls[-1] if stalls else None,
            "last_valid_step": f.last_valid_step,
        }

    def book_snapshot(self, decision: Decision, stall_s: float, **details: Any) -> None:
        """Book a taken snapshot: scheduler feedback, stall metrics/stats, the event."""
        tier = decision.snapshot_tier or decision.tier
        assert tier is not None
        self.scheduler.settle(SaveOutcome.taken(decision, stall_seconds=stall_s))
        self.metrics.add_stall("memory" if decision.memory_only else tier.value, stall_s)
        self.stats.saves += 1
        self.stats.stalls.append(stall_s)
        del self.stats.stalls[:-_STALLS_KEPT]
        self.event(
            "snapshot",
            step=decision.step,
            tier=tier,
            lightweight=decision.lightweight,
            emergency=decision.emergency,
            stall_s=round(stall_s, 6),
            **({"memory_only": True} if decision.memory_only else {}),
            **details,
        )

    def drain_feedback(self) -> None:
        """Hand the background threads' persist outcomes to the scheduler (training thread)."""
        if self.feedback.empty():  # every step: no Empty raised while none came
            return
        while True:
            try:
                outcome = self.feedback.get_nowait()
            except queue.Empty:
                return
            self.scheduler.settle(outcome)

    def system_signals(
        self, gpu: int | None, probe_ms: float | None, node_warning: str | None = None
    ) -> SystemSignals:
        """The system layer's inputs: GPU errors, the worst write latency seen and the
        operator's node warning while it holds."""
        latency = self._latency.get()
        if probe_ms is not None:
            latency = probe_ms if latency is None else max(latency, probe_ms)
        last = self._signals
        if (  # every step: the same inputs give the same (frozen) object back
            last.write_latency_ms is latency
            and last.gpu_errors is gpu
            and last.node_warning is node_warning
        ):
            return last
        self._signals = last = SystemSignals(gpu, latency, node_warning)
        return last

    def check_owner(self) -> None:
        """In a pod the webhook injected: claim a new run for the pod's namespace (rank 0) or
        check it; :class:`~ckpt_agent.errors.RunOwnershipError` when another namespace owns
        it or it is a legacy run nobody claimed (``ckpt claim``). A storage that fails to
        answer is logged, not fatal (the operator never claims: a run whose claim failed
        is legacy from then on, until an administrator claims it)."""
        owner = owner_from_env()
        if owner is None:
            return
        try:
            check_owner(self.storage, self.run_id, owner, claim=self.ranks.rank == 0)
        except (StorageError, CheckpointFormatError) as e:
            self.event("owner_unchecked", error=f"{type(e).__name__}: {e}")

    def apply_run_facts(self) -> None:
        """The operator's facts about the run win over the scheduler's own (also over the
        state a resume restores): the chain's start time (the long-run rule) and its MTBF."""
        if self.config.run_started_at is not None:
            self.scheduler.start_time = self.config.run_started_at
        if self.config.mtbf_seconds is not None:
            self.scheduler.set_mtbf(self.config.mtbf_seconds)

    def _on_write_latency(self, seconds: float) -> None:
        if self.storage.last_write_bytes <= tuning.LATENCY_SAMPLE_MAX_BYTES:
            self._latency.put(seconds * 1000.0)

    # ------------------------------------------------------------------ closing

    def close_writers(self) -> None:
        """Stop the validator's loader and the writer's pool (before the last feedback)."""
        self.parts.validator.close()
        self.parts.writer.close()

    def close(self) -> None:
        self.decisions.close()
        self.tensorboard.close()
        self.metrics.close()
        self.storage.on_write_latency = None
        self.parts.close()
        if self.own_work_dir and not _in_use(self.work_dir, os.getpid()):
            shutil.rmtree(self.work_dir, ignore_errors=True)
