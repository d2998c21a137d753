"""Where training continues: choose, check, load and apply a checkpoint (:class:`Restorer`).

:meth:`Restorer.resume_point` is what :meth:`Checkpointer.start` runs (rank 0's
choice on the other ranks, :mod:`~ckpt_agent.runtime.restore.agreed`):

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
is read, decoded, checked (:mod:`~ckpt_agent.runtime.restore.loading`,
:mod:`~ckpt_agent.runtime.restore.preflight`, before anything is applied) or applied
(:mod:`~ckpt_agent.runtime.restore.apply`) is a rejection, never a crash; checkpoints past
the resume step are marked superseded (:meth:`Restorer.restore`) — after a ladder walk only
those it tried and rejected (:func:`~ckpt_agent.decide.lineage.untried`). The walk verifies
at most :data:`~ckpt_agent.tuning.MAX_RESUME_CANDIDATES` candidates; a start that finds none
usable among them fails and says so. What the save side
continues from — the restored checkpoint's hash, the lineage the new checkpoints carry,
the newest valid step — is returned in the :class:`ResumePoint`
(:meth:`ResumePoint.handover`), never written into the engine or its services. A start
that fails leaves its verdicts in the termination-message report first (after a failed
pin: the ladder's next candidates probed too,
:func:`~ckpt_agent.runtime.restore.bookkeeping.report_failed_start`). What a resume reads
and writes in storage besides the checkpoint (``RECOVER.json``, verdicts, retirements) is
in :mod:`~ckpt_agent.runtime.restore.bookkeeping`; :class:`ResumePoint` and the candidate
types in :mod:`~ckpt_agent.runtime.restore.resume_point`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from ckpt_agent import tuning
from ckpt_agent.decide.lineage import (
    LineageChoice,
    choose,
    pending_to_verify,
    pins_in_force,
    untried,
)
from ckpt_agent.decide.recovery import PlanStep, RecoveryPlan, plan_recovery, walk
from ckpt_agent.errors import CandidateRejectedError, ResumeError
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Lineage
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.restore.apply import Applier
from ckpt_agent.runtime.restore.bookkeeping import (
    consume_recover_request,
    read_recover_request,
    record_verdict,
    report_failed_start,
)
from ckpt_agent.runtime.restore.loading import CandidateLoader
from ckpt_agent.runtime.restore.preflight import LiveState
from ckpt_agent.runtime.restore.resume_point import (
    Candidate,
    Rejection,
    ResumePoint,
    ResumeRequest,
)
from ckpt_agent.text import clean

__all__ = ["Restorer"]

log = logging.getLogger(__name__)

#: Rejected candidates quoted in the error of a start that restores none (the rest counted).
_REASONS_QUOTED = 8


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
            got = None if rec is None else self.restorer.loader.load(rec)
            if isinstance(got, Rejection):
                self.rejected[cid] = got
                got = None
            self._cache[cid] = got
        return self._cache[cid]

    def tried(self) -> frozenset[str]:
        """The candidates loaded (or refused) so far."""
        return frozenset(self._cache)

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


class Restorer:
    """Resume point selection, candidate loading and checks, restore (see the module doc)."""

    def __init__(self, engine: Engine, capture: StateCapture) -> None:
        self.engine = engine
        self.capture = capture
        self.loader = CandidateLoader(engine, capture)
        """Reads and checks candidates (:mod:`.loading`)."""
        self.applier = Applier(engine, capture)
        """Applies the chosen one (:mod:`.apply`)."""
        self.weights_from: str | None = None
        """The weights source of the last heartbeat rebuild (rank 0 tells the other ranks)."""

    # ------------------------------------------------------------------ choosing

    def resume_point(self, chosen: ResumeRequest | None = None) -> ResumePoint:
        """Where training continues; ``chosen``: rank 0's choice, restored exactly (on the
        other ranks). The point also says what the save side continues from
        (:meth:`ResumePoint.handover`), with the newest valid weights step storage held."""
        e = self.engine
        records = e.catalog.rebuild_from_storage(e.storage, e.run_id)
        weights = [r for r in records if r.has_weights and r.status == CheckpointStatus.VALID]
        last_valid = -1
        if weights:
            full = [r.step for r in weights if not r.lightweight]
            last_valid = max(full) if full else -1
            e.metrics.last_valid_step.set(last_valid)
        if e.finalizer.report is not None:  # report in at once: the operator sees the agent
            e.finalizer.report.write(e.run_id, records)
        return replace(self._choose(records, chosen), last_valid_step=last_valid)

    def _choose(self, records: list[CheckpointRecord], chosen: ResumeRequest | None) -> ResumePoint:
        e = self.engine
        attempts = _Attempts(self, records)
        # 1. rank 0 chose: exactly that one.
        if chosen is not None:
            return self._named(
                attempts, chosen.checkpoint_id, chosen.action, chosen.weights_from, chosen.lineage
            )
        request = self.recover_request()
        pins = pins_in_force(
            request, e.config.resume_from, e.config.resume_weights, e.config.resume_pin
        )
        # 2. verify pending checkpoints newer than the newest valid one (crash before validation).
        self._promote_pending(
            attempts, pending_to_verify(attempts.records, pins, tuning.MAX_PENDING_PROMOTIONS)
        )
        # 3. a pin not applied yet: exactly that one, or fail loudly.
        choice = choose(attempts.records, pins)
        if pins:
            log.info("resume lineage: %s", clean(choice.reason))
        pin = choice.apply
        try:
            if pin is not None:
                point = self._named(
                    attempts, pin.checkpoint_id, pin.source, pin.weights_from, choice.lineage
                )
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
        weights_src: str | None,
        lineage: Lineage | None,
    ) -> ResumePoint:
        """Exactly ``wanted`` (a pin, or rank 0's choice), or the start fails loudly."""
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
                f"{clean(rec.extra.get('status_reason', ''))}"
            )
        cand = attempts.get(wanted)
        if cand is None:
            raise ResumeError(
                f"resume from {wanted!r} requested but it cannot be restored: "
                f"{clean(attempts.why(wanted))}"
            )
        weights_from: Candidate | None = None
        if cand.heartbeat is not None:
            src = weights_src or ""
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
                + "; ".join(f"{k}: {clean(v)}" for k, v in list(plan.skipped.items())[:6])
                + " — use `ckpt recover --manual --step N --force` to choose one"
                + _collision_hint(run_id, self.engine.storage.url)
            )
        while True:  # a candidate that fails while being applied is rejected: walk on
            chosen, failed = walk(plan, lambda cid: attempts.get(cid) is not None)
            if chosen is None:
                tried = dict.fromkeys(
                    [s.checkpoint_id for s, _ in failed] + [s.weights_from or "" for s, _ in failed]
                )
                why = [
                    f"{cid}: {clean(attempts.why(cid))}"
                    for cid in tried
                    if cid in attempts.rejected
                ]
                more = len(why) - _REASONS_QUOTED
                raise ResumeError(
                    f"no checkpoint of run {run_id!r} could be restored; tried: "
                    + "; ".join(why[:_REASONS_QUOTED])
                    + (f" (+{more} more)" if more > 0 else "")
                    + _bound_hint(plan)
                    + _collision_hint(run_id, self.engine.storage.url)
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
                    spare=untried(attempts.records, chosen.step, attempts.tried()),
                )
            except CandidateRejectedError as err:
                attempts.reject(err)

    def recover_request(self) -> dict[str, Any] | None:
        """The pending ``RECOVER.json`` of ``ckpt recover --manual`` (None: there is none)."""
        return read_recover_request(self.engine)

    # ------------------------------------------------------------------ loading and applying

    def compat(self, manifest: RankManifest) -> list[str]:
        """Why this checkpoint does not fit the live model/optimizer (empty: it fits)."""
        return self.loader.compat(manifest)

    def live(self, *, fresh: bool = False) -> LiveState:
        """The live objects' shapes (:meth:`CandidateLoader.live`)."""
        return self.loader.live(fresh=fresh)

    def restore(
        self,
        cand: Candidate,
        *,
        action: str,
        weights: Candidate | None,
        rejected: Mapping[str, str],
        plan_step: PlanStep | None = None,
        lineage: Lineage | None = None,
        spare: Collection[str] = (),
    ) -> ResumePoint:
        """Load ``cand`` (weights from ``weights`` in a heartbeat rebuild) into the live objects
        (:meth:`Applier.apply`). The run's next checkpoints carry ``lineage`` (None: the
        restored checkpoint's own), with this checkpoint as their parent; the checkpoints
        past it are retired except ``spare``."""
        point = self.applier.apply(
            cand,
            live=self.live(),
            action=action,
            weights=weights,
            rejected=rejected,
            plan_step=plan_step,
            lineage=lineage,
            spare=spare,
        )
        self.weights_from = weights.record.id if weights is not None else None
        return point


def _bound_hint(plan: RecoveryPlan) -> str:
    """What happened when the walk ended at its bound, and what to do."""
    if not plan.cut:
        return ""
    left = len(dict.fromkeys(s.checkpoint_id for s in plan.cut))
    return (
        f". It stopped after the newest {plan.limit} candidates (the most one start verifies: "
        f"ckpt_agent.tuning.MAX_RESUME_CANDIDATES); {left} older candidate(s) were not tried "
        "and nothing older was resumed or marked. Name the checkpoint to resume with `ckpt "
        "recover --manual --step N --force`, or remove the checkpoints that are not this run's"
    )


def _collision_hint(run_id: str, url: str) -> str:
    """What to do when another experiment's checkpoints are in the way."""
    return (
        f". If these are another experiment's checkpoints (two runs share run id {run_id!r} "
        f"on {url}), give this one its own: set CKPT_RUN_ID (or AgentConfig.run_id)"
    )
