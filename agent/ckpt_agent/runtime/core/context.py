"""What the parts of one :class:`~ckpt_agent.runtime.checkpointer.Checkpointer` share.

:class:`Ranks` says who this process is (rank, world size, whether it writes,
whether the state is sharded); :class:`Engine` opens and owns the services
every part uses — storage, catalog, writer, validator and the post-commit
pipeline (built by :class:`~ckpt_agent.persist.builder.PersistBuilder`),
scheduler, metrics, the decision log — plus the little mutable state they
share (the hash chain, the anomalies retention keeps, the write-latency
sample, the scheduler feedback of the background threads). :class:`Stats` and
the pipeline's counters are what :meth:`Checkpointer.summary` reports.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ckpt_agent import tuning
from ckpt_agent.decide.scheduler import (
    AdaptiveScheduler,
    Decision,
    SaveOutcome,
    SystemSignals,
)
from ckpt_agent.errors import CheckpointFormatError, StorageError
from ckpt_agent.format.layout import validate_run_id
from ckpt_agent.format.owner import check_owner, owner_from_env
from ckpt_agent.metrics import DecisionLog, Metrics
from ckpt_agent.persist.builder import PersistBuilder
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import AnomalyEvent, CheckpointRecord, Lineage, Tier
from ckpt_agent.runtime.core.sharded import is_dtensor
from ckpt_agent.runtime.core.tensorboard import ScalarWriter, TensorBoard
from ckpt_agent.storage.base import Storage

__all__ = ["OWNER_PID", "Engine", "Ranks", "Stats", "sweep_stale_work_dirs"]

log = logging.getLogger(__name__)

#: Anomalies kept for retention (the newest).
_ANOMALIES_KEPT = 100
#: Stall samples kept for the summary (the newest).
_STALLS_KEPT = 1000


@dataclass
class Stats:
    """Counters of the saving side of one checkpointer (the verdicts are the pipeline's)."""

    saves: int = 0
    deferred: int = 0
    waited: int = 0
    committed: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    stalls: list[float] = field(default_factory=list)


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
    """The services and shared state of one checkpointer (opened here, closed by :meth:`close`)."""

    def __init__(
        self,
        config: AgentConfig,
        ranks: Ranks,
        storage: Storage | None,
        *,
        gc_grace_s: float,
        summary_writer: ScalarWriter | None = None,
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
        self.parts = PersistBuilder(config, storage=storage).build(
            self.work_dir / name,
            metrics=self.metrics,
            emit=self.event,
            anomalies=self._anomalies_for,
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
        self.prev_hash: str | None = None
        """The manifest hash of the newest checkpoint (the chain's previous link)."""
        self.lineage = Lineage()
        """The resume lineage the next checkpoints carry (set by the resume)."""
        self.feedback: queue.SimpleQueue[SaveOutcome] = queue.SimpleQueue()
        """Persist outcomes of background threads, for the scheduler (training thread)."""
        self.write_latency_ms: float | None = None
        self._anomalies: list[AnomalyEvent] = []
        self._anomaly_lock = threading.Lock()
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
        with self._anomaly_lock:
            self._anomalies.append(
                AnomalyEvent(step=decision.step, kind=decision.anomaly, resolved_step=resolved)
            )
            del self._anomalies[:-_ANOMALIES_KEPT]

    def _decision_line(self, decision: Decision, at: float, loss: float | None) -> dict[str, Any]:
        """The decision's log line; updates the gauges and TensorBoard on the way."""
        logged = {"event": "decision", "time": at, **decision.to_dict()}
        if loss is not None:
            logged["loss"] = loss if math.isfinite(loss) else str(loss)
        self.metrics.score.set(decision.score)
        self.metrics.interval.set(decision.interval)
        self.tensorboard.scalars(decision)
        return logged

    def _anomalies_for(self, records: Sequence[CheckpointRecord]) -> list[AnomalyEvent]:
        """The anomalies this run's scheduler saw (retention protects checkpoints before them)."""
        del records
        with self._anomaly_lock:
            return list(self._anomalies)

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
        assert decision.tier is not None
        self.scheduler.settle(SaveOutcome.taken(decision, stall_seconds=stall_s))
        self.metrics.add_stall(decision.tier.value, stall_s)
        self.stats.saves += 1
        self.stats.stalls.append(stall_s)
        del self.stats.stalls[:-_STALLS_KEPT]
        self.event(
            "snapshot",
            step=decision.step,
            tier=decision.tier,
            lightweight=decision.lightweight,
            emergency=decision.emergency,
            stall_s=round(stall_s, 6),
            **details,
        )

    def drain_feedback(self) -> None:
        """Hand the background threads' persist outcomes to the scheduler (training thread)."""
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
        latency = self.write_latency_ms
        if probe_ms is not None:
            latency = probe_ms if latency is None else max(latency, probe_ms)
        return SystemSignals(gpu_errors=gpu, write_latency_ms=latency, node_warning=node_warning)

    def check_owner(self) -> None:
        """In a pod the webhook injected: claim the run for the pod's namespace (rank 0) or
        check it; :class:`~ckpt_agent.errors.RunOwnershipError` when another namespace owns
        it. The owner record is advisory for the agent: a storage that fails to answer is
        logged, not fatal (the operator claims the run too)."""
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
            self.write_latency_ms = seconds * 1000.0

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
