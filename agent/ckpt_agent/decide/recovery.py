"""Recovery ladder planner: what to resume from, in order (pure, no I/O).

:func:`plan_recovery` turns catalog records into an ordered
:class:`RecoveryPlan`; :func:`walk` tries the plan against a verification
callback and returns the first step that verifies. The in-pod engine and the
operator's restart planner call the same two functions (no torch here).

The ladder (each :class:`PlanStep` says which rung and why):

1. **resume** from the newest usable *complete* weights checkpoint (pulse or
   full, not lightweight), then, in case it fails verification, every older usable
   complete checkpoint, newest first, down to the *floor*: the last checkpoint its
   ``prev_hash`` chain reaches within ``max_chain_links`` links (unusable links are
   passed through and counted; a link whose hash is unknown ends the chain) or the
   newest full checkpoint, whichever is older. Chain links say so; a checkpoint the
   chain skips (another branch, an odd checkpoint whose chain points further back) is
   offered before the older ones all the same: a resume never goes back past a usable
   checkpoint it did not try (which would retire it, ``decide.lineage.untried``);
2. **resume** from the newest usable full checkpoint (rung 2, where it stands in that
   order);
3. **rebuild_from_heartbeat** (``allow_heartbeat_rebuild``): step, data
   position and RNG exactly from the newest usable heartbeat plus the saved
   training config, weights from the best stored source at or before it
   (newest first, lightweight pulses included, at most ``max_chain_links + 1``
   sources). With no stored weights at all, a rebuild whose weights come from
   the agent's in-memory snapshot (or nowhere) is listed but needs ``force``.
4. **manual**: with ``manual_step`` the plan is only that step's checkpoints
   (full, then pulse, then a heartbeat rebuild), and it needs ``force``;
   without force the plan holds one blocked step that says so. Force also
   lifts the poisoned / pending / low-score exclusions for that step, never
   ``corrupted``.

A walk verifies at most ``max_candidates`` checkpoints
(:data:`~ckpt_agent.tuning.MAX_RESUME_CANDIDATES`): the steps past the bound are left out
(:attr:`RecoveryPlan.cut`), so forged or foreign checkpoints cannot make a start load
without end; a start that exhausts the bound fails and says so, it never goes back past
candidates it did not try.

"Usable" means status ``valid`` and not poisoned (a checkpoint that made a
resumed run fail before it advanced, see :func:`is_poisoned`). Corrupted,
expired, pending and poisoned checkpoints are listed in
:attr:`RecoveryPlan.skipped` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ckpt_agent import tuning
from ckpt_agent.errors import ForceRequiredError, RetryableError
from ckpt_agent.policy.models import RecoverySpec, Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus

__all__ = ["Action", "PlanStep", "RecoveryPlan", "Verdicts", "is_poisoned", "plan_recovery", "walk"]

Action = Literal["resume", "rebuild_from_heartbeat", "manual"]


@dataclass(frozen=True)
class PlanStep:
    """One thing to try."""

    action: Action
    """``resume``, ``rebuild_from_heartbeat`` or ``manual``."""
    checkpoint_id: str
    """The checkpoint to verify and load (the heartbeat for a rebuild)."""
    weights_from: str | None
    """For a rebuild: the checkpoint supplying weights (None: in-memory/none). Else None."""
    reason: str
    """Why this step is here."""
    rung: int = 1
    """Ladder rung 1–4."""
    step: int = 0
    """Global step of ``checkpoint_id``."""
    tier: Tier | None = None
    """Tier of ``checkpoint_id``."""
    requires_force: bool = False
    """Blocked: only allowed when the plan is made with ``force=True``."""


@dataclass(frozen=True)
class RecoveryPlan:
    """Ordered steps plus what was excluded and why."""

    steps: tuple[PlanStep, ...] = ()
    """What to try, in order."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Checkpoint id → why it is not offered."""
    reason: str = ""
    """One-line summary."""
    force: bool = False
    """The plan was made with force."""
    needs_manual: bool = False
    """No automatic option although checkpoints exist: a person decides (never restart silently)."""
    cut: tuple[PlanStep, ...] = ()
    """Steps left out, oldest candidates last: a walk verifies at most :attr:`limit`
    checkpoints (:data:`~ckpt_agent.tuning.MAX_RESUME_CANDIDATES`)."""
    limit: int = 0
    """The most checkpoints a walk of this plan verifies (0: manual plan, unbounded)."""

    def first(self) -> PlanStep | None:
        """The first step that does not need force (None when there is none)."""
        return next((s for s in self.steps if not s.requires_force), None)

    def require_first(self) -> PlanStep:
        """Like :meth:`first`, raising a readable error instead of returning None."""
        step = self.first()
        if step is not None:
            return step
        blocked = [s for s in self.steps if s.requires_force]
        if blocked:
            raise ForceRequiredError(blocked[0].reason)
        raise LookupError(self.reason or "nothing to resume from")

    @property
    def empty(self) -> bool:
        return not self.steps


def is_poisoned(resumed_step: int, last_step_reached: int | None) -> bool:
    """A resumed run that failed before advancing past its start step poisons the checkpoint."""
    return last_step_reached is None or last_step_reached <= resumed_step


def _key(r: CheckpointRecord) -> tuple[int, int, float, str]:
    tier_order = {Tier.HEARTBEAT: 0, Tier.PULSE: 1, Tier.FULL: 2}
    return (r.step, tier_order[r.tier], r.created_at, r.id)


def _describe(r: CheckpointRecord) -> str:
    notes = []
    if r.approximate:
        notes.append("approximate optimizer state")
    if r.lightweight:
        notes.append("lightweight: weights + RNG only")
    return f" ({', '.join(notes)})" if notes else ""


def _exclusion(r: CheckpointRecord, poisoned: Collection[str]) -> str | None:
    if r.status == CheckpointStatus.CORRUPTED:
        return "corrupted (failed validation)"
    if r.status == CheckpointStatus.EXPIRED:
        return "expired (released by retention)"
    if r.status == CheckpointStatus.PENDING:
        return "pending (not validated yet)"
    if r.id in poisoned:
        return "poisoned (a run resumed from it failed before advancing)"
    return None


def _chain(
    head: CheckpointRecord,
    ordered: list[CheckpointRecord],
    skipped: dict[str, str],
    max_links: int,
) -> tuple[dict[str, int], CheckpointRecord]:
    """The checkpoints ``head``'s ``prev_hash`` chain reaches (id → link number, at most
    ``max_links``; unusable ones passed over and counted) and the oldest one reached."""
    by_hash = {r.manifest_hash: r for r in ordered if r.manifest_hash}
    links: dict[str, int] = {}
    cur, oldest = head, head
    while len(links) < max_links and cur.prev_hash:
        prev = by_hash.get(cur.prev_hash)
        if prev is None:
            skipped.setdefault(
                f"<hash {cur.prev_hash[:12]}>",
                f"chain from {cur.id} ends: previous manifest not in the catalog",
            )
            break
        if prev.id in links or prev.id == head.id:
            break  # a forged chain that loops
        links[prev.id] = len(links) + 1
        if prev.id in skipped:
            skipped[prev.id] += f"; chain link {links[prev.id]} from {head.id} passed over"
        oldest = min(oldest, prev, key=_key)
        cur = prev
    return links, oldest


def _newest_first(
    complete: list[CheckpointRecord],
    ordered: list[CheckpointRecord],
    skipped: dict[str, str],
    max_links: int,
) -> list[tuple[CheckpointRecord, int, str]]:
    """Rungs 1-2: every usable complete checkpoint, newest first, from the newest down to
    the *floor* — the older of the last link of the newest one's chain
    (``max_links``) and the newest full checkpoint — each with its rung and why.

    A checkpoint newer than one the ladder offers is always offered before it (whether
    or not the newest one's chain passes through it): a resume never goes back past a
    usable checkpoint it did not try, so it never retires one (``decide.lineage.untried``).
    """
    head = complete[0]
    links, chain_end = _chain(head, ordered, skipped, max_links)
    fulls = [r for r in complete if r.tier == Tier.FULL]
    newest_full = fulls[0] if fulls else None
    floor = chain_end if newest_full is None else min(chain_end, newest_full, key=_key)
    out: list[tuple[CheckpointRecord, int, str]] = []
    for r in complete:
        if _key(r) < _key(floor):
            break
        if r is head:
            why, rung = f"newest valid {r.tier.value} checkpoint (step {r.step})", 1
        elif r.id in links:
            why = (
                f"chain link {links[r.id]}/{max_links} back from {head.id}, "
                "in case the newer ones fail verification"
            )
            rung = 1
        elif r is newest_full:
            beyond = _key(r) < _key(chain_end)
            where = "beyond the chain walk" if beyond else f"not on the chain of {head.id}"
            why, rung = f"newest valid full checkpoint (step {r.step}), {where}", 2
        elif _key(r) < _key(chain_end):
            assert newest_full is not None  # the floor is below the chain's end
            why = (
                f"step {r.step}, beyond the chain walk: newer than the newest full "
                f"checkpoint (step {newest_full.step}), so tried before it"
            )
            rung = 1
        else:
            why = (
                f"step {r.step}, not on the chain of {head.id}: newer than the ones "
                "further back, so tried before them"
            )
            rung = 1
        out.append((r, rung, why))
    return out


def _bounded(steps: list[PlanStep], limit: int) -> tuple[list[PlanStep], tuple[PlanStep, ...]]:
    """The steps up to the first that would make the walk verify more than ``limit``
    checkpoints (steps that need force verify none), and the ones left out."""
    ids: set[str] = set()
    for i, step in enumerate(steps):
        if step.requires_force:
            continue
        new = {step.checkpoint_id, step.weights_from or step.checkpoint_id} - ids
        if len(ids) + len(new) > limit:
            return steps[:i], tuple(steps[i:])
        ids |= new
    return steps, ()


def plan_recovery(
    records: Sequence[CheckpointRecord],
    spec: RecoverySpec | None = None,
    *,
    poisoned: Collection[str] = (),
    manual_step: int | None = None,
    force: bool = False,
    max_candidates: int | None = None,
) -> RecoveryPlan:
    """Build the ladder for ``records`` (see the module docstring).

    ``max_candidates``: the most checkpoints a walk of the plan verifies (default
    :data:`~ckpt_agent.tuning.MAX_RESUME_CANDIDATES`); the steps past it are left out
    (:attr:`RecoveryPlan.cut`) and the summary says so.
    """
    spec = spec if spec is not None else RecoverySpec()
    poisoned = frozenset(poisoned)
    ordered = sorted(records, key=_key, reverse=True)  # newest first
    skipped = {r.id: why for r in ordered if (why := _exclusion(r, poisoned)) is not None}
    usable = [r for r in ordered if r.id not in skipped]

    if manual_step is not None:
        return _manual(ordered, usable, skipped, manual_step, force)

    steps: list[PlanStep] = []
    listed: set[str] = set()

    def add(step: PlanStep) -> None:
        key = step.checkpoint_id + "|" + (step.weights_from or "")
        if key not in listed:
            listed.add(key)
            steps.append(step)

    # rungs 1-2: the complete weights checkpoints, newest first, down to the floor
    complete = [r for r in usable if r.has_weights and not r.lightweight]
    if complete:
        for r, rung, why in _newest_first(complete, ordered, skipped, spec.max_chain_links):
            add(
                PlanStep(
                    "resume", r.id, None, why + _describe(r), rung=rung, step=r.step, tier=r.tier
                )
            )

    # rung 3: heartbeat rebuild
    heartbeats = [r for r in usable if r.tier == Tier.HEARTBEAT]
    if heartbeats and spec.allow_heartbeat_rebuild:
        hb = heartbeats[0]
        sources = [r for r in usable if r.has_weights and r.step <= hb.step]
        sources.sort(key=lambda r: (r.step, not r.lightweight, r.tier == Tier.FULL), reverse=True)
        for src in sources[: spec.max_chain_links + 1]:
            add(
                PlanStep(
                    "rebuild_from_heartbeat",
                    hb.id,
                    src.id,
                    f"step {hb.step} and RNG exact from the newest heartbeat + saved config; "
                    f"weights from {src.id} (step {src.step})" + _describe(src),
                    rung=3,
                    step=hb.step,
                    tier=hb.tier,
                )
            )
        if not sources:
            add(
                PlanStep(
                    "rebuild_from_heartbeat",
                    hb.id,
                    None,
                    f"step {hb.step} and RNG exact from the newest heartbeat, but no stored "
                    "weights: weights from the agent's in-memory snapshot if it still holds "
                    "one" + ("" if force else "; needs force"),
                    rung=3,
                    step=hb.step,
                    tier=hb.tier,
                    requires_force=not force,
                )
            )
    elif heartbeats:
        skipped[heartbeats[0].id] = "heartbeat rebuild disabled (allowHeartbeatRebuild=false)"

    limit = tuning.MAX_RESUME_CANDIDATES if max_candidates is None else max_candidates
    steps, cut = _bounded(steps, limit)
    beyond = ""
    if cut:
        beyond = (
            f"; {len(cut)} older step(s) left out: a start verifies at most {limit} "
            "candidates (ckpt_agent.tuning.MAX_RESUME_CANDIDATES)"
        )
    if any(not s.requires_force for s in steps):
        summary = (
            f"{len(steps)} step(s); first: {steps[0].action} {steps[0].checkpoint_id}" + beyond
        )
        needs_manual = False
    elif not records:
        summary = "no checkpoints: nothing to resume from (a fresh start is safe)"
        needs_manual = False
    else:
        summary = (
            "no usable checkpoint among "
            f"{len(records)} record(s); name a step with manual_step and force"
        )
        needs_manual = True
    return RecoveryPlan(
        steps=tuple(steps),
        skipped=skipped,
        reason=summary,
        force=force,
        needs_manual=needs_manual,
        cut=cut,
        limit=limit,
    )


def _manual(
    ordered: list[CheckpointRecord],
    usable: list[CheckpointRecord],
    skipped: dict[str, str],
    manual_step: int,
    force: bool,
) -> RecoveryPlan:
    at = [r for r in ordered if r.step == manual_step]
    if not at:
        return RecoveryPlan(
            skipped=skipped,
            reason=f"no checkpoint at step {manual_step}",
            force=force,
            needs_manual=True,
        )
    candidates = [r for r in at if r.status != CheckpointStatus.CORRUPTED]
    if not force:
        best = max(candidates or at, key=_key)
        return RecoveryPlan(
            steps=(
                PlanStep(
                    "manual",
                    best.id,
                    None,
                    f"resuming from the named step {manual_step} needs force "
                    "(it bypasses the automatic ladder and its safety checks)",
                    rung=4,
                    step=best.step,
                    tier=best.tier,
                    requires_force=True,
                ),
            ),
            skipped=skipped,
            reason=f"manual step {manual_step} requested without force",
            force=False,
            needs_manual=True,
        )
    steps: list[PlanStep] = []
    for r in sorted(candidates, key=lambda r: (r.has_weights, not r.lightweight, _key(r)))[::-1]:
        notes = [f"named step {manual_step}, forced"]
        if (why := skipped.pop(r.id, None)) is not None:
            notes.append(f"overriding: {why}")
        notes.append(f"score {r.score:.2f}")
        if r.has_weights:
            steps.append(
                PlanStep(
                    "manual",
                    r.id,
                    None,
                    "; ".join(notes) + _describe(r),
                    rung=4,
                    step=r.step,
                    tier=r.tier,
                )
            )
        else:
            src = next((s for s in usable if s.has_weights and s.step <= r.step), None)
            notes.append(f"rebuild: weights from {src.id}" if src else "rebuild: no stored weights")
            steps.append(
                PlanStep(
                    "manual",
                    r.id,
                    None if src is None else src.id,
                    "; ".join(notes),
                    rung=4,
                    step=r.step,
                    tier=r.tier,
                )
            )
    reason = (
        f"manual step {manual_step}, forced"
        if steps
        else f"every checkpoint at step {manual_step} is corrupted"
    )
    return RecoveryPlan(
        steps=tuple(steps), skipped=skipped, reason=reason, force=True, needs_manual=not steps
    )


class Verdicts:
    """``verify(checkpoint_id)`` asked at most once per id: ``verdicts(cid)`` is
    ``(ok, why)``. An exception counts as a failure with its message as the reason,
    except a :class:`~ckpt_agent.errors.RetryableError` (a storage outage says nothing
    about the checkpoint): it propagates and is asked again next time."""

    def __init__(self, verify: Callable[[str], bool]) -> None:
        self._verify = verify
        self._seen: dict[str, tuple[bool, str]] = {}

    def __call__(self, cid: str) -> tuple[bool, str]:
        if cid not in self._seen:
            try:
                ok = bool(self._verify(cid))
                self._seen[cid] = (ok, "" if ok else f"{cid} failed verification")
            except RetryableError:
                raise
            except Exception as exc:
                self._seen[cid] = (False, f"{cid} verification raised {type(exc).__name__}: {exc}")
        return self._seen[cid]


def walk(
    plan: RecoveryPlan, verify: Callable[[str], bool], verdicts: Verdicts | None = None
) -> tuple[PlanStep | None, list[tuple[PlanStep, str]]]:
    """Try the plan in order: the first step whose checkpoint (and weights source) verifies.

    ``verify(checkpoint_id)`` is called at most once per id (results are
    cached); an exception counts as a failure with its message as the reason,
    except a :class:`~ckpt_agent.errors.RetryableError` (a storage outage says
    nothing about the checkpoint): it propagates, so the caller retries later
    instead of walking past a good checkpoint.
    Steps that need force are rejected without calling ``verify``. Returns
    the accepted step (None when none verified) and the rejected ones with
    the reason. ``verdicts``: answers already asked (:class:`Verdicts` of ``verify``).
    """
    check = verdicts if verdicts is not None else Verdicts(verify)

    rejected: list[tuple[PlanStep, str]] = []
    for step in plan.steps:
        if step.requires_force:
            rejected.append((step, "needs force"))
            continue
        ok, why = check(step.checkpoint_id)
        if ok and step.weights_from is not None:
            ok, why = check(step.weights_from)
        if ok:
            return step, rejected
        rejected.append((step, why))
    return None, rejected
