"""Applying a chosen, checked candidate to the live objects (:class:`Applier`).

:meth:`Applier.apply` runs the steps of a restore in order, each a method:

1. :meth:`~Applier._weights_source`: the candidate itself, or the weights checkpoint a
   heartbeat rebuild takes its weights from; checked first if it did not come from
   :meth:`~ckpt_agent.runtime.restore.loading.CandidateLoader.load` (a shared-memory
   snapshot);
2. :meth:`~Applier._apply_state`: model, optimizer, LR scheduler, grad scaler and the
   scheduler's state (:meth:`~Applier._load_objects`), then this rank's RNG and data
   position (:meth:`~Applier._own_part`; from the heartbeat in a rebuild) — a failure
   from here on is a rejection too (the next rung overwrites what was applied);
3. :meth:`~Applier._continue_run`: the hash chain link and lineage the run's next
   checkpoints continue from (returned in the point, for the save side:
   :meth:`ResumePoint.handover
   <ckpt_agent.runtime.restore.resume_point.ResumePoint.handover>`), and the blob index
   seeded (a locked service);
4. the :class:`~ckpt_agent.runtime.restore.resume_point.ResumePoint`, then checkpoints
   past the resume step retired (:func:`~ckpt_agent.runtime.restore.bookkeeping.retire_newer`;
   after a ladder walk only those it tried and rejected, never one it did not try).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckpt_agent.decide.recovery import PlanStep
from ckpt_agent.errors import CandidateRejectedError, RejectionKind, ResumeError
from ckpt_agent.records import Lineage
from ckpt_agent.runtime.core.capture import TRAIN_CONFIG_FILE, StateCapture
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.core.inline import heartbeat_state
from ckpt_agent.runtime.core.serialization import LoadedState, restore_rng
from ckpt_agent.runtime.core.sharded import restore_sharded
from ckpt_agent.runtime.restore.bookkeeping import retire_newer
from ckpt_agent.runtime.restore.preflight import LiveState, as_rejection, check_loaded
from ckpt_agent.runtime.restore.resume_point import Candidate, ResumePoint
from ckpt_agent.text import clean

__all__ = ["Applier"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Applied:
    """What step 2 restored: the step, data position, and whether this rank's part is exact."""

    step: int
    data: object
    per_rank_exact: bool


def _as_dict(value: object, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ResumeError(f"checkpoint section {what!r} is missing or not a mapping")
    return value


class Applier:
    """Restores a candidate into the live objects of one checkpointer (module doc)."""

    def __init__(self, engine: Engine, capture: StateCapture) -> None:
        self.engine = engine
        self.capture = capture

    def apply(
        self,
        cand: Candidate,
        *,
        live: LiveState,
        action: str,
        weights: Candidate | None,
        rejected: Mapping[str, str],
        plan_step: PlanStep | None = None,
        lineage: Lineage | None = None,
        spare: Collection[str] = (),
    ) -> ResumePoint:
        """Load ``cand`` (weights from ``weights`` in a heartbeat rebuild) into the live objects.

        The run's next checkpoints carry ``lineage`` (None: the restored checkpoint's own),
        with this checkpoint as their parent, and link to its hash: both in the returned
        point (:attr:`ResumePoint.lineage`, :attr:`ResumePoint.prev_hash`). The checkpoints
        past the resume step are retired, except ``spare`` (a ladder resume's untried ones,
        :func:`~ckpt_agent.decide.lineage.untried`)."""
        warnings: list[str] = []
        source = self._weights_source(cand, weights, live)
        assert source.loaded is not None
        state = source.loaded
        applied = self._apply_state(cand, source, warnings)
        epoch = applied.data.get("epoch") if isinstance(applied.data, dict) else None
        train_config = _train_config(state, warnings)
        meta = state.manifest.meta
        exact = (
            cand.heartbeat is None
            and not meta.lightweight
            and not meta.approximate
            and applied.per_rank_exact
        )
        run_lineage = self._continue_run(cand, source, lineage)
        self.engine.metrics.recovery_successes.inc()
        for w in warnings:
            log.warning("resume: %s", clean(w))
        point = ResumePoint(
            step=applied.step + 1,
            checkpoint_id=cand.record.id,
            checkpoint_step=applied.step,
            action=action,
            exact=exact,
            data_state=applied.data,
            epoch=epoch if isinstance(epoch, int) else None,
            train_config=train_config,
            reason=plan_step.reason if plan_step is not None else f"{action} {cand.record.id}",
            rejected=tuple(rejected.items()),
            warnings=tuple(warnings),
            lineage=run_lineage,
            prev_hash=source.manifest_hash or None,
        )
        retire_newer(self.engine, applied.step, cand.record.id, spare=spare, rejected=rejected)
        return point

    def _weights_source(
        self, cand: Candidate, weights: Candidate | None, live: LiveState
    ) -> Candidate:
        """Step 1: where the weights come from, checked against the live objects."""
        source = cand if cand.loaded is not None else weights
        if source is None or source.loaded is None:
            raise ResumeError(f"{cand.record.id}: no weights to restore")
        if not source.checked:  # not from load() (a shared-memory snapshot): check it first
            try:
                check_loaded(source.record.id, source.loaded, source.own, live)
            except Exception as err:
                raise as_rejection(source.record.id, err) from err
        return source

    def _apply_state(self, cand: Candidate, source: Candidate, warnings: list[str]) -> _Applied:
        """Step 2: the objects, then this rank's RNG and data position (a failure: rejected)."""
        assert source.loaded is not None
        c = self.capture
        try:  # it passed every check: a failure now is rejected too, the next rung overwrites
            self._load_objects(source.record.id, source.loaded, warnings)
            step = source.record.step
            mine, per_rank_exact = self._own_part(source, warnings)
            data: object = mine.section("data")
            rng = mine.section("rng")
            if cand.heartbeat is not None:  # heartbeat rebuild: step, data, RNG from the heartbeat
                step = cand.heartbeat.step
                data, rng = heartbeat_state(cand.heartbeat)
                warnings.append(
                    f"rebuilt from heartbeat at step {step} with weights of step "
                    f"{source.record.step}: not exact"
                )
            elif source.own_heartbeat is not None:  # a JIT save: this rank's step heartbeat
                data, rng = heartbeat_state(source.own_heartbeat)
            if isinstance(rng, dict):
                warnings.extend(restore_rng(rng))
            if data is not None and c.dataloader_state is not None:
                load = getattr(c.dataloader_state, "load_state_dict", None)
                if callable(load):
                    load(data)
        except Exception as err:
            raise as_rejection(source.record.id, err, applying=True) from err
        return _Applied(step=step, data=data, per_rank_exact=per_rank_exact)

    def _continue_run(self, cand: Candidate, source: Candidate, lineage: Lineage | None) -> Lineage:
        """Step 3: the lineage the run's next checkpoints carry (they chain on the restored
        one: :meth:`apply` returns its hash); its blobs seed the writer's index."""
        assert source.loaded is not None
        self.engine.parts.index.seed(source.loaded.manifest)
        base = lineage if lineage is not None else source.record.lineage
        return replace(base, parent=cand.record.id)

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
                saved = _as_dict(state.section(name), name)
                keys = (_group_keys(saved.get("param_groups")), _group_keys(obj_groups(obj)))
                try:
                    obj.load_state_dict(saved)
                except Exception as err:  # what changed, before load_state_dict touched it
                    why = _mismatch(name, obj, sorted(saved), keys, err)
                    raise CandidateRejectedError(
                        source_id, RejectionKind.INCOMPATIBLE, why
                    ) from err
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
        if source.own_heartbeat is not None:
            pass  # a JIT save: this rank's from its own step heartbeat (_apply_state)
        elif ranks.rank != 0:  # this rank's RNG and data position come from its own part
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


def obj_groups(obj: object) -> object:
    """An optimizer's live ``param_groups`` (None for anything else)."""
    return getattr(obj, "param_groups", None)


def _group_keys(groups: object) -> frozenset[str] | None:
    """The hyperparameter names of the first param group (an optimizer's signature)."""
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        return frozenset(str(k) for k in groups[0] if k != "params")
    return None


def _mismatch(
    name: str,
    live: object,
    saved_keys: list[str],
    groups: tuple[frozenset[str] | None, frozenset[str] | None],
    err: Exception,
) -> str:
    """Why a saved optimizer / LR scheduler / grad scaler state does not fit the live one:
    what changed, and what to do."""
    kind = type(live).__name__
    changed = ""
    have, want = groups
    if name == "optimizer" and have is not None and want is not None and have != want:
        changed = (
            f"; its hyperparameters differ — only in the checkpoint: {sorted(have - want)}, "
            f"only in the live {kind}: {sorted(want - have)} (another optimizer type?)"
        )
    elif name != "optimizer":
        changed = f"; the checkpoint's {name} has {saved_keys[:8]}"
    return (
        f"its {name} state does not fit the live {kind} ({type(err).__name__}: {err}){changed}. "
        f"Resume with the {name} the checkpoint was saved with, or start the changed "
        "experiment under its own run id (CKPT_RUN_ID)"
    )
