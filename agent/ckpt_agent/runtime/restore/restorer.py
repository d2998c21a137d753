"""Where training continues: choose, check, load and apply a checkpoint (:class:`Restorer`).

:meth:`Restorer.resume_point` is what :meth:`Checkpointer.start` runs (rank 0's
choice on the other ranks):

1. rank 0's choice (on the other ranks) is restored exactly;
2. pending checkpoints newer than the newest valid one are verified (a crash
   between commit and validation must not make the newest one unusable);
3. a resume pin (a ``RECOVER.json`` request, ``CKPT_RESUME_FROM``) not yet
   applied is restored exactly, or the start fails loudly; a pin the current
   lineage already honours is not applied again (:mod:`ckpt_agent.decide.lineage`:
   an in-place restart continues, it does not rewind);
4. the recovery ladder (:mod:`ckpt_agent.decide.recovery`) is walked, loading
   and checking each candidate until one fits (when a pin is spent: only its
   lineage, the pin and heartbeats).

Every rejected candidate carries a :class:`Rejection` with its
:class:`~ckpt_agent.errors.RejectionKind`: anything a candidate raises while it
is read, decoded, checked (:mod:`~ckpt_agent.runtime.restore.preflight`, before anything
is applied) or applied is a rejection, never a crash; checkpoints past the resume step are
marked superseded (:meth:`Restorer.restore`); the lineage the new checkpoints
carry is the engine's ``lineage``. A start that fails leaves its verdicts in the
termination-message report first (after a failed pin: the ladder's next candidates
probed too, :func:`~ckpt_agent.runtime.restore.bookkeeping.report_failed_start`). What a
resume reads and writes in storage besides the checkpoint (``RECOVER.json``, verdicts,
retirements) is in :mod:`~ckpt_agent.runtime.restore.bookkeeping`; :class:`ResumePoint` and
the candidate types in :mod:`~ckpt_agent.runtime.restore.resume_point`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckpt_agent.decide.lineage import (
    LineageChoice,
    choose,
    pending_to_verify,
    pins_in_force,
)
from ckpt_agent.decide.recovery import PlanStep, plan_recovery, walk
from ckpt_agent.errors import (
    CandidateRejectedError,
    CheckpointNotFoundError,
    RejectionKind,
    ResumeError,
    ResumeStorageError,
    RetryableError,
    StorageError,
)
from ckpt_agent.format.heartbeat import read_heartbeat
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.format.readers import read_checkpoint, read_rank_manifest
from ckpt_agent.format.statecheck import check_state
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Lineage, Tier
from ckpt_agent.runtime.core.capture import TRAIN_CONFIG_FILE, StateCapture
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.core.inline import decode_inline
from ckpt_agent.runtime.core.serialization import LoadedState, load_tensors, restore_rng
from ckpt_agent.runtime.core.sharded import restore_sharded
from ckpt_agent.runtime.restore.bookkeeping import (
    consume_recover_request,
    read_recover_request,
    record_verdict,
    report_failed_start,
    retire_newer,
)
from ckpt_agent.runtime.restore.compat import compat_problems
from ckpt_agent.runtime.restore.preflight import (
    LiveState,
    as_rejection,
    check_budget,
    check_heartbeat,
    check_loaded,
    memory_budget,
    rejection_kind,
)
from ckpt_agent.runtime.restore.resume_point import Candidate, Rejection, ResumePoint
from ckpt_agent.tuning import (
    MAX_PENDING_PROMOTIONS,
    RESTORE_READ_ATTEMPTS,
    RESTORE_READ_BACKOFF_S,
)

__all__ = ["Candidate", "Rejection", "Restorer", "ResumePoint"]

log = logging.getLogger(__name__)

#: Compatibility problems quoted in a rejection (the rest are counted).
_PROBLEMS_QUOTED = 4


def _unsharded(manifest: RankManifest) -> list[str]:
    """The tensors of a rank part except its shards (those are read by resharding)."""
    return [n for n in manifest.tensors if not n.startswith("sharded/")]


def _as_dict(value: object, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ResumeError(f"checkpoint section {what!r} is missing or not a mapping")
    return value


class _Attempts:
    """The candidates of one resume: records by id, loaded candidates (cached), rejections."""

    def __init__(self, restorer: Restorer, records: list[CheckpointRecord]) -> None:
        restorer.live(fresh=True)  # before any candidate: a live-model error is raised as is
        self.restorer = restorer
        self.records = records
        self.by_id = {r.id: r for r in records}
        self.rejected: dict[str, Rejection] = {}
        self._cache: dict[str, Candidate | None] = {}

    def get(self, cid: str) -> Candidate | None:
        if cid not in self._cache:
            rec = self.by_id.get(cid)
            self._cache[cid] = None if rec is None else self.restorer.load(rec, self.rejected)
        return self._cache[cid]

    def why(self, cid: str) -> str | None:
        r = self.rejected.get(cid)
        return None if r is None else r.reason

    def reasons(self) -> dict[str, str]:
        return {k: v.reason for k, v in self.rejected.items()}

    def current(self) -> list[CheckpointRecord]:
        """The records with this resume's verdicts (a candidate at fault is corrupted)."""
        bad = {k for k, v in self.rejected.items() if v.kind.corrupted}
        return [
            r.with_status(CheckpointStatus.CORRUPTED) if r.id in bad else r
            for r in self.by_id.values()
        ]

    def reject(self, err: CandidateRejectedError) -> None:
        """A candidate failed while being applied: never offer it again (marked if its fault)."""
        self._cache[err.checkpoint_id] = None
        self.rejected[err.checkpoint_id] = Rejection(err.kind, err.reason)
        rec = self.by_id.get(err.checkpoint_id)
        if rec is not None and err.kind.corrupted:
            record_verdict(self.restorer.engine, rec, CheckpointStatus.CORRUPTED, err.reason, 0.0)


class _TransientReadError(Exception):
    """A retryable storage error while a candidate was read (retried by :meth:`Restorer.load`)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Restorer:
    """Resume point selection, candidate loading and checks, restore (see the module doc)."""

    def __init__(self, engine: Engine, capture: StateCapture) -> None:
        self.engine = engine
        self.capture = capture
        self.weights_from: str | None = None
        """The weights source of the last heartbeat rebuild (rank 0 tells the other ranks)."""
        self.memory_budget: int | None = memory_budget()
        """Most bytes one candidate may decode to (None: no limit known)."""
        self._live: LiveState | None = None

    # ------------------------------------------------------------------ choosing

    def resume_point(
        self, forced: tuple[str, str | None, str] | None = None, lineage: Lineage | None = None
    ) -> ResumePoint:
        """``forced`` = (checkpoint id, weights source, action) and ``lineage``: rank 0's
        choice, on other ranks."""
        e = self.engine
        records = e.catalog.rebuild_from_storage(e.storage, e.run_id)
        weights = [r for r in records if r.has_weights and r.status == CheckpointStatus.VALID]
        if weights:
            full = [r.step for r in weights if not r.lightweight]
            e.finalizer.last_valid_step = max(full) if full else -1
            e.metrics.last_valid_step.set(e.finalizer.last_valid_step)
        if e.finalizer.report is not None:  # report in at once: the operator sees the agent
            e.finalizer.report.write(e.run_id, records)
        attempts = _Attempts(self, records)
        # 1. rank 0 chose: exactly that one.
        if forced is not None:
            wanted, action = forced[0], forced[2]
            named = {"checkpoint_id": wanted, "weights_from": forced[1]}
            return self._named(attempts, wanted, action, named, lineage)
        request = self.recover_request()
        pins = pins_in_force(
            request, e.config.resume_from, e.config.resume_weights, e.config.resume_pin
        )
        # 2. verify pending checkpoints newer than the newest valid one (crash before validation).
        self._promote_pending(
            attempts, pending_to_verify(attempts.records, pins, MAX_PENDING_PROMOTIONS)
        )
        # 3. a pin not applied yet: exactly that one, or fail loudly.
        choice = choose(attempts.records, pins)
        if pins:
            log.info("resume lineage: %s", choice.reason)
        pin = choice.apply
        try:
            if pin is not None:
                named = {"checkpoint_id": pin.checkpoint_id, "weights_from": pin.weights_from}
                point = self._named(attempts, pin.checkpoint_id, pin.source, named, choice.lineage)
            else:  # 4. the ladder (a spent pin: its lineage only).
                if choice.candidates is not None:
                    attempts.records = [r for r in attempts.records if r.id in choice.candidates]
                point = self._ladder(attempts, choice)
        except ResumeError as err:  # the verdicts reach the operator before the start fails
            if isinstance(err, CandidateRejectedError):
                attempts.reject(err)
            probe = None if pin is None else (lambda cid: attempts.get(cid) is not None)
            report_failed_start(e, attempts.current, probe)
            raise
        if request is not None and e.ranks.coordinator:
            applied = pin is not None and pin.source == "manual"
            if applied or any(p.source == "manual" for p in choice.spent):
                consume_recover_request(
                    e, request, point.checkpoint_id, point.step, applied=applied
                )
        return point

    def _named(
        self,
        attempts: _Attempts,
        wanted: str,
        action: str,
        request: dict[str, Any],
        lineage: Lineage | None,
    ) -> ResumePoint:
        e = self.engine
        rec = attempts.by_id.get(wanted)
        source = {"resume_from": "CKPT_RESUME_FROM", "manual": "RECOVER.json"}.get(
            action, "rank 0's choice"
        )
        if rec is None:
            known = ", ".join(r.id for r in attempts.records if r.tier != Tier.HEARTBEAT) or "none"
            raise ResumeError(
                f"resume from {wanted!r} requested ({source}) "
                f"but run {e.run_id!r} in {e.storage.url} has no committed checkpoint "
                f"with that id (committed: {known})"
            )
        if rec.status in (CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED):
            raise ResumeError(
                f"resume from {wanted!r} requested but it is {rec.status.value}: "
                f"{rec.extra.get('status_reason', '')}"
            )
        cand = attempts.get(wanted)
        if cand is None:
            raise ResumeError(
                f"resume from {wanted!r} requested but it cannot be restored: "
                f"{attempts.why(wanted)}"
            )
        weights_from: Candidate | None = None
        if cand.heartbeat is not None:
            src = str(request.get("weights_from") or "")
            weights_from = attempts.get(src) if src else None
            if weights_from is None:
                why = (
                    f"its weights source {src!r} cannot be restored: {attempts.why(src)}"
                    if src
                    else "name a weights source (CKPT_RESUME_WEIGHTS, or weights_from "
                    "in RECOVER.json)"
                )
                raise ResumeError(f"{wanted} ({source}) is a heartbeat: {why}")
        return self.restore(
            cand,
            action=action,
            weights=weights_from,
            rejected=attempts.reasons(),
            lineage=lineage,
        )

    def _promote_pending(self, attempts: _Attempts, pending: list[CheckpointRecord]) -> None:
        for r in pending:
            cand = attempts.get(r.id)
            status = CheckpointStatus.VALID if cand is not None else CheckpointStatus.CORRUPTED
            rejection = attempts.rejected.get(r.id)
            if rejection is not None and not rejection.kind.corrupted:
                status = CheckpointStatus.PENDING  # not its fault: leave it for the operator
            attempts.by_id[r.id] = r.with_status(status)
        attempts.records = sorted(attempts.by_id.values(), key=lambda r: (r.step, r.tier.value))

    def _ladder(self, attempts: _Attempts, choice: LineageChoice) -> ResumePoint:
        run_id = self.engine.run_id
        records = attempts.records
        plan = plan_recovery(records, self.engine.config.recovery)
        if plan.empty or plan.first() is None:
            if not any(r.has_weights for r in records):
                return ResumePoint(step=0, reason=plan.reason or "no checkpoints: fresh start")
            within = f" ({choice.reason})" if choice.candidates is not None else ""
            raise ResumeError(
                f"checkpoints exist for run {run_id!r} but none is usable{within}: {plan.reason}; "
                + "; ".join(f"{k}: {v}" for k, v in list(plan.skipped.items())[:6])
                + " — use `ckpt recover --manual --step N --force` to choose one"
            )
        while True:  # a candidate that fails while being applied is rejected: walk on
            chosen, failed = walk(plan, lambda cid: attempts.get(cid) is not None)
            if chosen is None:
                tried = dict.fromkeys(
                    [s.checkpoint_id for s, _ in failed] + [s.weights_from or "" for s, _ in failed]
                )
                raise ResumeError(
                    f"no checkpoint of run {run_id!r} could be restored; tried: "
                    + "; ".join(
                        f"{cid}: {attempts.why(cid)}" for cid in tried if cid in attempts.rejected
                    )
                )
            cand = attempts.get(chosen.checkpoint_id)
            assert cand is not None
            weights = attempts.get(chosen.weights_from) if chosen.weights_from else None
            try:
                return self.restore(
                    cand,
                    action=chosen.action,
                    weights=weights,
                    rejected=attempts.reasons(),
                    plan_step=chosen,
                    lineage=choice.lineage,
                )
            except CandidateRejectedError as err:
                attempts.reject(err)

    def recover_request(self) -> dict[str, Any] | None:
        """The pending ``RECOVER.json`` of ``ckpt recover --manual`` (None: there is none)."""
        return read_recover_request(self.engine)

    # ------------------------------------------------------------------ loading and checking

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

    def load(self, rec: CheckpointRecord, rejected: dict[str, Rejection]) -> Candidate | None:
        """Load and check one checkpoint; None (with the reason in ``rejected``) if unusable.

        Everything a candidate raises while it is read, decoded and checked is a
        rejection, never a crash (``KeyboardInterrupt``/``SystemExit`` excepted):
        its :class:`~ckpt_agent.errors.RejectionKind` is recorded and, when the
        checkpoint itself is at fault, it is marked corrupted. A transient storage
        failure is not the checkpoint's fault: the read is retried
        (:data:`~ckpt_agent.tuning.RESTORE_READ_ATTEMPTS`), and when the storage keeps
        failing the start fails (:class:`~ckpt_agent.errors.ResumeStorageError`) instead
        of giving the checkpoint up for an older one.
        """
        delay = RESTORE_READ_BACKOFF_S
        for attempt in range(1, RESTORE_READ_ATTEMPTS + 1):
            try:
                return self._load_once(rec, rejected)
            except _TransientReadError as err:
                if attempt == RESTORE_READ_ATTEMPTS:
                    raise ResumeStorageError(
                        f"the storage kept failing while {rec.id} was read "
                        f"({RESTORE_READ_ATTEMPTS} attempts; last: {err.cause}); nothing was "
                        "marked and no older checkpoint was chosen: the start fails so the "
                        "restart tries again — check the storage"
                    ) from err.cause
                log.warning("reading %s failed (%s); retrying in %.1fs", rec.id, err.cause, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _load_once(self, rec: CheckpointRecord, rejected: dict[str, Rejection]) -> Candidate | None:
        e = self.engine
        e.metrics.recovery_attempts.inc()
        live = self.live()
        if rec.tier == Tier.HEARTBEAT:
            return self._load_heartbeat(rec, rejected)
        rank = e.ranks.rank
        t0 = time.perf_counter()
        try:
            committed, manifest = read_checkpoint(e.storage, e.run_id, rec.id, 0)
            check_state(manifest)  # the whole tree decodes (before it is compared or loaded)
            problems = self.compat(manifest)
            if problems:
                n = len(problems) - _PROBLEMS_QUOTED
                rejected[rec.id] = Rejection(
                    RejectionKind.INCOMPATIBLE,
                    "does not fit the live model (different model/optimizer shape): "
                    + "; ".join(problems[:_PROBLEMS_QUOTED])
                    + (f" (+{n} more)" if n > 0 else ""),
                )
                return None
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
            rejected[rec.id] = Rejection(RejectionKind.MISSING, str(err))
            return None
        except Exception as err:  # anything the candidate makes the readers raise
            if isinstance(err, StorageError) and isinstance(err, RetryableError):
                raise _TransientReadError(err) from err
            kind = rejection_kind(err)
            reason = f"{type(err).__name__}: {err}"
            if isinstance(err, CandidateRejectedError):
                reason = err.reason
            rejected[rec.id] = Rejection(kind, reason)
            if kind.corrupted:
                record_verdict(e, rec, CheckpointStatus.CORRUPTED, reason, time.perf_counter() - t0)
            return None
        if rec.status == CheckpointStatus.PENDING:
            seconds = time.perf_counter() - t0
            record_verdict(e, rec, CheckpointStatus.VALID, "", seconds, committed.manifest_hash)
        return Candidate(
            record=rec, loaded=loaded, manifest_hash=committed.manifest_hash, own=own, checked=True
        )

    def _load_heartbeat(
        self, rec: CheckpointRecord, rejected: dict[str, Rejection]
    ) -> Candidate | None:
        e = self.engine
        try:
            ring = read_heartbeat(e.storage, e.run_id, e.ranks.rank)
            hb = next((h for h in reversed(ring) if h.step == rec.step), None)
            if hb is not None:
                check_heartbeat(hb.data, hb.rng)
        except Exception as err:  # an unreadable ring is a rejection, never a crash
            kind = RejectionKind.STORAGE if isinstance(err, StorageError) else RejectionKind.FORMAT
            rejected[rec.id] = Rejection(kind, f"heartbeat unreadable: {type(err).__name__}: {err}")
            return None
        if hb is None:
            rejected[rec.id] = Rejection(
                RejectionKind.MISSING, "heartbeat ring no longer holds this step"
            )
            return None
        return Candidate(record=rec, heartbeat=hb, checked=True)

    # ------------------------------------------------------------------ applying

    def restore(
        self,
        cand: Candidate,
        *,
        action: str,
        weights: Candidate | None,
        rejected: Mapping[str, str],
        plan_step: PlanStep | None = None,
        lineage: Lineage | None = None,
    ) -> ResumePoint:
        """Load ``cand`` (weights from ``weights`` in a heartbeat rebuild) into the live objects.

        The run's next checkpoints carry ``lineage`` (None: the restored checkpoint's own),
        with this checkpoint as their parent."""
        e, c = self.engine, self.capture
        warnings: list[str] = []
        source = cand if cand.loaded is not None else weights
        if source is None or source.loaded is None:
            raise ResumeError(f"{cand.record.id}: no weights to restore")
        state = source.loaded
        if not source.checked:  # not from load() (a shared-memory snapshot): check it first
            try:
                check_loaded(source.record.id, state, source.own, self.live())
            except Exception as err:
                raise as_rejection(source.record.id, err) from err
        try:  # it passed every check: a failure now is rejected too, the next rung overwrites
            self._load_objects(source.record.id, state, warnings)
            step = source.record.step
            mine, per_rank_exact = self._own_part(source, warnings)
            data: object = mine.section("data")
            rng = mine.section("rng")
            self.weights_from = weights.record.id if weights is not None else None
            if cand.heartbeat is not None:  # heartbeat rebuild: step, data, RNG from the heartbeat
                step = cand.heartbeat.step
                data = decode_inline(cand.heartbeat.data)
                rng = decode_inline(cand.heartbeat.rng)
                warnings.append(
                    f"rebuilt from heartbeat at step {step} with weights of step "
                    f"{source.record.step}: not exact"
                )
            if isinstance(rng, dict):
                warnings.extend(restore_rng(rng))
            if data is not None and c.dataloader_state is not None:
                load = getattr(c.dataloader_state, "load_state_dict", None)
                if callable(load):
                    load(data)
        except Exception as err:
            raise as_rejection(source.record.id, err, applying=True) from err
        epoch = data.get("epoch") if isinstance(data, dict) else None
        train_config = _train_config(state, warnings)
        meta = state.manifest.meta
        exact = (
            cand.heartbeat is None
            and not meta.lightweight
            and not meta.approximate
            and per_rank_exact
        )
        e.prev_hash = source.manifest_hash or None
        base = lineage if lineage is not None else source.record.lineage
        e.lineage = replace(base, parent=cand.record.id)
        e.parts.index.seed(state.manifest)
        e.metrics.recovery_successes.inc()
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
            lineage=e.lineage,
        )
        retire_newer(e, step, cand.record.id)
        return point

    def _load_objects(self, source_id: str, state: LoadedState, warnings: list[str]) -> None:
        """Model, optimizer, LR scheduler, grad scaler and the scheduler's own state."""
        e, c = self.engine, self.capture
        sections = state.manifest.meta.sections
        if "sharded" in sections:
            restore_sharded(e.storage, e.run_id, source_id, c.model, c.optimizer, warnings)
        else:
            c.model.load_state_dict(_as_dict(state.section("model"), "model"), strict=True)
        for name, obj in (
            ("optimizer", None if "sharded" in sections else c.optimizer),
            ("lr_scheduler", c.lr_scheduler),
            ("grad_scaler", c.grad_scaler),
        ):
            if obj is None:
                continue
            if name in sections:
                obj.load_state_dict(_as_dict(state.section(name), name))
            else:
                warnings.append(f"{name} state is not in {source_id} (lightweight checkpoint)")
        sched = state.section("scheduler")
        if isinstance(sched, dict):
            sched = dict(sched)
            sched["last_now"] = None  # the previous process's clock: do not fold the gap in
            try:
                e.scheduler.load_state_dict(sched)
            except (ValueError, KeyError, TypeError) as err:
                warnings.append(f"scheduler state not restored: {err}")
            e.apply_run_facts()

    def _own_part(self, source: Candidate, warnings: list[str]) -> tuple[LoadedState, bool]:
        """The part holding this rank's RNG and data position, and whether it is exact."""
        ranks = self.engine.ranks
        assert source.loaded is not None
        mine = source.loaded
        exact = True
        saved_ws = source.loaded.manifest.meta.world_size
        if ranks.rank != 0:  # this rank's RNG and data position come from its own part
            if source.own is not None:
                mine = source.own
            elif saved_ws > 1 or ranks.distributed:
                exact = False
                warnings.append(
                    f"{source.record.id} has no part of rank {ranks.rank} (saved with world size "
                    f"{saved_ws}): rank 0's RNG and data position are used, not exact"
                )
        live_ws = ranks.live_world_size
        if saved_ws != live_ws:
            exact = False
            warnings.append(
                f"{source.record.id} was saved at world size {saved_ws}, resumed at {live_ws}: "
                "the state is restored, the continuation is not bitwise the original run's"
            )
        return mine, exact


def _train_config(state: LoadedState, warnings: list[str]) -> dict[str, Any] | None:
    raw = state.files.get(TRAIN_CONFIG_FILE)
    if raw is None:
        return None
    try:
        parsed = json.loads(raw)
    except ValueError:
        warnings.append("train_config.json in the checkpoint is not valid JSON")
        return None
    return parsed if isinstance(parsed, dict) else None
