"""Where training continues: choose, check, load and apply a checkpoint (:class:`Restorer`).

:meth:`Restorer.resume_point` is what :meth:`Checkpointer.start` runs (rank 0's
choice on the other ranks):

1. a named checkpoint (``CKPT_RESUME_FROM``, a ``RECOVER.json`` request, or rank
   0's choice) is restored exactly, or the start fails loudly;
2. pending checkpoints newer than the newest valid one are verified (a crash
   between commit and validation must not make the newest one unusable);
3. the recovery ladder (:mod:`ckpt_agent.decide.recovery`) is walked, loading
   and checking each candidate until one fits.

Every rejected candidate carries a :class:`Rejection` with its
:class:`~ckpt_agent.errors.RejectionKind`; checkpoints past the resume step are
marked superseded (:meth:`Restorer.restore`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_agent.decide.recovery import PlanStep, plan_recovery, walk
from ckpt_agent.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    NotFoundError,
    RejectionKind,
    ResumeError,
    StorageError,
)
from ckpt_agent.format.heartbeat import Heartbeat, read_heartbeat
from ckpt_agent.format.layout import recover_request_key, validation_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import RankManifest, ValidationRecord
from ckpt_agent.format.readers import read_checkpoint, read_rank_manifest
from ckpt_agent.persist.housekeeping import append_audit, who
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Tier
from ckpt_agent.runtime.capture import TRAIN_CONFIG_FILE, StateCapture
from ckpt_agent.runtime.compat import compat_problems
from ckpt_agent.runtime.context import Engine
from ckpt_agent.runtime.inline import decode_inline
from ckpt_agent.runtime.serialization import LoadedState, load_tensors, restore_rng
from ckpt_agent.runtime.sharded import restore_sharded
from ckpt_agent.tuning import MAX_PENDING_PROMOTIONS

__all__ = ["Candidate", "Rejection", "Restorer", "ResumePoint"]

log = logging.getLogger(__name__)

#: Compatibility problems quoted in a rejection (the rest are counted).
_PROBLEMS_QUOTED = 4


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

    def event_fields(self) -> dict[str, Any]:
        """What the ``start`` event of the decision log says about this resume."""
        return {
            "action": self.action,
            "checkpoint": self.checkpoint_id,
            "next_step": self.step,
            "exact": self.exact,
            "reason": self.reason,
            "rejected": [list(r) for r in self.rejected],
        }


@dataclass(frozen=True)
class Rejection:
    """Why a candidate was not restored: the kind decides, the reason is for people."""

    kind: RejectionKind
    reason: str


@dataclass
class Candidate:
    """A checkpoint loaded and checked during :meth:`Checkpointer.start`."""

    record: CheckpointRecord
    loaded: LoadedState | None = None
    heartbeat: Heartbeat | None = None
    manifest_hash: str = ""
    own: LoadedState | None = None
    """This rank's own part (rank > 0 of a multi-rank checkpoint): RNG, data position."""


def _kind_of(e: Exception) -> RejectionKind:
    if isinstance(e, IntegrityError):
        return RejectionKind.INTEGRITY
    if isinstance(e, NotFoundError):
        return RejectionKind.MISSING
    if isinstance(e, StorageError):
        return RejectionKind.STORAGE
    return RejectionKind.FORMAT


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


class Restorer:
    """Resume point selection, candidate loading and checks, restore (see the module doc)."""

    def __init__(self, engine: Engine, capture: StateCapture) -> None:
        self.engine = engine
        self.capture = capture
        self.weights_from: str | None = None
        """The weights source of the last heartbeat rebuild (rank 0 tells the other ranks)."""

    # ------------------------------------------------------------------ choosing

    def resume_point(self, forced: tuple[str, str | None, str] | None = None) -> ResumePoint:
        """``forced`` = (checkpoint id, weights source, action): rank 0's choice, on other ranks."""
        e = self.engine
        records = e.catalog.rebuild_from_storage(e.storage, e.run_id)
        weights = [r for r in records if r.has_weights and r.status == CheckpointStatus.VALID]
        if weights:
            full = [r.step for r in weights if not r.lightweight]
            e.finalizer.last_valid_step = max(full) if full else -1
            e.metrics.last_valid_step.set(e.finalizer.last_valid_step)
        attempts = _Attempts(self, records)
        # 1. the operator (or a person) named the checkpoint: exactly that one, or fail loudly.
        wanted, action = e.config.resume_from, "resume_from"
        request: dict[str, Any] | None = None
        if forced is not None:
            wanted, action = forced[0], forced[2]
            request = {"checkpoint_id": wanted, "weights_from": forced[1]}
        elif not wanted:
            request = self.recover_request()
            if request is not None:
                wanted, action = str(request["checkpoint_id"]), "manual"
        if wanted:
            point = self._named(attempts, wanted, action, request)
            if request is not None and e.ranks.coordinator and forced is None:
                self._consume_recover_request(request, point)
            return point
        # 2. promote pending checkpoints newer than the newest valid one (crash before validation).
        self._promote_pending(attempts, newest_valid=max((r.step for r in weights), default=-1))
        # 3. the ladder.
        return self._ladder(attempts)

    def _named(
        self, attempts: _Attempts, wanted: str, action: str, request: dict[str, Any] | None
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
            src = str((request or {}).get("weights_from") or "")
            weights_from = attempts.get(src) if src else None
            if weights_from is None:
                raise ResumeError(f"{wanted} is a heartbeat: name a weights source (weights_from)")
        return self.restore(cand, action=action, weights=weights_from, rejected=attempts.reasons())

    def _promote_pending(self, attempts: _Attempts, newest_valid: int) -> None:
        pending = sorted(
            (
                r
                for r in attempts.records
                if r.status == CheckpointStatus.PENDING and r.has_weights and r.step > newest_valid
            ),
            key=lambda r: r.step,
            reverse=True,
        )[:MAX_PENDING_PROMOTIONS]
        for r in pending:
            cand = attempts.get(r.id)
            status = CheckpointStatus.VALID if cand is not None else CheckpointStatus.CORRUPTED
            rejection = attempts.rejected.get(r.id)
            if rejection is not None and rejection.kind == RejectionKind.INCOMPATIBLE:
                status = CheckpointStatus.PENDING  # not its fault: leave it for the operator
            attempts.by_id[r.id] = r.with_status(status)
        attempts.records = sorted(attempts.by_id.values(), key=lambda r: (r.step, r.tier.value))

    def _ladder(self, attempts: _Attempts) -> ResumePoint:
        run_id = self.engine.run_id
        records = attempts.records
        plan = plan_recovery(records, self.engine.config.recovery)
        if plan.empty or plan.first() is None:
            if not any(r.has_weights for r in records):
                return ResumePoint(step=0, reason=plan.reason or "no checkpoints: fresh start")
            raise ResumeError(
                f"checkpoints exist for run {run_id!r} but none is usable: {plan.reason}; "
                + "; ".join(f"{k}: {v}" for k, v in list(plan.skipped.items())[:6])
                + " — use `ckpt recover --manual --step N --force` to choose one"
            )
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
        return self.restore(
            cand,
            action=chosen.action,
            weights=weights,
            rejected=attempts.reasons(),
            plan_step=chosen,
        )

    # ------------------------------------------------------------------ manual recovery requests

    def recover_request(self) -> dict[str, Any] | None:
        """The pending ``RECOVER.json`` of ``ckpt recover --manual`` (None: there is none)."""
        key = recover_request_key(self.engine.run_id)
        try:
            raw = self.engine.storage.read(key)
        except NotFoundError:
            return None
        try:
            req = json.loads(raw)
        except ValueError:
            raise ResumeError(f"{key} is not valid JSON") from None
        if not isinstance(req, dict) or not isinstance(req.get("checkpoint_id"), str):
            raise ResumeError(f"{key} names no checkpoint_id")
        return req

    def _consume_recover_request(self, request: dict[str, Any], point: ResumePoint) -> None:
        e = self.engine
        append_audit(
            e.storage,
            e.run_id,
            {
                "time": time.time(),
                "who": who(),
                "what": "manual recovery applied",
                "checkpoint": point.checkpoint_id,
                "request": request,
                "next_step": point.step,
            },
        )
        e.storage.delete(recover_request_key(e.run_id))

    # ------------------------------------------------------------------ loading and checking

    def compat(self, manifest: RankManifest) -> list[str]:
        """Why this checkpoint does not fit the live model/optimizer (empty: it fits)."""
        c = self.capture
        return compat_problems(manifest, c.model, c.optimizer, sharded=self.engine.ranks.sharded)

    def load(self, rec: CheckpointRecord, rejected: dict[str, Rejection]) -> Candidate | None:
        """Load and check one checkpoint; None (with the reason in ``rejected``) if unusable."""
        e = self.engine
        e.metrics.recovery_attempts.inc()
        if rec.tier == Tier.HEARTBEAT:
            return self._load_heartbeat(rec, rejected)
        rank = e.ranks.rank
        t0 = time.perf_counter()
        try:
            committed, manifest = read_checkpoint(e.storage, e.run_id, rec.id, 0)
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
            loaded = load_tensors(e.storage, e.run_id, manifest, _unsharded(manifest))
            own: LoadedState | None = None
            if rank != 0 and rank in {r.rank for r in committed.commit.ranks}:
                # this rank's RNG and data position
                mine = read_rank_manifest(e.storage, e.run_id, committed, rank)
                own = load_tensors(e.storage, e.run_id, mine, _unsharded(mine))
        except CheckpointNotFoundError as err:
            rejected[rec.id] = Rejection(RejectionKind.MISSING, str(err))
            return None
        except (CheckpointFormatError, IntegrityError, StorageError) as err:
            reason = f"{type(err).__name__}: {err}"
            rejected[rec.id] = Rejection(_kind_of(err), reason)
            self._mark(rec, CheckpointStatus.CORRUPTED, reason, time.perf_counter() - t0)
            return None
        if rec.status == CheckpointStatus.PENDING:
            seconds = time.perf_counter() - t0
            self._mark(rec, CheckpointStatus.VALID, "", seconds, committed.manifest_hash)
        return Candidate(record=rec, loaded=loaded, manifest_hash=committed.manifest_hash, own=own)

    def _load_heartbeat(
        self, rec: CheckpointRecord, rejected: dict[str, Rejection]
    ) -> Candidate | None:
        e = self.engine
        try:
            ring = read_heartbeat(e.storage, e.run_id, e.ranks.rank)
        except (CheckpointFormatError, StorageError) as err:
            kind = RejectionKind.STORAGE if isinstance(err, StorageError) else RejectionKind.FORMAT
            rejected[rec.id] = Rejection(kind, f"heartbeat unreadable: {err}")
            return None
        hb = next((h for h in reversed(ring) if h.step == rec.step), None)
        if hb is None:
            rejected[rec.id] = Rejection(
                RejectionKind.MISSING, "heartbeat ring no longer holds this step"
            )
            return None
        return Candidate(record=rec, heartbeat=hb)

    def _mark(
        self,
        rec: CheckpointRecord,
        status: CheckpointStatus,
        reason: str,
        seconds: float,
        manifest_hash: str | None = None,
    ) -> None:
        """Record a verdict found while resuming (in storage and in the catalog)."""
        e = self.engine
        mh = manifest_hash or rec.manifest_hash
        if mh and e.ranks.coordinator:
            try:
                e.storage.commit(
                    validation_key(e.run_id, rec.id),
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
            except StorageError as err:
                log.warning("could not record the verdict on %s: %s", rec.id, err)
        e.catalog.set_status(e.run_id, rec.id, status, reason, validate_s=seconds)
        e.metrics.checkpoints.labels(tier=rec.tier.value, status=status.value).inc()
        if status == CheckpointStatus.CORRUPTED:
            log.error("ALERT checkpoint %s is CORRUPTED: %s", rec.id, reason)
            e.event("corrupted", checkpoint=rec.id, reason=reason, during="resume")

    # ------------------------------------------------------------------ applying

    def restore(
        self,
        cand: Candidate,
        *,
        action: str,
        weights: Candidate | None,
        rejected: Mapping[str, str],
        plan_step: PlanStep | None = None,
    ) -> ResumePoint:
        """Load ``cand`` (weights from ``weights`` in a heartbeat rebuild) into the live objects."""
        e, c = self.engine, self.capture
        warnings: list[str] = []
        source = cand if cand.loaded is not None else weights
        if source is None or source.loaded is None:
            raise ResumeError(f"{cand.record.id}: no weights to restore")
        state = source.loaded
        self._load_objects(source.record.id, state, warnings)
        step = source.record.step
        mine, per_rank_exact = self._own_part(source, warnings)
        data: object = mine.section("data")
        rng = mine.section("rng")
        self.weights_from = weights.record.id if weights is not None else None
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
        if data is not None and c.dataloader_state is not None:
            load = getattr(c.dataloader_state, "load_state_dict", None)
            if callable(load):
                load(data)
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
        )
        self._retire_newer(step, cand.record.id)
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

    def _retire_newer(self, step: int, resumed_from: str) -> None:
        """Checkpoints past the resume step belong to an abandoned branch: mark them expired.

        (Otherwise a later crash could resume from the branch this resume
        deliberately left — e.g. a manual rewind past a loss spike.)
        """
        e = self.engine
        if not e.ranks.coordinator:
            return
        for r in list_checkpoints(e.storage, e.run_id, include_heartbeat=False):
            if r.step <= step or r.status == CheckpointStatus.CORRUPTED or not r.manifest_hash:
                continue
            reason = f"superseded: the run resumed from {resumed_from} (step {step})"
            e.storage.commit(
                validation_key(e.run_id, r.id),
                ValidationRecord(
                    checkpoint_id=r.id,
                    commit_sha256=r.manifest_hash,
                    status=CheckpointStatus.EXPIRED,
                    reason=reason,
                    validated_at=time.time(),
                ).to_bytes(),
            )
            e.catalog.set_status(e.run_id, r.id, CheckpointStatus.EXPIRED, reason)
            e.event("superseded", checkpoint=r.id, reason=reason)


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
