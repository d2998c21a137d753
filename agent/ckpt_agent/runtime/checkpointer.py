"""The integration API for a plain PyTorch loop: :class:`Checkpointer`.

.. code-block:: python

    ckpt = Checkpointer(model=model, optimizer=opt, lr_scheduler=sched,
                        grad_scaler=scaler, dataloader_state=loader_position)
    resume = ckpt.start()                 # restores everything; fresh runs get step 0
    for step in range(resume.step, total_steps):
        loss = train_one_step(...)
        ckpt.step(step, loss.item(), grad_norm)   # observes, decides, snapshots when due
    ckpt.close()                          # waits for the background work, reports errors

With ``config=None`` the configuration comes from the environment the
operator injects (``CKPT_CONFIG``, ``CKPT_RUN_ID``, ``CKPT_STORAGE_URL``,
``CKPT_RESUME_FROM``, ``CKPT_SIGNAL_FILE``, ``CKPT_WORK_DIR``,
``CKPT_METRICS_PORT``; see :class:`~ckpt_agent.policy.AgentConfig`), rank
and world size from ``RANK``/``WORLD_SIZE``.

What happens where:

* **training thread** (inside :meth:`Checkpointer.step`): the scheduler's
  decision; for a pulse/full, the copy of the state into reusable host
  buffers (:mod:`ckpt_agent.runtime.snapshot`) — the only stall; the heartbeat's
  RNG capture.
* **persister thread**: chunk, hash, de-duplicate, compress, write, fsync,
  publish the manifest and the COMMIT (:mod:`ckpt_agent.persist.writer`).
* **validator thread**: load the committed checkpoint in a separate process,
  compare shapes, record the verdict, then apply retention and collect
  unreferenced blobs.

A snapshot is never taken while the previous persist still owns the buffers:
a scheduled save is *deferred* to the next step (the scheduler is told, the
decision log says so); emergency saves, :meth:`Checkpointer.save_now` and
``backpressure="wait"`` wait for it instead. A failed persist is raised once,
from the next :meth:`~Checkpointer.step` / :meth:`~Checkpointer.save_now` /
:meth:`~Checkpointer.close`, and counted in ``ckpt_persist_errors_total``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import numpy as np
import torch

from ckpt_agent.decide.recovery import PlanStep, plan_recovery, walk
from ckpt_agent.decide.retention import classify, plan_retention
from ckpt_agent.decide.scheduler import AdaptiveScheduler, Decision, SystemSignals
from ckpt_agent.errors import CheckpointError, PersistError, ResumeError
from ckpt_agent.format import jsontree
from ckpt_agent.format.manifest import (
    CheckpointFormatError,
    CheckpointMeta,
    CheckpointNotFoundError,
    CommitManifest,
    Heartbeat,
    IntegrityError,
    RankManifest,
    ValidationRecord,
    list_checkpoints,
    read_checkpoint,
    read_heartbeat,
    read_rank_manifest,
    recover_request_key,
    validate_run_id,
    validation_key,
)
from ckpt_agent.format.shuffle import NUMPY_SHUFFLER
from ckpt_agent.metrics import DecisionLog, Metrics, TensorBoard
from ckpt_agent.persist.catalog import Catalog
from ckpt_agent.persist.housekeeping import (
    ManifestCache,
    append_audit,
    apply_retention,
    gc_blobs,
    who,
)
from ckpt_agent.persist.validate import ValidationOutcome, Validator, compare_meta
from ckpt_agent.persist.writer import BlobIndex, CheckpointWriter, CodecPolicy
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import AnomalyEvent, CheckpointRecord, CheckpointStatus, Tier, checkpoint_id
from ckpt_agent.runtime.distributed import DEFAULT_TIMEOUT_S as DEFAULT_DIST_TIMEOUT_S
from ckpt_agent.runtime.distributed import Comm, DecisionAgreement, LocalSignals, TwoPhaseCommit
from ckpt_agent.runtime.flash import FlashTarget
from ckpt_agent.runtime.serialization import (
    LoadedState,
    capture_rng,
    dtype_name,
    library_versions,
    load_tensors,
    restore_rng,
)
from ckpt_agent.runtime.sharded import ShardedSave
from ckpt_agent.runtime.snapshot import (
    BackgroundWorker,
    HeartbeatWriter,
    HostArena,
    JobError,
    Snapshot,
    take_snapshot,
)
from ckpt_agent.storage import StorageError, StorageOptions, open_storage
from ckpt_agent.storage.base import NotFoundError, Storage

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "PersistError",
    "ResumeError",
    "ResumePoint",
]

log = logging.getLogger(__name__)

Json = Any
TRAIN_CONFIG_FILE = "train_config.json"
#: Writes up to this size count as latency samples for the scheduler's system layer
#: (big blob writes measure bandwidth, not latency).
LATENCY_SAMPLE_MAX_BYTES = 1024 * 1024
#: Validations that may queue up behind the persister before it waits.
VALIDATION_BACKLOG = 4
#: Pending checkpoints verified on start (newest first) so that a crash between
#: commit and validation does not make the newest checkpoint unusable.
MAX_PENDING_PROMOTIONS = 3


@dataclass(frozen=True)
class ResumePoint:
    """Where training continues, as returned by :meth:`Checkpointer.start`."""

    step: int
    """The next step to run (0 for a fresh start; checkpoint step + 1 after a resume)."""
    checkpoint_id: str | None = None
    """The checkpoint restored (None: fresh start)."""
    checkpoint_step: int | None = None
    action: str = "fresh"
    """``fresh``, ``resume``, ``resume_from`` (operator's choice), ``manual`` or
    ``rebuild_from_heartbeat``."""
    exact: bool = True
    """Bit-exact continuation (False: lightweight/approximate source or heartbeat rebuild)."""
    data_state: object = None
    """The saved data position (applied to ``dataloader_state`` if it has ``load_state_dict``)."""
    epoch: int | None = None
    train_config: dict[str, Any] | None = None
    """The saved ``train_config.json`` when the source is a full checkpoint."""
    reason: str = ""
    rejected: tuple[tuple[str, str], ...] = ()
    """Checkpoints tried and rejected on the way, with why."""
    warnings: tuple[str, ...] = ()

    @property
    def resumed(self) -> bool:
        return self.checkpoint_id is not None


@dataclass
class _PersistJob:
    snapshot: Snapshot
    decision: Decision
    submitted: float


@dataclass
class _ValidateJob:
    checkpoint_id: str
    tier: Tier
    step: int
    lightweight: bool
    expected: dict[str, tuple[str, tuple[int, ...]]]
    manifest_hash: str
    world_size: int = 1


@dataclass
class _Candidate:
    """A checkpoint loaded and checked during :meth:`Checkpointer.start`."""

    record: CheckpointRecord
    loaded: LoadedState | None = None
    heartbeat: Heartbeat | None = None
    manifest_hash: str = ""
    own: LoadedState | None = None
    """This rank's own part (rank > 0 of a multi-rank checkpoint): RNG, data position."""


@dataclass
class _Stats:
    saves: int = 0
    deferred: int = 0
    waited: int = 0
    committed: int = 0
    valid: int = 0
    corrupted: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    stalls: list[float] = field(default_factory=list)


def _storage_options(config: AgentConfig) -> StorageOptions:
    opts = StorageOptions.from_env()
    s3 = config.s3
    if s3 is None or not config.storage_url.startswith("s3://"):
        return opts
    sse = s3.server_side_encryption
    return opts.replace(
        endpoint_url=s3.endpoint or opts.endpoint_url,
        region=s3.region,
        path_style=s3.path_style or None,
        sse=sse.mode.value,
        kms_key_id=sse.kms_key_id,
        part_size_bytes=s3.part_size_mb * 1024 * 1024,
        max_concurrency=s3.max_concurrency,
        max_attempts=s3.max_attempts,
    )


def _dist_initialized() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return bool(dist.is_available() and dist.is_initialized())


def _has_dtensors(model: torch.nn.Module) -> bool:
    from ckpt_agent.runtime.sharded import is_dtensor

    return any(is_dtensor(v) for v in model.state_dict().values())


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else None


class Checkpointer:
    """Adaptive, tiered, low-stall checkpointing for one training process (see module doc).

    Args:
        config: the agent config; ``None`` reads it from the environment.
        model: the ``nn.Module`` (its ``state_dict`` is saved and restored strictly).
        optimizer, lr_scheduler, grad_scaler: anything with ``state_dict``/``load_state_dict``.
        dataloader_state: the data position — an object with
            ``state_dict``/``load_state_dict`` (saved and restored), or a callable
            returning it (saved; handed back in :attr:`ResumePoint.data_state`).
            Keep it small: ids and offsets, not data (it is in every heartbeat).
        train_config: JSON-able training configuration, stored as
            ``train_config.json`` in full checkpoints.
        rank, world_size: default ``RANK``/``WORLD_SIZE`` (then 0/1). With several
            ranks, rank 0 writes the (replicated) state and every rank restores it.
        storage: an open :class:`~ckpt_agent.storage.Storage` (default: from the config URL).
        handle_sigterm: install a SIGTERM handler: the next :meth:`step` saves a full
            checkpoint, waits for its commit and (``exit_on_sigterm``) exits with 143.
        backpressure: ``defer`` (skip a due save while a persist runs; retried next
            step) or ``wait`` (block until the persist finishes).
        approximate_threshold: opt-in approximate optimizer filter: momentum buffers
            whose largest change since the last snapshot is below it are not
            re-copied (their previous blob is re-used); such checkpoints are
            marked approximate. ``None`` (default): exact.
        on_persist_error: ``raise`` (default) or ``warn``.
        preallocate: allocate and touch the host buffers in :meth:`start`, so the
            first save stalls no more than the others.
        gc_grace_s: age under which an unreferenced blob is kept by the automatic
            GC (default 0 for a single writer, an hour with several ranks).
        dist_timeout_s: timeout of the agent's own gloo groups (agreement, two-phase
            commit): a rank that hangs longer fails the save instead of blocking forever.

    Several ranks (``torch.distributed`` initialized, ``world_size > 1``): every
    call of :meth:`step`, :meth:`save_now` and :meth:`close` is collective. The
    save decision is agreed by all ranks, each rank writes its own part (rank 0
    the shared state, every rank its RNG and data position) and rank 0 publishes
    ``COMMIT`` only when every part is written and verified (two-phase commit).

    With ``config.shm_dir`` (``CKPT_SHM_DIR``) the snapshot goes to shared memory
    and a persister process — the pod's sidecar, or a local subprocess started
    here — writes, validates and records it (flash checkpoints, :mod:`ckpt_agent.runtime.flash`).
    """

    def __init__(
        self,
        config: AgentConfig | None = None,
        *,
        model: torch.nn.Module,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        grad_scaler: Any = None,
        dataloader_state: Callable[[], object] | object | None = None,
        train_config: dict[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage: Storage | None = None,
        handle_sigterm: bool = False,
        exit_on_sigterm: bool = True,
        backpressure: Literal["defer", "wait"] = "defer",
        approximate_threshold: float | None = None,
        on_persist_error: Literal["raise", "warn"] = "raise",
        preallocate: bool = True,
        gc_grace_s: float | None = None,
        dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
    ) -> None:
        self.config = config if config is not None else AgentConfig.from_env()
        self.run_id = validate_run_id(self.config.run_id)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler
        self.dataloader_state = dataloader_state
        self.train_config = train_config
        self._train_config_bytes: bytes | None = None
        if train_config is not None:
            try:
                self._train_config_bytes = json.dumps(
                    train_config, sort_keys=True, indent=2, allow_nan=False
                ).encode()
            except (TypeError, ValueError) as e:
                raise TypeError(f"train_config must be JSON-serializable: {e}") from None
        self.rank = rank if rank is not None else (_env_int("RANK") or 0)
        self.world_size = world_size if world_size is not None else (_env_int("WORLD_SIZE") or 1)
        if not 0 <= self.rank < max(self.world_size, 1):
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        self.coordinator = self.rank == 0
        """Rank 0: commits, validates, applies retention, records verdicts."""
        self.distributed = self.world_size > 1 and _dist_initialized()
        """Several ranks with torch.distributed: agreed decisions, every rank writes its part,
        two-phase commit (:mod:`ckpt_agent.runtime.distributed`). Without an initialized process
        group, rank 0 writes the (replicated) state alone."""
        self.writes = self.coordinator or self.distributed
        self.sharded = self.distributed and _has_dtensors(model)
        """FSDP2/DTensor state: every rank writes its own shards, planned by DCP
        (:mod:`ckpt_agent.runtime.sharded`); a resume may use another world size."""
        if backpressure not in ("defer", "wait"):
            raise ValueError("backpressure must be 'defer' or 'wait'")
        self.backpressure = backpressure
        if approximate_threshold is not None and not approximate_threshold > 0:
            raise ValueError("approximate_threshold must be > 0 (or None for exact checkpoints)")
        self.approximate_threshold = approximate_threshold
        self.on_persist_error = on_persist_error
        self.preallocate = preallocate
        self.handle_sigterm = handle_sigterm
        self.exit_on_sigterm = exit_on_sigterm
        self.gc_grace_s = (
            gc_grace_s if gc_grace_s is not None else (0.0 if self.world_size == 1 else 3600.0)
        )

        self._own_storage = storage is None
        self.storage = storage or open_storage(
            self.config.storage_url, _storage_options(self.config)
        )
        self.work_dir = Path(
            self.config.work_dir or tempfile.mkdtemp(prefix=f"ckpt-{self.run_id}-")
        )
        self.work_dir.mkdir(parents=True, exist_ok=True)

        self.metrics = Metrics()
        self.decisions = DecisionLog(self.work_dir / f"decisions.rank{self.rank}.jsonl")
        # ranks of one pod share the work dir: one catalog file each (rank 0 keeps the usual name)
        name = "catalog.sqlite" if self.rank == 0 else f"catalog.rank{self.rank}.sqlite"
        self.catalog = Catalog(self.work_dir / name)
        self.tensorboard = TensorBoard(self.work_dir / "tensorboard")
        self.scheduler = AdaptiveScheduler(self.config.scheduler, self.config.tiers)
        comp = self.config.compression
        self.index = BlobIndex()
        self.writer = CheckpointWriter(
            self.storage,
            self.run_id,
            codec=CodecPolicy.from_spec(comp),
            index=self.index,
            shuffler=NUMPY_SHUFFLER,
        )
        self.validator = Validator(self.storage, self.run_id, self.config.validation)
        self.arena = HostArena()
        self.stats = _Stats()

        self._store_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._gc_cache = ManifestCache()
        self._feedback: queue.SimpleQueue[tuple[Tier, float]] = queue.SimpleQueue()
        self._anomalies: list[AnomalyEvent] = []
        self._prev_hash: str | None = None
        self._last_step: int | None = None
        self._last_valid_step = -1
        self._resume: ResumePoint | None = None
        self._started = False
        self._closed = False
        self._sigterm = False
        self._old_sigterm: Any = None
        self._signal_seen: tuple[int, int] | None = None
        self._signal_content: bytes | None = None
        self._persister: BackgroundWorker[_PersistJob] | None = None
        self._post: BackgroundWorker[_ValidateJob] | None = None
        self._heartbeat: HeartbeatWriter | None = None
        self.storage.on_write_latency = self._on_write_latency
        self._write_latency_ms: float | None = None
        # multi-rank (runtime.distributed) and flash checkpoints (runtime.flash)
        self.dist_timeout_s = dist_timeout_s
        self._agreement: DecisionAgreement | None = None
        self._committer: TwoPhaseCommit | None = None
        self._control: Comm | None = None
        self._emergency_flag = False
        self._weights_from: str | None = None
        self._flash: FlashTarget | None = None
        self._flash_errors: list[tuple[str, str]] = []
        self._flash_pending: dict[int, tuple[Tier, str]] = {}
        if self.config.shm_dir and self.writes:
            self._flash = FlashTarget(
                self.config,
                self.rank,
                self.world_size if self.distributed else 1,
                work_dir=self.work_dir,
            )

    # ================================================================== lifecycle

    def start(self) -> ResumePoint:
        """Restore the newest usable state (or ``config.resume_from`` exactly); start the workers.

        Raises :class:`ResumeError` when checkpoints exist but none can be
        restored (never a silent fresh start), or when ``resume_from`` is gone,
        corrupted or from a different model.
        """
        if self._started:
            raise CheckpointError("start() was already called")
        self._started = True
        t0 = time.perf_counter()
        try:
            if self.distributed:
                self._setup_distributed()
            if self._flash is not None:
                self._flash.flush_previous()  # a dead trainer's last snapshot goes first
            if self.distributed:
                resume = self._agreed_resume_point()
            else:
                resume = self._shm_resume_point() or self._resume_point()
        except BaseException as e:
            self._event("resume_failed", error=f"{type(e).__name__}: {e}")
            try:
                self.close()
            except Exception:
                log.warning("cleanup after a failed start failed", exc_info=True)
            raise
        self._resume = resume
        self._last_step = resume.step - 1 if resume.step > 0 else None
        self._event(
            "start",
            action=resume.action,
            checkpoint=resume.checkpoint_id,
            next_step=resume.step,
            exact=resume.exact,
            reason=resume.reason,
            rejected=[list(r) for r in resume.rejected],
            seconds=round(time.perf_counter() - t0, 4),
        )
        if self._flash is not None:
            self._flash.start()  # the persister (sidecar / subprocess) validates and records
        elif self.writes:
            self._persister = BackgroundWorker(
                f"ckpt-persist-{self.rank}",
                self._persist_job,
                capacity=1,
                describe=lambda j: f"persisting {j.snapshot.tier.value} of step {j.snapshot.step}",
            )
        if self.writes and self.coordinator and self._flash is None:
            self._post = BackgroundWorker(
                f"ckpt-validate-{self.rank}",
                self._validate_job,
                capacity=VALIDATION_BACKLOG,
                describe=lambda j: f"validating {j.checkpoint_id}",
            )
        if self.config.tiers.heartbeat.enabled:
            self._heartbeat = HeartbeatWriter(self.storage, self.run_id, self.rank)
            try:
                ring = read_heartbeat(self.storage, self.run_id, self.rank)
            except (CheckpointFormatError, StorageError):
                ring = []
            self._heartbeat.seed(ring, resume.step - 1)
        if self.preallocate and self.writes and not self.sharded:
            if self._flash is None:
                self._warm_arena()
            else:
                step = self._last_step if self._last_step is not None else 0
                self._flash.prepare(
                    self._sections(lightweight=False, step=step),
                    len(self._train_config_bytes or b""),
                )
        self._init_signal_file()
        if self.handle_sigterm:
            self._install_sigterm()
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port)
        self.decisions.flush()
        return resume

    def close(self, *, final_save: bool = False, timeout: float | None = None) -> None:
        """Optionally save, wait for every background job, release resources, report errors."""
        if self._closed:
            return
        error: BaseException | None = None
        try:
            if final_save and self._started and self.writes:
                self.save_now("final save on close")
        except BaseException as e:
            error = e
        self._closed = True
        if self._persister is not None:
            self._persister.close(timeout)
        if self._post is not None:
            self._post.close(timeout)
        if self._flash is not None:
            self._drain_feedback()
            if not self._flash.close(timeout if timeout is not None else 300.0):
                self._flash_errors.append(
                    ("persisting (local persister)", "the local persister did not finish in time")
                )
        self.validator.close()
        self.writer.close()
        if self._heartbeat is not None:
            self._heartbeat.close(timeout)
        self._drain_feedback()
        self._restore_sigterm()
        self._event("close", stats=self.summary())
        pending = self._collect_errors()
        self.decisions.close()
        self.tensorboard.close()
        self.metrics.close()
        self.catalog.close()
        self.storage.on_write_latency = None
        if self._own_storage:
            self.storage.close()
        if error is not None:
            raise error
        if pending is not None:
            raise pending

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:
                log.exception("close() after an error failed")

    # ================================================================== per step

    def step(
        self, step: int, loss: float | torch.Tensor, grad_norm: float | torch.Tensor | None = None
    ) -> Decision:
        """Observe one finished optimizer step, decide, and snapshot when a save is due.

        Call it after ``optimizer.step()`` (and ``lr_scheduler.step()``) of
        ``step``: a checkpoint taken here resumes at ``step + 1``.
        """
        self._check_running()
        self._raise_errors()
        self._drain_feedback()
        if self._sigterm and self._agreement is None:
            self._on_sigterm_step(step)
        self._poll_signal_file()
        system = self._system_signals()
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().item()
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.detach().item()
        busy: bool | None = None
        stop = False
        if self._agreement is not None:  # every rank: same inputs, same decision
            agreed = self._agreement.agree(
                self.scheduler,
                LocalSignals(
                    step=step,
                    loss=float(loss),
                    grad_norm=None if grad_norm is None else float(grad_norm),
                    system=system,
                    busy=self._busy(),
                    emergency=self._emergency_flag,
                    stop=self._sigterm,
                ),
            )
            self._emergency_flag = False
            decision, busy, stop = agreed.decision, agreed.any_busy, agreed.stop
            if agreed.busy_ranks or agreed.emergency_ranks or agreed.stop_ranks:
                self._event(
                    "agreement",
                    step=step,
                    busy_ranks=list(agreed.busy_ranks),
                    emergency_ranks=list(agreed.emergency_ranks),
                    stop_ranks=list(agreed.stop_ranks),
                )
        else:
            decision = self.scheduler.observe(step, float(loss), grad_norm, system=system)
        self._last_step = step
        self.decisions.write({"event": "decision", "time": time.time(), **decision.to_dict()})
        self.metrics.score.set(decision.score)
        self.metrics.interval.set(decision.interval)
        self.tensorboard.scalars(step, decision.score, decision.interval)
        if decision.anomaly is not None:
            with self._state_lock:
                self._anomalies.append(
                    AnomalyEvent(
                        step=step,
                        kind=decision.anomaly,
                        resolved_step=step + self.config.tiers.pulse.base_interval,
                    )
                )
                del self._anomalies[:-100]
        if decision.save and decision.tier is not None:
            self._write_heartbeat(step)
            if decision.tier in (Tier.PULSE, Tier.FULL) and self.writes:
                self._save(decision, busy=busy, force=stop)
        if stop:
            self._on_agreed_stop(step)
        return decision

    def wants_grad_norm(self, step: int) -> bool:
        """Whether :meth:`step` uses a gradient norm at ``step`` (skip computing it otherwise)."""
        return self.scheduler.wants_grad_norm(step)

    def save_now(
        self, reason: str, *, tier: Tier = Tier.FULL, step: int | None = None, wait: bool = True
    ) -> str | None:
        """Take an emergency checkpoint now (waiting for a running persist first).

        Call it between steps. ``step`` defaults to the last step passed to
        :meth:`step`. With ``wait`` it returns once the checkpoint is committed
        (validation continues in the background). Returns the checkpoint id
        (None on ranks that do not write). With several ranks it is collective:
        call it on every rank.
        """
        self._check_running()
        self._raise_errors()
        if not self.writes:
            return None
        if step is None:
            step = self._last_step if self._last_step is not None else 0
        decision = Decision(
            step=step, save=True, tier=Tier(tier), emergency=True, reason=f"save_now: {reason}"
        )
        self.scheduler.adopt(decision)
        self._event("save_now", step=step, tier=decision.tier, reason=reason)
        self._write_heartbeat(step)
        ckpt_id = self._save(decision, force=True)
        if wait:
            self._wait_persisted()
            self._raise_errors()
        return ckpt_id

    def wait(self, timeout: float | None = None, *, validation: bool = True) -> bool:
        """Wait for the running persist (and validations); False on timeout. Raises errors."""
        ok = self._wait_persisted(timeout)
        if ok and validation and self._post is not None:
            ok = self._post.wait_idle(timeout)
        if self._heartbeat is not None:
            self._heartbeat.flush(timeout)
        self._drain_feedback()
        self._raise_errors()
        return ok

    @property
    def stop_requested(self) -> bool:
        """A SIGTERM arrived (on any rank, with several; with ``exit_on_sigterm=False``
        the loop should end)."""
        return self._sigterm

    @property
    def resume_point(self) -> ResumePoint | None:
        return self._resume

    def summary(self) -> dict[str, Any]:
        s = self.stats
        stalls = sorted(s.stalls)
        return {
            "saves": s.saves,
            "deferred": s.deferred,
            "waited": s.waited,
            "committed": s.committed,
            "valid": s.valid,
            "corrupted": s.corrupted,
            "bytes_written": s.bytes_written,
            "bytes_reused": s.bytes_reused,
            "stall_p50_s": stalls[len(stalls) // 2] if stalls else None,
            "stall_max_s": stalls[-1] if stalls else None,
            "last_valid_step": self._last_valid_step,
        }

    # ================================================================== saving

    def _sections(self, *, lightweight: bool, step: int) -> dict[str, object]:
        # Shared (replicated) state is written once, by rank 0; every rank writes its own
        # progress, RNG and data position.
        shared = self.coordinator or not self.distributed
        sections: dict[str, object] = {
            "progress": {"step": step, "world_size": self.world_size, "rank": self.rank},
        }
        if self.sharded:  # model + optimizer: this rank's shards (DCP planning)
            sections["sharded"] = self._sharded_save(lightweight).section()
        elif shared:
            sections["model"] = self.model.state_dict()
        if not lightweight and shared:
            if self.optimizer is not None and not self.sharded:
                sections["optimizer"] = self.optimizer.state_dict()
            if self.lr_scheduler is not None:
                sections["lr_scheduler"] = self.lr_scheduler.state_dict()
            if self.grad_scaler is not None:
                sections["grad_scaler"] = self.grad_scaler.state_dict()
        sections["rng"] = capture_rng()
        data = self._data_state()
        if data is not None:
            sections["data"] = data
        if shared:
            sections["scheduler"] = self.scheduler.state_dict()
        return sections

    def _data_state(self) -> object:
        ds = self.dataloader_state
        if ds is None:
            return None
        sd = getattr(ds, "state_dict", None)
        if callable(sd):
            return sd()
        if callable(ds):
            return ds()
        raise TypeError(
            "dataloader_state must have state_dict()/load_state_dict() or be a callable "
            f"returning the data position, not {type(ds).__name__}"
        )

    def _warm_arena(self) -> None:
        """Allocate and touch every host buffer once, outside the training loop."""
        step = self._last_step if self._last_step is not None else 0
        take_snapshot(step, Tier.FULL, self._sections(lightweight=False, step=step), self.arena)

    def _save(
        self, decision: Decision, *, force: bool = False, busy: bool | None = None
    ) -> str | None:
        """Snapshot now (``busy``: agreed by all ranks; None = this rank's persister)."""
        assert decision.tier is not None
        tier = decision.tier
        step = decision.step
        if busy is None:
            busy = self._busy()
        if busy:
            if self.backpressure == "wait" or force or decision.emergency:
                t0 = time.perf_counter()
                self._wait_free()
                waited = time.perf_counter() - t0
                self.stats.waited += 1
                self.metrics.backpressure.labels(action="waited").inc()
                self._event(
                    "backpressure", step=step, tier=tier, action="waited", seconds=round(waited, 6)
                )
                self._raise_errors()
            else:
                self.scheduler.record_failed(decision)
                self.stats.deferred += 1
                self.metrics.backpressure.labels(action="deferred").inc()
                self._event(
                    "backpressure",
                    step=step,
                    tier=tier,
                    action="deferred",
                    reason="previous persist still running; the save is due again next step",
                )
                return None
        files = {}
        if tier == Tier.FULL and self._train_config_bytes is not None and self.coordinator:
            files[TRAIN_CONFIG_FILE] = self._train_config_bytes
        if self._flash is not None:
            return self._flash_save(decision, files)
        assert self._persister is not None
        approx = None if decision.lightweight else self.approximate_threshold
        snap = take_snapshot(
            step,
            tier,
            self._sections(lightweight=decision.lightweight, step=step),
            self.arena,
            files=files,
            approx_threshold=approx,
        )
        self._record_snapshot(
            decision, step, tier, snap.stall_s, bytes=snap.nbytes, approximate=snap.approximate
        )
        ok = self._persister.submit(_PersistJob(snap, decision, time.perf_counter()))
        assert ok, "persister accepted no job although idle"
        return checkpoint_id(tier, step)

    def _record_snapshot(
        self, decision: Decision, step: int, tier: Tier, stall_s: float, **details: Any
    ) -> None:
        """Book a taken snapshot: scheduler feedback, stall metrics/stats, the event."""
        self.scheduler.record_save(decision, step, stall_seconds=stall_s)
        self.metrics.stall.labels(tier=tier.value).observe(stall_s)
        self.stats.saves += 1
        self.stats.stalls.append(stall_s)
        del self.stats.stalls[:-1000]
        self._event(
            "snapshot",
            step=step,
            tier=tier,
            lightweight=decision.lightweight,
            emergency=decision.emergency,
            stall_s=round(stall_s, 6),
            **details,
        )

    # ------------------------------------------------------------------ persister thread

    def _persist_job(self, job: _PersistJob) -> None:
        snap, d = job.snapshot, job.decision
        sections = tuple(snap.tree)
        meta = CheckpointMeta(
            run_id=self.run_id,
            step=snap.step,
            tier=snap.tier,
            world_size=self.world_size if self._committer is not None else 1,
            created_at=time.time(),
            score=d.score,
            components=dict(d.components),
            retention_class=classify(d.score, self.config.retention),
            reason=d.reason,
            anomaly=d.anomaly,
            lightweight=d.lightweight,
            approximate=snap.approximate,
            emergency=d.emergency,
            prev_hash=self._prev_hash,
            sections=sections,
            versions=library_versions(),
        )
        commit: CommitManifest | None
        if self._committer is not None:  # every rank its part; rank 0 commits when all verified
            with self._store_lock:
                result = self._committer.run(meta, snap.tree, snap.sources(), snap.files)
            written, manifest_hash, size_bytes = result.written, result.manifest_hash, 0
            commit = result.checkpoint.commit if result.checkpoint is not None else None
            size_bytes = result.size_bytes if commit is not None else written.bytes_new
        else:
            with self._store_lock:
                written = self.writer.write_rank(meta, 0, snap.tree, snap.sources(), snap.files)
                committed = self.writer.commit(meta, [written])
            manifest_hash, size_bytes = committed.manifest_hash, committed.size_bytes
            commit = committed.commit
        persist_s = time.perf_counter() - job.submitted
        self._prev_hash = manifest_hash
        tier = snap.tier.value
        self.metrics.save_latency.labels(tier=tier).observe(persist_s)
        self.metrics.bytes_written.labels(tier=tier).inc(size_bytes)
        self.metrics.bytes_reused.labels(tier=tier).inc(written.bytes_reused)
        self.stats.committed += 1
        self.stats.bytes_written += size_bytes
        self.stats.bytes_reused += written.bytes_reused
        self._feedback.put((snap.tier, persist_s))
        if commit is not None:
            record = commit.record(manifest_hash, CheckpointStatus.PENDING)
            record = replace(record, size_bytes=size_bytes)
            self.catalog.upsert(
                self.run_id, record, timings={"stall_s": snap.stall_s, "persist_s": persist_s}
            )
        self._event(
            "committed",
            checkpoint=meta.checkpoint_id,
            step=snap.step,
            tier=snap.tier,
            persist_s=round(persist_s, 6),
            bytes_new=size_bytes,
            bytes_reused=written.bytes_reused,
            blobs_new=written.blobs_new,
            blobs_reused=written.blobs_reused,
            manifest_hash=manifest_hash,
            timings={k: round(v, 6) for k, v in written.timings.items()},
        )
        if self._post is None:
            return  # validation, retention and GC are rank 0's
        self._post.wait_below(VALIDATION_BACKLOG)
        self._post.submit(
            _ValidateJob(
                checkpoint_id=meta.checkpoint_id,
                tier=snap.tier,
                step=snap.step,
                lightweight=d.lightweight,
                expected=snap.expected,
                manifest_hash=manifest_hash,
                world_size=meta.world_size,
            )
        )

    # ------------------------------------------------------------------ validator thread

    def _validate_job(self, job: _ValidateJob) -> None:
        outcome = self.validator.validate(job.checkpoint_id, job.expected)
        for r in range(1, job.world_size):  # every rank's part is loaded and checked
            other = self.validator.validate(job.checkpoint_id, None, rank=r)
            outcome.duration_s += other.duration_s
            outcome.bad_blobs.extend(other.bad_blobs)
            if outcome.valid and not other.valid:
                outcome.status = other.status
                outcome.reason = f"rank {r}: {other.reason}"
        if outcome.manifest_hash and outcome.manifest_hash != job.manifest_hash:
            outcome.status = CheckpointStatus.CORRUPTED
            outcome.reason = "the COMMIT changed after it was written: " + (outcome.reason or "")
        self._record_outcome(
            outcome, job.tier, job.step, has_weights=True, lightweight=job.lightweight
        )
        self._apply_retention()

    def _record_outcome(
        self,
        outcome: ValidationOutcome,
        tier: Tier,
        step: int,
        *,
        has_weights: bool,
        lightweight: bool = False,
    ) -> None:
        try:
            self.validator.record(outcome)
        except StorageError as e:
            log.warning("could not record the verdict on %s: %s", outcome.checkpoint_id, e)
        self.catalog.set_status(
            self.run_id,
            outcome.checkpoint_id,
            outcome.status,
            outcome.reason,
            validate_s=outcome.duration_s,
        )
        self.metrics.validation.observe(outcome.duration_s)
        self.metrics.checkpoints.labels(tier=tier.value, status=outcome.status.value).inc()
        if outcome.valid:
            self.stats.valid += 1
            if has_weights and not lightweight and step > self._last_valid_step:
                self._last_valid_step = step
                self.metrics.last_valid_step.set(step)
            self._event(
                "validated",
                checkpoint=outcome.checkpoint_id,
                status="valid",
                seconds=round(outcome.duration_s, 6),
                checks=outcome.checks,
            )
            return
        self.stats.corrupted += 1
        log.error(
            "ALERT checkpoint %s is CORRUPTED and will never be offered for resume: %s",
            outcome.checkpoint_id,
            outcome.reason,
        )
        self._event(
            "corrupted",
            checkpoint=outcome.checkpoint_id,
            reason=outcome.reason,
            bad_blobs=outcome.bad_blobs,
            checks=outcome.checks,
        )
        if outcome.bad_blobs:
            # Self-heal: a blob that does not hash to its name is useless to everyone;
            # drop it so that the next save writes it again instead of re-using it.
            with self._store_lock:
                self.index.forget(outcome.bad_blobs)
                from ckpt_agent.format.manifest import blob_key

                for digest in outcome.bad_blobs:
                    try:
                        self.storage.delete(blob_key(self.run_id, digest))
                    except StorageError:
                        log.warning("could not delete corrupted blob %s", digest[:16])

    def _apply_retention(self) -> None:
        with self._state_lock:
            anomalies = list(self._anomalies)
        with self._store_lock:
            records = list_checkpoints(self.storage, self.run_id)
            plan = plan_retention(records, self.config.retention, anomalies, time.time())
            deleted = apply_retention(self.storage, self.run_id, plan)
            gc = gc_blobs(self.storage, self.run_id, grace_s=self.gc_grace_s, cache=self._gc_cache)
            if gc.deleted:
                self.index.forget(gc.deleted)
        by_id = {r.id: r for r in records}
        for cid in deleted:
            r = by_id.get(cid)
            why = f"deleted by retention: {plan.delete.get(cid, '')}"
            if r is not None and r.status == CheckpointStatus.CORRUPTED:
                reason = r.extra.get("status_reason", "")
                self.catalog.set_status(
                    self.run_id, cid, CheckpointStatus.CORRUPTED, f"{reason}; {why}"
                )
                continue
            self.catalog.set_status(self.run_id, cid, CheckpointStatus.EXPIRED, why)
            if r is not None:
                self.metrics.checkpoints.labels(tier=r.tier.value, status="expired").inc()
        if deleted or gc.deleted:
            self._event(
                "retention",
                deleted={cid: plan.delete.get(cid, "") for cid in deleted},
                blobs_deleted=len(gc.deleted),
                bytes_freed=gc.freed_bytes,
                stale_folders=gc.stale_folders,
            )

    # ------------------------------------------------------------------ errors and feedback

    def _collect_errors(self) -> PersistError | None:
        errs = []
        for w in (self._persister, self._post):
            if w is not None:
                errs.extend(w.take_errors())
        while self._flash_errors:
            what, why = self._flash_errors.pop(0)
            errs.append(JobError(what, RuntimeError(why)))
        if not errs:
            return None
        self.metrics.persist_errors.inc(len(errs))
        for e in errs:
            self._event("error", what=e.what, error=f"{type(e.error).__name__}: {e.error}")
            tier = Tier.FULL if "full" in e.what else Tier.PULSE
            if e.what.startswith("persisting"):
                self.scheduler.record_failed(tier)
        first = errs[0]
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        err = PersistError(f"background checkpointing failed: {first.what}: {first.error}{more}")
        err.__cause__ = first.error
        return err

    def _raise_errors(self) -> None:
        err = self._collect_errors()
        if err is None:
            return
        if self.on_persist_error == "warn":
            log.warning("%s", err)
            return
        raise err

    def _drain_feedback(self) -> None:
        if self._flash is not None and self._flash.writer is not None:
            self._flash_feedback()
        while True:
            try:
                tier, persist_s = self._feedback.get_nowait()
            except queue.Empty:
                return
            self.scheduler.record_persist(tier, persist_s)

    def _on_write_latency(self, seconds: float) -> None:
        if self.storage.last_write_bytes <= LATENCY_SAMPLE_MAX_BYTES:
            self._write_latency_ms = seconds * 1000.0

    def _check_running(self) -> None:
        if not self._started:
            raise CheckpointError("call start() before step()/save_now()")
        if self._closed:
            raise CheckpointError("the checkpointer is closed")

    def _event(self, event: str, **fields: Any) -> None:
        out: dict[str, Any] = {"event": event, "time": time.time(), "rank": self.rank}
        for k, v in fields.items():
            out[k] = v.value if isinstance(v, Tier) else v
        self.decisions.write(out)
        if event != "decision":
            self.decisions.flush()

    # ------------------------------------------------------------------ several ranks

    def _setup_distributed(self) -> None:
        """Create the agent's gloo groups (collective, same order on every rank)."""
        self._control = Comm.new_group(timeout_s=self.dist_timeout_s)
        commit_comm = Comm.new_group(timeout_s=self.dist_timeout_s)
        if (self._control.rank, self._control.world_size) != (self.rank, self.world_size):
            raise CheckpointError(
                f"rank/world size {self.rank}/{self.world_size} disagree with torch.distributed "
                f"({self._control.rank}/{self._control.world_size})"
            )
        self._agreement = DecisionAgreement(self._control)
        if self._flash is None:
            self._committer = TwoPhaseCommit(commit_comm, self.writer)

    def _agreed_resume_point(self) -> ResumePoint:
        """Rank 0 walks the ladder; every rank restores exactly its choice."""
        assert self._control is not None
        if self.coordinator:
            try:
                point = self._resume_point()
            except BaseException as e:
                self._control.broadcast_json({"ok": False, "error": f"{type(e).__name__}: {e}"})
                raise
            self._control.broadcast_json(
                {
                    "ok": True,
                    "id": point.checkpoint_id,
                    "action": point.action,
                    "weights_from": self._weights_from,
                    "reason": point.reason,
                }
            )
            return point
        msg = self._control.broadcast_json(None)
        if not msg.get("ok"):
            raise ResumeError(f"rank 0 could not choose a checkpoint: {msg.get('error')}")
        if not msg.get("id"):
            return ResumePoint(step=0, reason=str(msg.get("reason") or "fresh start (rank 0)"))
        return self._resume_point(
            forced=(str(msg["id"]), msg.get("weights_from"), str(msg.get("action") or "resume"))
        )

    def _on_agreed_stop(self, step: int) -> None:
        """SIGTERM on some rank: every rank saved (emergency), waits for the commit, stops."""
        self._event("sigterm", step=step)
        self._sigterm = True
        self._wait_persisted()
        self._raise_errors()
        if self.exit_on_sigterm:
            self.close()
            raise SystemExit(143)

    # ------------------------------------------------------------------ persister state

    def _busy(self) -> bool:
        """The previous snapshot's buffers are still in use (persister / shared-memory slots)."""
        if self._flash is not None and self._flash.writer is not None:
            return self._flash.busy
        return self._persister is not None and self._persister.busy

    def _wait_free(self) -> None:
        if self._flash is not None and self._flash.writer is not None:
            self._flash.wait_free()
            self._drain_feedback()
        elif self._persister is not None:
            self._persister.wait_idle()

    def _wait_persisted(self, timeout: float | None = None) -> bool:
        """Wait until the last snapshot is committed (or handled by the persister)."""
        if self._flash is not None and self._flash.writer is not None:
            ok = self._flash.wait(timeout=timeout) is not None
            self._drain_feedback()
            return ok
        if self._persister is not None:
            return self._persister.wait_idle(timeout)
        return True

    def _system_signals(self) -> SystemSignals:
        latency = self._write_latency_ms
        gpu: int | None = None
        if self._flash is not None and self._flash.writer is not None:
            gpu, probe = self._flash.system_signals()
            if probe is not None:
                latency = probe if latency is None else max(latency, probe)
        return SystemSignals(gpu_errors=gpu, write_latency_ms=latency)

    # ------------------------------------------------------------------ sharded (FSDP) state

    def _sharded_state(self, lightweight: bool) -> dict[str, object]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None or lightweight:
            return {"model": get_model_state_dict(self.model)}
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optimizer": osd}

    def _sharded_save(self, lightweight: bool) -> ShardedSave:
        from ckpt_agent.runtime.sharded import plan_save

        return plan_save(self._sharded_state(lightweight), coordinator=self.coordinator)

    def _sharded_compat(self, manifest: RankManifest) -> list[str]:
        """Global shapes of the saved model shards vs the live (DTensor) model."""
        if "sharded" not in manifest.meta.sections:
            return ["the checkpoint holds no sharded state (saved without FSDP)"]
        if not self.sharded:
            return ["the checkpoint holds sharded (FSDP) state; the live model is not sharded"]
        state = manifest.state if isinstance(manifest.state, dict) else {}
        sec = state.get("sharded")
        layout = jsontree.decode(sec.get("layout")) if isinstance(sec, dict) else None
        if not isinstance(layout, dict):
            return ["the sharded section has no layout"]
        live = {
            f"model/{k}": tuple(int(x) for x in v.shape)
            for k, v in self.model.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        saved = {
            k: tuple(int(x) for x in v.get("size") or [])
            for k, v in layout.items()
            if k.startswith("model/") and isinstance(v, dict)
        }
        problems = [f"{k}: missing from the checkpoint" for k in sorted(live.keys() - saved)]
        problems += [f"{k}: not in the live model" for k in sorted(saved.keys() - live)]
        problems += [
            f"{k}: checkpoint has {list(saved[k])}, live model {list(live[k])}"
            for k in sorted(live.keys() & saved.keys())
            if live[k] != saved[k]
        ]
        return problems

    def _sharded_restore(self, ckpt_id: str, warnings: list[str]) -> None:
        """Reshard the saved model (and optimizer) into this world size's DTensors."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from ckpt_agent.runtime.sharded import load_sharded

        saved = read_checkpoint(self.storage, self.run_id, ckpt_id, 0)[1]
        sec = saved.state.get("sharded") if isinstance(saved.state, dict) else None
        layout = jsontree.decode(sec.get("layout")) if isinstance(sec, dict) else {}
        has_optim = isinstance(layout, dict) and any(k.startswith("optimizer/") for k in layout)
        target = self._sharded_state(lightweight=not has_optim)
        state = load_sharded(self.storage, self.run_id, ckpt_id, target)
        if self.optimizer is not None and "optimizer" in state:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],  # type: ignore[arg-type]
                optim_state_dict=state["optimizer"],  # type: ignore[arg-type]
            )
        else:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(self.model, state["model"])  # type: ignore[arg-type]
            if self.optimizer is not None:
                warnings.append(f"optimizer state is not in {ckpt_id} (lightweight checkpoint)")

    # ------------------------------------------------------------------ flash checkpoints

    def _flash_save(self, decision: Decision, files: dict[str, bytes]) -> str | None:
        """Copy the snapshot into shared memory; the persister process does the rest."""
        assert self._flash is not None and decision.tier is not None
        tier, step = decision.tier, decision.step
        sections = self._sections(lightweight=decision.lightweight, step=step)
        token = f"{step}-{tier.value}-{time.time_ns()}"
        if self._control is not None:  # one token for all ranks: parts of the same save
            token = str(self._control.broadcast_json(token if self.coordinator else None))
        progress = sections.get("progress")
        if isinstance(progress, dict):
            progress["token"] = token
        meta = {
            "score": decision.score,
            "components": dict(decision.components),
            "retention_class": classify(decision.score, self.config.retention).value,
            "reason": decision.reason,
            "anomaly": decision.anomaly,
            "lightweight": decision.lightweight,
            "approximate": False,
            "emergency": decision.emergency,
            "prev_hash": self._prev_hash,
            "resume_step": self._resume.checkpoint_step
            if self._resume is not None and self._resume.checkpoint_step is not None
            else -1,
            "versions": library_versions(),
            "token": token,
        }
        desc = self._flash.write(step, tier, sections, files=files, meta=meta)
        if desc is None:  # the slots were taken between the check and now: wait once
            self._flash.wait_free()
            desc = self._flash.write(step, tier, sections, files=files, meta=meta)
        if desc is None:
            self.scheduler.record_failed(decision)
            self._event(
                "backpressure",
                step=step,
                tier=tier,
                action="deferred",
                reason="no free shared-memory slot",
            )
            return None
        self._flash_pending[desc.seq] = (tier, checkpoint_id(tier, step))
        self._record_snapshot(
            decision,
            step,
            tier,
            desc.stall_s,
            bytes=desc.data_size,
            approximate=False,
            shm_seq=desc.seq,
            shm_slot=desc.slot,
        )
        return checkpoint_id(tier, step)

    def _flash_feedback(self) -> None:
        """The persister's newest result: persist time, commit hash, or the error."""
        assert self._flash is not None
        mark = self._flash.poll()
        if mark is None:
            return
        done = [seq for seq in self._flash_pending if seq <= mark.seq]
        tier = Tier.PULSE
        for seq in done:
            tier, _ = self._flash_pending.pop(seq)
        if not mark.ok:
            self._flash_errors.append(
                (f"persisting {tier.value} of step {mark.step} (shared memory)", mark.error)
            )
            return
        self.stats.committed += 1 if mark.committed else 0
        self.stats.bytes_written += mark.size_bytes
        self._feedback.put((tier, mark.persist_s))
        if mark.manifest_hash:
            self._prev_hash = mark.manifest_hash
        self.metrics.save_latency.labels(tier=tier.value).observe(mark.persist_s)
        self._event(
            "persisted",
            checkpoint=mark.checkpoint_id,
            step=mark.step,
            committed=mark.committed,
            manifest_hash=mark.manifest_hash,
            persist_s=round(mark.persist_s, 6),
            by="shared-memory persister",
        )

    def _shm_resume_point(self) -> ResumePoint | None:
        """In-place restart: restore the newest verified shared-memory snapshot when it is at
        least as new as anything in storage (None: resume from storage as usual)."""
        if self._flash is None or self.config.resume_from:
            return None
        records = self.catalog.rebuild_from_storage(self.storage, self.run_id)
        bad = (CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED)
        newest = max((r.step for r in records if r.has_weights and r.status not in bad), default=-1)
        if self._recover_request() is not None:
            return None  # a person asked for a specific checkpoint
        found = self._flash.restore_candidate(min_step=max(newest, 0))
        if found is None:
            return None
        desc = found.desc
        mark = self._flash.reader.persisted()
        committed_hash = (
            mark.manifest_hash
            if mark is not None and mark.seq == desc.seq and mark.committed
            else None
        )
        prev = desc.meta.get("prev_hash")
        rec = CheckpointRecord(
            id=desc.checkpoint_id,
            step=desc.step,
            tier=desc.tier,
            status=CheckpointStatus.VALID,
            manifest_hash=committed_hash or "",
            lightweight=bool(desc.meta.get("lightweight")),
            reason="shared-memory snapshot",
        )
        from ckpt_agent.format.manifest import TensorEntry

        meta = CheckpointMeta(
            run_id=self.run_id,
            step=desc.step,
            tier=desc.tier,
            lightweight=bool(desc.meta.get("lightweight")),
            sections=tuple(desc.tree),
            prev_hash=str(prev) if prev else None,
        )
        manifest = RankManifest(
            meta=meta,
            rank=self.rank,
            state=desc.tree,
            tensors={
                n: TensorEntry(dtype=t.dtype, shape=t.shape, nbytes=t.nbytes)
                for n, t in desc.tensors.items()
            },
            blobs={},
        )
        problems = self._compat_problems(manifest)
        if problems:
            log.warning("shared-memory snapshot does not fit the live model: %s", problems[:3])
            return None
        loaded = LoadedState(manifest=manifest, arrays=found.arrays, files=found.files)
        cand = _Candidate(record=rec, loaded=loaded, manifest_hash=committed_hash or "")
        point = self._restore(cand, action="resume_shm", weights=None, rejected={})
        if not committed_hash:
            self._prev_hash = str(prev) if prev else None
        return replace(
            point,
            reason=f"in-place restart: {desc.checkpoint_id} from shared memory "
            f"(verified against the persister's hashes; storage newest step {newest})",
        )

    # ------------------------------------------------------------------ heartbeat / signals

    def _write_heartbeat(self, step: int) -> None:
        if self._heartbeat is None:
            return
        data = self._data_state()
        epoch = data.get("epoch") if isinstance(data, dict) else None
        self._heartbeat.put(
            Heartbeat(
                step=step,
                time=time.time(),
                epoch=epoch if isinstance(epoch, int) else None,
                data=encode_inline(data),
                rng=encode_inline(capture_rng()),
            )
        )

    def _init_signal_file(self) -> None:
        path = self.config.signal_file
        if not path:
            return
        try:
            st = os.stat(path)
            self._signal_seen = (st.st_mtime_ns, st.st_size)
            self._signal_content = Path(path).read_bytes()
        except OSError:
            self._signal_seen = None
            self._signal_content = None

    def _poll_signal_file(self) -> None:
        path = self.config.signal_file
        if not path:
            return
        try:
            st = os.stat(path)
        except OSError:
            return
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._signal_seen:
            return
        self._signal_seen = seen
        try:
            content = Path(path).read_bytes()
        except OSError:
            return
        if content == self._signal_content:
            return
        self._signal_content = content
        if not content.strip():
            return
        request = content.decode(errors="replace").strip()[:200]
        if self._agreement is not None:
            self._emergency_flag = True  # every rank's scheduler gets it through the agreement
        else:
            self.scheduler.request_emergency(f"save-now signal {request!r}")
        self._event("signal", file=path, request=request)

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("handle_sigterm needs the main thread; SIGTERM handler not installed")
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            del signum, frame
            self._sigterm = True

        self._old_sigterm = signal.signal(signal.SIGTERM, handler)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _on_sigterm_step(self, step: int) -> None:
        """SIGTERM arrived: save the state of the step that just finished and (optionally) exit."""
        self._event("sigterm", step=step)
        if self.writes:
            self.save_now("SIGTERM (preemption)", step=step)
        if self.exit_on_sigterm:
            self.close()
            raise SystemExit(143)
        self._sigterm = False

    # ================================================================== resuming

    def _live_meta(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        for k, v in self.model.state_dict().items():
            if isinstance(v, torch.Tensor):
                out[f"model/{k}"] = (dtype_name(v.dtype), tuple(int(s) for s in v.shape))
        return out

    def _compat_problems(self, manifest: RankManifest) -> list[str]:
        """Why this checkpoint does not fit the live model/optimizer (empty: it fits)."""
        if self.sharded or "sharded" in manifest.meta.sections:
            return self._sharded_compat(manifest)
        got = {n: (t.dtype, t.shape) for n, t in manifest.tensors.items()}
        problems = compare_meta(self._live_meta(), got, prefix="model/")
        if "model" not in manifest.meta.sections:
            problems.append("the checkpoint holds no model weights")
        if self.optimizer is not None and "optimizer" in manifest.meta.sections:
            state = manifest.state.get("optimizer") if isinstance(manifest.state, dict) else None
            groups = state.get("param_groups") if isinstance(state, dict) else None
            live_groups = self.optimizer.param_groups
            counts = []
            if isinstance(groups, list):
                for g in groups:
                    params = g.get("params") if isinstance(g, dict) else None
                    counts.append(len(params) if isinstance(params, list) else -1)
            live_counts = [len(g["params"]) for g in live_groups]
            if counts != live_counts:
                problems.append(
                    f"optimizer: checkpoint has parameter groups of sizes {counts}, "
                    f"live optimizer {live_counts}"
                )
            else:
                params = [p for g in live_groups for p in g["params"]]
                prefix = "optimizer/state/"
                for name, t in manifest.tensors.items():
                    if not name.startswith(prefix):
                        continue
                    idx_s, _, key = name[len(prefix) :].partition("/")
                    if not idx_s.isdigit() or int(idx_s) >= len(params) or len(t.shape) == 0:
                        continue
                    want = tuple(params[int(idx_s)].shape)
                    if key not in ("step",) and t.shape != want:
                        problems.append(
                            f"{name}: checkpoint has {list(t.shape)}, parameter has {list(want)}"
                        )
        return problems

    def _load_candidate(self, rec: CheckpointRecord, rejected: dict[str, str]) -> _Candidate | None:
        """Load and check one checkpoint; None (with the reason in ``rejected``) if unusable."""
        self.metrics.recovery_attempts.inc()
        if rec.tier == Tier.HEARTBEAT:
            try:
                ring = read_heartbeat(self.storage, self.run_id, self.rank)
            except (CheckpointFormatError, StorageError) as e:
                rejected[rec.id] = f"heartbeat unreadable: {e}"
                return None
            hb = next((h for h in reversed(ring) if h.step == rec.step), None)
            if hb is None:
                rejected[rec.id] = "heartbeat ring no longer holds this step"
                return None
            return _Candidate(record=rec, heartbeat=hb)
        t0 = time.perf_counter()
        try:
            committed, manifest = read_checkpoint(self.storage, self.run_id, rec.id, 0)
            problems = self._compat_problems(manifest)
            if problems:
                more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
                rejected[rec.id] = (
                    "does not fit the live model (different model/optimizer shape): "
                    + "; ".join(problems[:4])
                    + more
                )
                return None
            loaded = load_tensors(self.storage, self.run_id, manifest, _unsharded(manifest))
            own: LoadedState | None = None
            ranks = {r.rank for r in committed.commit.ranks}
            if self.rank != 0 and self.rank in ranks:  # this rank's RNG and data position
                mine = read_rank_manifest(self.storage, self.run_id, committed, self.rank)
                own = load_tensors(self.storage, self.run_id, mine, _unsharded(mine))
        except CheckpointNotFoundError as e:
            rejected[rec.id] = str(e)
            return None
        except (CheckpointFormatError, IntegrityError, StorageError) as e:
            reason = f"{type(e).__name__}: {e}"
            rejected[rec.id] = reason
            self._mark(rec, CheckpointStatus.CORRUPTED, reason, time.perf_counter() - t0)
            return None
        if rec.status == CheckpointStatus.PENDING:
            self._mark(
                rec, CheckpointStatus.VALID, "", time.perf_counter() - t0, committed.manifest_hash
            )
        return _Candidate(record=rec, loaded=loaded, manifest_hash=committed.manifest_hash, own=own)

    def _mark(
        self,
        rec: CheckpointRecord,
        status: CheckpointStatus,
        reason: str,
        seconds: float,
        manifest_hash: str | None = None,
    ) -> None:
        """Record a verdict found while resuming (in storage and in the catalog)."""
        mh = manifest_hash or rec.manifest_hash
        if mh and self.coordinator:
            try:
                self.storage.commit(
                    validation_key(self.run_id, rec.id),
                    ValidationRecord(
                        checkpoint_id=rec.id,
                        commit_sha256=mh,
                        status=status,
                        reason=reason,
                        validated_at=time.time(),
                        checks=("hashes", "load (resume)", "shapes"),
                        duration_s=seconds,
                    ).to_bytes(),
                )
            except StorageError as e:
                log.warning("could not record the verdict on %s: %s", rec.id, e)
        self.catalog.set_status(self.run_id, rec.id, status, reason, validate_s=seconds)
        self.metrics.checkpoints.labels(tier=rec.tier.value, status=status.value).inc()
        if status == CheckpointStatus.CORRUPTED:
            log.error("ALERT checkpoint %s is CORRUPTED: %s", rec.id, reason)
            self._event("corrupted", checkpoint=rec.id, reason=reason, during="resume")

    def _resume_point(self, forced: tuple[str, str | None, str] | None = None) -> ResumePoint:
        """``forced`` = (checkpoint id, weights source, action): rank 0's choice, on other ranks."""
        records = self.catalog.rebuild_from_storage(self.storage, self.run_id)
        by_id = {r.id: r for r in records}
        weights = [r for r in records if r.has_weights and r.status == CheckpointStatus.VALID]
        if weights:
            self._last_valid_step = (
                max(r.step for r in weights if not r.lightweight)
                if any(not r.lightweight for r in weights)
                else -1
            )
            self.metrics.last_valid_step.set(self._last_valid_step)
        rejected: dict[str, str] = {}
        cache: dict[str, _Candidate | None] = {}

        def candidate(cid: str) -> _Candidate | None:
            if cid not in cache:
                rec = by_id.get(cid)
                cache[cid] = None if rec is None else self._load_candidate(rec, rejected)
            return cache[cid]

        # 1. the operator (or a person) named the checkpoint: exactly that one, or fail loudly.
        wanted = self.config.resume_from
        action = "resume_from"
        request: dict[str, Any] | None = None
        if forced is not None:
            wanted, action = forced[0], forced[2]
            request = {"checkpoint_id": wanted, "weights_from": forced[1]}
        elif not wanted:
            request = self._recover_request()
            if request is not None:
                wanted = str(request["checkpoint_id"])
                action = "manual"
        if wanted:
            rec = by_id.get(wanted)
            source = {"resume_from": "CKPT_RESUME_FROM", "manual": "RECOVER.json"}.get(
                action, "rank 0's choice"
            )
            if rec is None:
                known = ", ".join(r.id for r in records if r.tier != Tier.HEARTBEAT) or "none"
                raise ResumeError(
                    f"resume from {wanted!r} requested ({source}) "
                    f"but run {self.run_id!r} in {self.storage.url} has no committed checkpoint "
                    f"with that id (committed: {known})"
                )
            if rec.status in (CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED):
                raise ResumeError(
                    f"resume from {wanted!r} requested but it is {rec.status.value}: "
                    f"{rec.extra.get('status_reason', '')}"
                )
            cand = candidate(wanted)
            if cand is None:
                raise ResumeError(
                    f"resume from {wanted!r} requested but it cannot be restored: "
                    f"{rejected.get(wanted)}"
                )
            weights_from: _Candidate | None = None
            if cand.heartbeat is not None:
                src = str((request or {}).get("weights_from") or "")
                weights_from = candidate(src) if src else None
                if weights_from is None:
                    raise ResumeError(
                        f"{wanted} is a heartbeat: name a weights source (weights_from)"
                    )
            point = self._restore(cand, action=action, weights=weights_from, rejected=rejected)
            if request is not None and self.coordinator and forced is None:
                self._consume_recover_request(request, point)
            return point

        # 2. promote pending checkpoints newer than the newest valid one (crash before validation).
        newest_valid = max((r.step for r in weights), default=-1)
        pending = sorted(
            (
                r
                for r in records
                if r.status == CheckpointStatus.PENDING and r.has_weights and r.step > newest_valid
            ),
            key=lambda r: r.step,
            reverse=True,
        )[:MAX_PENDING_PROMOTIONS]
        for r in pending:
            cand = candidate(r.id)
            status = CheckpointStatus.VALID if cand is not None else CheckpointStatus.CORRUPTED
            if cand is None and "does not fit" in rejected.get(r.id, ""):
                status = CheckpointStatus.PENDING  # not its fault: leave it for the operator
            by_id[r.id] = r.with_status(status)
        records = sorted(by_id.values(), key=lambda r: (r.step, r.tier.value))

        # 3. the ladder.
        plan = plan_recovery(records, self.config.recovery)
        if plan.empty or plan.first() is None:
            if not any(r.has_weights for r in records):
                return ResumePoint(step=0, reason=plan.reason or "no checkpoints: fresh start")
            raise ResumeError(
                f"checkpoints exist for run {self.run_id!r} but none is usable: {plan.reason}; "
                + "; ".join(f"{k}: {v}" for k, v in list(plan.skipped.items())[:6])
                + " — use `ckpt recover --manual --step N --force` to choose one"
            )

        def verify(cid: str) -> bool:
            return candidate(cid) is not None

        chosen, failed = walk(plan, verify)
        if chosen is None:
            tried = dict.fromkeys(
                [s.checkpoint_id for s, _ in failed] + [s.weights_from or "" for s, _ in failed]
            )
            raise ResumeError(
                f"no checkpoint of run {self.run_id!r} could be restored; tried: "
                + "; ".join(f"{cid}: {rejected[cid]}" for cid in tried if cid in rejected)
            )
        cand = candidate(chosen.checkpoint_id)
        assert cand is not None
        weights_cand = candidate(chosen.weights_from) if chosen.weights_from else None
        return self._restore(
            cand, action=chosen.action, weights=weights_cand, rejected=rejected, plan_step=chosen
        )

    def _recover_request(self) -> dict[str, Any] | None:
        try:
            raw = self.storage.read(recover_request_key(self.run_id))
        except NotFoundError:
            return None
        try:
            req = json.loads(raw)
        except ValueError:
            raise ResumeError(f"{recover_request_key(self.run_id)} is not valid JSON") from None
        if not isinstance(req, dict) or not isinstance(req.get("checkpoint_id"), str):
            raise ResumeError(f"{recover_request_key(self.run_id)} names no checkpoint_id")
        return req

    def _consume_recover_request(self, request: dict[str, Any], point: ResumePoint) -> None:
        append_audit(
            self.storage,
            self.run_id,
            {
                "time": time.time(),
                "who": who(),
                "what": "manual recovery applied",
                "checkpoint": point.checkpoint_id,
                "request": request,
                "next_step": point.step,
            },
        )
        self.storage.delete(recover_request_key(self.run_id))

    def _restore(
        self,
        cand: _Candidate,
        *,
        action: str,
        weights: _Candidate | None,
        rejected: Mapping[str, str],
        plan_step: PlanStep | None = None,
    ) -> ResumePoint:
        warnings: list[str] = []
        source = cand if cand.loaded is not None else weights
        if source is None or source.loaded is None:
            raise ResumeError(f"{cand.record.id}: no weights to restore")
        state = source.loaded
        sections = state.manifest.meta.sections
        if "sharded" in sections:
            self._sharded_restore(source.record.id, warnings)
        else:
            self.model.load_state_dict(_as_dict(state.section("model"), "model"), strict=True)
        for name, obj in (
            ("optimizer", None if "sharded" in sections else self.optimizer),
            ("lr_scheduler", self.lr_scheduler),
            ("grad_scaler", self.grad_scaler),
        ):
            if obj is None:
                continue
            if name in sections:
                obj.load_state_dict(_as_dict(state.section(name), name))
            else:
                warnings.append(
                    f"{name} state is not in {source.record.id} (lightweight checkpoint)"
                )
        sched = state.section("scheduler")
        if isinstance(sched, dict):
            sched = dict(sched)
            sched["last_now"] = None  # the previous process's clock: do not fold the gap in
            try:
                self.scheduler.load_state_dict(sched)
            except (ValueError, KeyError, TypeError) as e:
                warnings.append(f"scheduler state not restored: {e}")
        step = source.record.step
        mine = state
        per_rank_exact = True
        if self.rank != 0:  # this rank's RNG and data position come from its own part
            if source.own is not None:
                mine = source.own
            elif source.loaded.manifest.meta.world_size > 1 or self.distributed:
                per_rank_exact = False
                warnings.append(
                    f"{source.record.id} has no part of rank {self.rank} (saved with world size "
                    f"{source.loaded.manifest.meta.world_size}): rank 0's RNG and data position "
                    "are used, not exact"
                )
        saved_ws = source.loaded.manifest.meta.world_size
        live_ws = self.world_size if self.distributed else 1
        if saved_ws != live_ws:
            per_rank_exact = False
            warnings.append(
                f"{source.record.id} was saved at world size {saved_ws}, resumed at {live_ws}: "
                "the state is restored, the continuation is not bitwise the original run's"
            )
        data: object = mine.section("data")
        rng = mine.section("rng")
        self._weights_from = weights.record.id if weights is not None else None
        if cand.heartbeat is not None:  # heartbeat rebuild: step, data and RNG from the heartbeat
            step = cand.heartbeat.step
            data = decode_inline(cand.heartbeat.data)
            rng = decode_inline(cand.heartbeat.rng)
            warnings.append(
                f"rebuilt from heartbeat at step {step} with weights of step "
                f"{source.record.step}: not exact"
            )
        if isinstance(rng, dict):
            warnings.extend(restore_rng(rng))
        if data is not None and self.dataloader_state is not None:
            load = getattr(self.dataloader_state, "load_state_dict", None)
            if callable(load):
                load(data)
        epoch = data.get("epoch") if isinstance(data, dict) else None
        train_config: dict[str, Any] | None = None
        raw_cfg = state.files.get(TRAIN_CONFIG_FILE)
        if raw_cfg is not None:
            try:
                parsed = json.loads(raw_cfg)
                train_config = parsed if isinstance(parsed, dict) else None
            except ValueError:
                warnings.append("train_config.json in the checkpoint is not valid JSON")
        meta = state.manifest.meta
        exact = (
            cand.heartbeat is None
            and not meta.lightweight
            and not meta.approximate
            and per_rank_exact
        )
        self._prev_hash = source.manifest_hash or None
        self.index.seed(state.manifest)
        self.metrics.recovery_successes.inc()
        for w in warnings:
            log.warning("resume: %s", w)
        point = ResumePoint(
            step=step + 1,
            checkpoint_id=cand.record.id,
            checkpoint_step=step,
            action=action,
            exact=exact,
            data_state=data,
            epoch=epoch if isinstance(epoch, int) else None,
            train_config=train_config,
            reason=plan_step.reason if plan_step is not None else f"{action} {cand.record.id}",
            rejected=tuple(rejected.items()),
            warnings=tuple(warnings),
        )
        self._retire_newer(step, cand.record.id)
        return point

    def _retire_newer(self, step: int, resumed_from: str) -> None:
        """Checkpoints past the resume step belong to an abandoned branch: mark them expired.

        (Otherwise a later crash could resume from the branch this resume
        deliberately left — e.g. a manual rewind past a loss spike.)
        """
        if not self.coordinator:
            return
        for r in list_checkpoints(self.storage, self.run_id, include_heartbeat=False):
            if r.step <= step or r.status == CheckpointStatus.CORRUPTED or not r.manifest_hash:
                continue
            reason = f"superseded: the run resumed from {resumed_from} (step {step})"
            self.storage.commit(
                validation_key(self.run_id, r.id),
                ValidationRecord(
                    checkpoint_id=r.id,
                    commit_sha256=r.manifest_hash,
                    status=CheckpointStatus.EXPIRED,
                    reason=reason,
                    validated_at=time.time(),
                ).to_bytes(),
            )
            self.catalog.set_status(self.run_id, r.id, CheckpointStatus.EXPIRED, reason)
            self._event("superseded", checkpoint=r.id, reason=reason)


def _unsharded(manifest: RankManifest) -> list[str]:
    """The tensors of a rank part except its shards (those are read by resharding)."""
    return [n for n in manifest.tensors if not n.startswith("sharded/")]


def _as_dict(value: object, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ResumeError(f"checkpoint section {what!r} is missing or not a mapping")
    return value


# --------------------------------------------------------------------------- heartbeat payloads


def encode_inline(value: object) -> Json:
    """Tagged JSON with tensors/arrays inline (base64): for heartbeats (small values only)."""
    import base64

    def leaf(v: object, path: str) -> Json | None:
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return {
                jsontree.TENSOR: {
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "b64": base64.b64encode(data).decode("ascii"),
                }
            }
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            return {
                jsontree.NDARRAY: {
                    "dtype": str(a.dtype),
                    "shape": list(a.shape),
                    "b64": base64.b64encode(a.tobytes()).decode("ascii"),
                }
            }
        if isinstance(v, np.generic):
            return {jsontree.NPSCALAR: [str(v.dtype), jsontree.encode(v.item())]}
        return None

    return jsontree.encode(value, leaf)


def decode_inline(tree: Json) -> object:
    """Inverse of :func:`encode_inline`."""
    import base64

    from ckpt_agent.format.manifest import DTYPE_ITEMSIZE
    from ckpt_agent.runtime.serialization import torch_dtype

    def resolve(tag: str, payload: Json, path: str) -> object:
        if tag in (jsontree.TENSOR, jsontree.NDARRAY):
            if not isinstance(payload, dict):
                raise jsontree.JsonTreeError(f"{path}: bad inline array")
            dtype = payload.get("dtype")
            shape = payload.get("shape")
            if dtype not in DTYPE_ITEMSIZE or not isinstance(shape, list):
                raise jsontree.JsonTreeError(f"{path}: bad inline array dtype/shape")
            raw = base64.b64decode(str(payload.get("b64", "")), validate=True)
            n = 1
            for s in shape:
                n *= int(s)
            if n * DTYPE_ITEMSIZE[str(dtype)] != len(raw):
                raise jsontree.JsonTreeError(f"{path}: inline array has the wrong size")
            if tag == jsontree.NDARRAY:
                return np.frombuffer(raw, dtype=np.dtype(str(dtype))).reshape(shape).copy()
            buf = (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            return buf.view(torch_dtype(str(dtype))).reshape(shape)
        if tag == jsontree.NPSCALAR and isinstance(payload, list) and len(payload) == 2:
            if payload[0] not in DTYPE_ITEMSIZE or payload[0] == "bfloat16":
                raise jsontree.JsonTreeError(f"{path}: bad numpy scalar dtype")
            return np.dtype(str(payload[0])).type(jsontree.decode(payload[1]))
        raise jsontree.JsonTreeError(f"{path}: unexpected {tag} in a heartbeat")

    return jsontree.decode(tree, resolve)
