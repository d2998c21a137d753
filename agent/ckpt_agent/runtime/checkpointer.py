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
  buffers (:mod:`ckpt_agent.runtime.save.snapshot`) — the only stall; the heartbeat's
  capture into its slot (step, data position, raw RNG states; no I/O); the decision
  queued for the decision log.
* **heartbeat thread**: packs and commits the heartbeat ring, at most once per
  ``heartbeat.flushIntervalSeconds`` (:mod:`ckpt_agent.runtime.save.heartbeat`).
* **decision-log thread**: the decision log's JSON lines, gauges, TensorBoard scalars.
* **preparation thread** (after :meth:`Checkpointer.start` returned): allocates and
  touches the snapshot buffers; joined before the first snapshot.
* **persister thread**: chunk, hash, de-duplicate, compress, write, fsync,
  publish the manifest and the COMMIT (:mod:`ckpt_agent.persist.writer`).
* **validator thread**: load the committed checkpoint in a separate process,
  compare shapes, record the verdict, then apply retention and collect
  unreferenced blobs.

Every thread but the training thread, and the validation process, runs at a lower
CPU and I/O priority (:mod:`ckpt_agent.background`).

A snapshot is never taken while the previous persist still owns the buffers
(back-pressure, :mod:`~ckpt_agent.runtime.save.saving`). A failed persist is raised
once, from the next :meth:`~Checkpointer.step` / :meth:`~Checkpointer.save_now` /
:meth:`~Checkpointer.close`.

:class:`Checkpointer` is a facade over :mod:`~ckpt_agent.runtime.core.context` (shared
services), :mod:`~ckpt_agent.runtime.core.capture` (what a snapshot holds), a
:class:`~ckpt_agent.runtime.save.persister.Persister`
(:mod:`~ckpt_agent.runtime.save.thread_persister` or
:mod:`~ckpt_agent.runtime.shm.persister`, :func:`make_persister`),
:mod:`~ckpt_agent.runtime.restore.restorer`,
:mod:`~ckpt_agent.runtime.save.signals` and :mod:`~ckpt_agent.runtime.dist.rank_group`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from ckpt_agent.background import start_background
from ckpt_agent.decide.decision import Decision
from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.errors import CheckpointError
from ckpt_agent.metrics import Metrics
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.core.capture import (
    StateCapture,
    encode_train_config,
    require_state_dicts,
)
from ckpt_agent.runtime.core.context import Engine, Ranks, Stats
from ckpt_agent.runtime.core.serialization import capture_rng, restore_rng
from ckpt_agent.runtime.core.tensorboard import ScalarWriter
from ckpt_agent.runtime.dist.rank_group import RankGroup
from ckpt_agent.runtime.restore.agreed import agreed_resume_point
from ckpt_agent.runtime.restore.restorer import Restorer
from ckpt_agent.runtime.restore.resume_point import ResumePoint
from ckpt_agent.runtime.save.fencing import claim_writer, follow_writer
from ckpt_agent.runtime.save.heartbeat import HeartbeatCapturer, Heartbeats
from ckpt_agent.runtime.save.persister import Persister
from ckpt_agent.runtime.save.saving import SavePath
from ckpt_agent.runtime.save.signals import SignalWatch
from ckpt_agent.runtime.save.thread_persister import ThreadPersister
from ckpt_agent.runtime.shm.in_place import resume_from_memory
from ckpt_agent.runtime.shm.jit import JitSave, jit_unsupported
from ckpt_agent.runtime.shm.persister import ShmPersister
from ckpt_agent.runtime.shm.target import FlashTarget
from ckpt_agent.runtime.start_report import report_start
from ckpt_agent.runtime.step_order import StepOrder
from ckpt_agent.storage.base import Storage
from ckpt_agent.tuning import gc_grace_for

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)


def make_persister(
    engine: Engine,
    capture: StateCapture,
    group: RankGroup | None,
    approximate_threshold: float | None,
) -> Persister:
    """Shared memory with ``config.shm_dir`` on a writing rank, else the in-process threads."""
    if engine.config.shm_dir and engine.ranks.writes:
        return ShmPersister(engine, capture, group)
    return ThreadPersister(engine, capture, group, approximate_threshold=approximate_threshold)


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
        on_persist_error: ``auto`` (default: retryable storage failures are logged and
            retried by the next save, permanent ones raise, and so do retryable ones
            after :data:`~ckpt_agent.tuning.PERSIST_OUTAGE_TOLERANCE_S` without a
            commit), ``raise`` (every failure raises once) or ``warn`` (log only).
        preallocate: allocate and touch the host buffers once :meth:`start` has restored
            the state (on a background thread: off the restart's critical path; joined
            before the first snapshot), so the first save stalls no more than the others.
        gc_grace_s: age under which an unreferenced blob is kept by the automatic
            GC (default 0 for a single writer, an hour with several ranks).
        dist_timeout_s: timeout of the agent's own gloo groups (agreement, two-phase
            commit): a rank that hangs longer fails the save instead of blocking forever
            (None: :data:`~ckpt_agent.tuning.DIST_TIMEOUT_S`, read when the groups are made).
        summary_writer: a ``torch.utils.tensorboard.SummaryWriter`` (anything with
            ``add_scalar``) that gets ``checkpoint/score``, ``checkpoint/interval`` and
            ``checkpoint/tier`` every step, next to your own curves; never closed here.

    Several ranks (``torch.distributed`` initialized, ``world_size > 1``): every
    call of :meth:`step`, :meth:`save_now` and :meth:`close` is collective. The
    save decision is agreed by all ranks, each rank writes its own part (rank 0
    the shared state, every rank its RNG and data position) and rank 0 publishes
    ``COMMIT`` only when every part is written and verified (two-phase commit).

    With ``config.shm_dir`` (``CKPT_SHM_DIR``) the snapshot goes to shared memory
    and a persister process — the pod's sidecar, or a local subprocess started
    here — writes, validates and records it (flash checkpoints,
    :mod:`ckpt_agent.runtime.shm.target`).
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
        on_persist_error: Literal["raise", "warn", "auto"] = "auto",
        preallocate: bool = True,
        gc_grace_s: float | None = None,
        dist_timeout_s: float | None = None,
        summary_writer: ScalarWriter | None = None,
    ) -> None:
        config = config if config is not None else AgentConfig.from_env()
        encode_train_config(train_config)  # fails before anything is opened
        require_state_dicts(optimizer, lr_scheduler, grad_scaler)
        ranks = Ranks.resolve(rank, world_size, model)
        if backpressure not in ("defer", "wait"):
            raise ValueError("backpressure must be 'defer' or 'wait'")
        if approximate_threshold is not None and not approximate_threshold > 0:
            raise ValueError("approximate_threshold must be > 0 (or None for exact checkpoints)")
        self.preallocate = preallocate
        self.handle_sigterm = handle_sigterm
        self.exit_on_sigterm = exit_on_sigterm
        grace = gc_grace_s if gc_grace_s is not None else gc_grace_for(ranks.world_size)
        self._engine = engine = Engine(
            config, ranks, storage, gc_grace_s=grace, summary_writer=summary_writer
        )
        self._capture = capture = StateCapture(
            engine, model, optimizer, lr_scheduler, grad_scaler, dataloader_state, train_config
        )
        self._group = RankGroup(engine, dist_timeout_s) if ranks.distributed else None
        self._restorer = Restorer(engine, capture)
        self._persister = persister = make_persister(
            engine, capture, self._group, approximate_threshold
        )
        self._flash: FlashTarget | None = (
            persister.flash if isinstance(persister, ShmPersister) else None
        )
        """Shared memory: the save side writes it, the start may restore from it."""
        self._saver = SavePath(engine, capture, persister, backpressure, on_persist_error)
        self._signals = SignalWatch(config.signal_file)
        self._capturer = HeartbeatCapturer(capture)
        self._heartbeats: Heartbeats | None = None
        self._jit: JitSave | None = None
        """Every step's heartbeat in shared memory and the save on a failure (``jitSave``)."""
        self._preparing: threading.Thread | None = None
        """Allocates and touches the snapshot buffers after :meth:`start` returned."""
        self._resume: ResumePoint | None = None
        self._resumed_rng: dict[str, object] | None = None
        self._steps = StepOrder(engine.run_id, config.storage_url)
        self._started = False
        self._closed = False
        self._emergency = False
        """A save-now request to hand to the agreement (several ranks)."""

    @property
    def config(self) -> AgentConfig:
        return self._engine.config

    @property
    def run_id(self) -> str:
        return self._engine.run_id

    @property
    def sharded(self) -> bool:
        """FSDP2/DTensor state (see :class:`~ckpt_agent.runtime.core.context.Ranks`)."""
        return self._engine.ranks.sharded

    @property
    def metrics(self) -> Metrics:
        return self._engine.metrics

    @property
    def scheduler(self) -> AdaptiveScheduler:
        return self._engine.scheduler

    @property
    def stats(self) -> Stats:
        return self._engine.stats

    def start(self) -> ResumePoint:
        """Restore the newest usable state (or ``config.resume_from`` exactly); start the workers.

        Raises :class:`ResumeError` when checkpoints exist but none can be
        restored (never a silent fresh start), or when ``resume_from`` is gone,
        corrupted or from a different model.
        """
        if self._started:
            raise CheckpointError("start() was already called")
        self._started = True
        e, t0 = self._engine, time.perf_counter()
        if e.config.metrics_port:  # first: the operator's presence probe sees a restoring agent
            e.metrics.serve(e.config.metrics_port, e.config.metrics_addr)
        try:
            e.check_owner()
            claim_writer(e, persists_here=self._flash is None)  # rank 0; the sidecar claims
            if self._group is not None:
                self._group.setup()
            shm = None
            if self._flash is not None:  # collective with several ranks
                shm = resume_from_memory(e, self._restorer, self._group, self._flash)
            if shm is not None:
                resume = shm
            elif self._group is not None:
                resume = agreed_resume_point(self._restorer, self._group)
            else:
                resume = self._restorer.resume_point()
            follow_writer(e, persists_here=self._flash is None)  # other ranks: rank 0's claim
        except BaseException as err:
            e.event("resume_failed", error=f"{type(err).__name__}: {err}")
            e.metrics.recovered("failed")
            try:
                self.close()
            except Exception:
                log.warning("cleanup after a failed start failed", exc_info=True)
            raise
        self._resume = resume
        self._steps.resumed(resume)
        # The restored RNG, held for restore_rng(): a framework draws from it (its seeding,
        # its data iterators) between start() and the first step it resumes.
        self._resumed_rng = capture_rng() if resume.resumed else None
        seconds = time.perf_counter() - t0
        report_start(e, resume, from_shm=shm is not None, seconds=seconds)
        e.event("start", **resume.event_fields(), seconds=round(seconds, 4))
        e.metrics.recovered(resume.action, seconds)
        self._persister.start(resume.handover())  # the restore side's result, handed over once
        if e.config.tiers.heartbeat.enabled:
            self._heartbeats = Heartbeats(e, self._capturer, resume_step=resume.step)
        if e.config.agent.jit_save:
            self._jit = self._start_jit()
        if e.config.tiers.memory.enabled and not isinstance(self._persister, ShmPersister):
            why = "it needs flash snapshots (spec.agent.sidecar, or CKPT_SHM_DIR for a local run)"
            log.warning("tiers.memory is on but memory-tier snapshots are off: %s", why)
            e.event("memory_tier", outcome="off", reason=why)
            e.scheduler.memory_off()
        if self.preallocate and e.ranks.writes and not e.ranks.sharded:
            work = self._persister.prepare(self._steps.last if self._steps.last is not None else 0)
            if work is not None:  # off the critical path: joined before the first snapshot
                self._preparing = start_background(
                    work, "ckpt-prepare", "preallocating the snapshot buffers"
                )
        self._signals.arm()
        if self.handle_sigterm:
            self._signals.install_sigterm()
        e.decisions.flush()
        return resume

    def close(self, *, final_save: bool = False, timeout: float | None = None) -> None:
        """Optionally save, wait for every background job, release resources, report errors."""
        if self._closed:
            return
        error: BaseException | None = None
        try:
            if final_save and self._started and self._engine.ranks.writes:
                self.save_now("final save on close")
        except BaseException as err:
            error = err
        self._closed = True
        self._wait_prepared()
        self._persister.close(timeout)
        self._engine.close_writers()
        if self._heartbeats is not None:
            self._heartbeats.close(timeout)
        if self._jit is not None:
            self._jit.close()
        self._saver.drain()
        self._signals.restore_sigterm()
        self._engine.event("close", stats=self.summary())
        pending = self._saver.collect_errors()
        self._engine.close()
        if error is not None:
            raise error
        if pending is not None:
            raise pending

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, *rest: object
    ) -> None:
        if isinstance(exc, Exception) and self._jit is not None and not self._closed:
            self.save_on_failure(exc)
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise
            log.exception("close() after an error failed")

    def step(
        self, step: int, loss: float | torch.Tensor, grad_norm: float | torch.Tensor | None = None
    ) -> Decision:
        """Observe one finished optimizer step, decide, and snapshot when a save is due.

        Call it after ``optimizer.step()`` (and ``lr_scheduler.step()``) of
        ``step``: a checkpoint taken here resumes at ``step + 1``. Steps must increase:
        one not after the previous one (or after the checkpoint :meth:`start` resumed)
        raises :class:`~ckpt_agent.errors.StepOrderError` before anything is saved, so a
        restarted counter never overwrites newer checkpoints nor lets retention, which
        orders by step, delete them.
        """
        if not self._started or self._closed:
            self._check_running()
        self._steps.check(step)
        # before the step's agreement: a failure in it still finds this step recorded
        captured = self._jit.record(step) if self._jit is not None else None
        saver, signals, e = self._saver, self._signals, self._engine
        saver.raise_errors()
        saver.drain()
        if signals.sigterm and self._group is None:
            self._on_sigterm(step, agreed=False)
        if signals.path and signals.poll_request(e, agreed=self._group is not None):
            self._emergency = True  # every rank's scheduler gets it through the agreement
        system = e.system_signals(*self._persister.system_signals(), signals.node_warning)
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().item()
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.detach().item()
        busy: bool | None = None
        stop = False
        if self._group is not None:  # every rank: same inputs, same decision
            flags = (self._persister.busy, self._emergency, self._signals.sigterm)
            agreed = self._group.decide(step, float(loss), grad_norm, system, *flags)
            self._emergency = False
            decision, busy, stop = agreed.decision, agreed.any_busy, agreed.stop
        else:
            decision = e.scheduler.observe(step, float(loss), grad_norm, system=system)
        self._steps.last = step
        e.record_decision(decision, loss=float(loss))
        if decision.save and self._heartbeats is not None:
            self._heartbeats.put(step, captured)
        if decision.snapshot_tier is not None and e.ranks.writes:  # a memory-tier one too
            self._wait_prepared()
            self._saver.save(decision, busy=busy, force=stop)
        if stop:
            self._on_sigterm(step, agreed=True)
        return decision

    def restore_rng(self) -> bool:
        """Put every RNG back to the resumed checkpoint's state, at the point the loop expects it.

        :meth:`start` restores the RNG at once; a framework that seeds or creates data
        iterators between ``start()`` and the first resumed step (HF ``Trainer``,
        Lightning) draws from it, and the resume is then silently not bitwise. Call this
        right before the first resumed step's forward pass (after the data iterator is
        created): the RNG is set to what it was when the checkpoint was taken. Once per
        resume; False on a fresh start or a second call (nothing to restore). Per rank.
        """
        self._check_running()
        rng, self._resumed_rng = self._resumed_rng, None
        if rng is None:
            return False
        for warning in restore_rng(rng):
            log.warning("restore_rng: %s", warning)
        return True

    def wants_grad_norm(self, step: int) -> bool:
        """Whether :meth:`step` uses a gradient norm at ``step`` (skip computing it otherwise)."""
        return self._engine.scheduler.wants_grad_norm(step)

    def save_now(
        self, reason: str, *, tier: Tier = Tier.FULL, step: int | None = None, wait: bool = True
    ) -> str | None:
        """Take an emergency checkpoint now (waiting for a running persist first).

        Call it between steps. ``step`` defaults to the last step passed to :meth:`step`.
        With ``wait`` it returns once the checkpoint is committed (validation continues in
        the background). Returns the checkpoint id (None on ranks that do not write, and
        for a save that failed and was only logged). Collective with several ranks.
        """
        self._check_running()
        self._saver.raise_errors()
        if not self._engine.ranks.writes:
            return None
        if step is None:
            step = self._steps.last if self._steps.last is not None else 0
        decision = Decision(
            step=step, save=True, tier=Tier(tier), emergency=True, reason=f"save_now: {reason}"
        )
        self._engine.scheduler.adopt(decision)
        self._engine.event("save_now", step=step, tier=decision.tier, reason=reason)
        if self._heartbeats is not None:
            self._heartbeats.put(step)
        self._wait_prepared()
        ckpt_id = self._saver.save(decision, force=True)
        if wait:
            self._persister.wait_persisted()
            if self._saver.raise_errors():  # on_persist_error=warn: not saved, no id
                return None
        return ckpt_id

    def save_on_failure(self, error: BaseException | None = None) -> str | None:
        """A just-in-time save, on the way out after a failure (``spec.agent.jitSave``).

        Call it where the training loop's exception is caught (the ``with Checkpointer``
        block and the framework integrations do): when the optimizer has not stepped since
        the last :meth:`step` — the failure came out of the next step's forward or backward,
        e.g. its all-reduce after another rank died — this rank's state is still that
        step's, and it is written to shared memory without talking to the other ranks; the
        restart resumes from it, losing at most the failed step (docs/replicas.md). Returns
        the snapshot's checkpoint id, or None when there is nothing to save (JIT off, no
        step yet, the optimizer stepped, memory holds that step already: the decision log
        says which). Never raises: the original error is what matters.
        """
        if self._jit is None or not self._started or self._closed:
            return None
        try:
            self._wait_prepared()  # the slots' preparation may still run in the background
            return self._jit.save(error)
        except Exception:
            log.warning("the just-in-time save failed", exc_info=True)
            return None

    def wait(self, timeout: float | None = None, *, validation: bool = True) -> bool:
        """Wait for the running persist (and validations); False on timeout. Raises errors."""
        ok = self._persister.wait_persisted(timeout)
        if ok and validation:
            ok = self._persister.wait_validated(timeout)
        if self._heartbeats is not None:
            self._heartbeats.flush(timeout)
        self._saver.drain()
        return not self._saver.raise_errors() and ok  # a save only logged is not persisted

    @property
    def stop_requested(self) -> bool:
        """A SIGTERM arrived (on any rank, with several; with ``exit_on_sigterm=False``
        the loop should end)."""
        return self._signals.sigterm

    @property
    def resume_point(self) -> ResumePoint | None:
        return self._resume

    def summary(self) -> dict[str, Any]:
        return self._engine.summary()

    def _start_jit(self) -> JitSave | None:
        """The JIT save when it can work here (else a warning and a ``jit_save`` event)."""
        e = self._engine
        why = jit_unsupported(e, self._capture, self._persister)
        if why:
            log.warning("spec.agent.jitSave is on but just-in-time saves are off: %s", why)
            e.event("jit_save", outcome="off", reason=why)
            return None
        assert isinstance(self._persister, ShmPersister)
        return JitSave(e, self._capture, self._persister, self._capturer)

    def _wait_prepared(self) -> None:
        """The buffers' preparation is over (before a snapshot uses them)."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def _check_running(self) -> None:
        if not self._started:
            raise CheckpointError("call start() before step()/save_now()")
        if self._closed:
            raise CheckpointError("the checkpointer is closed")

    def _on_sigterm(self, step: int, *, agreed: bool) -> None:
        """SIGTERM here: save the step that just finished; ``agreed`` (SIGTERM on some rank):
        every rank saved already, wait for the commit. Then exit (``exit_on_sigterm``)."""
        self._engine.event("sigterm", step=step)
        if agreed:
            self._signals.sigterm = True
            self._persister.wait_persisted()
            self._saver.raise_errors()
        elif self._engine.ranks.writes:
            self.save_now("SIGTERM (preemption)", step=step)
        if self.exit_on_sigterm:
            self.close()
            raise SystemExit(143)
        self._signals.sigterm = agreed
