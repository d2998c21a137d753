"""Recovery ladder planner: what to resume from, in order (pure, no I/O).

:func:`plan_recovery` turns catalog records into an ordered
:class:`RecoveryPlan`; :func:`walk` tries the plan against a verification
callback and returns the first step that verifies. The in-pod engine and the
operator's restart planner call the same two functions (no torch here).

The ladder (each :class:`PlanStep` says which rung and why):

1. **resume** from the newest usable *complete* weights checkpoint (pulse or
   full, not lightweight), then, in case it fails verification, the
   checkpoints reached by following its ``prev_hash`` chain back, at most
   ``max_chain_links`` links (unusable links are passed through and counted;
   a link whose hash is unknown ends the chain);
2. **resume** from the newest usable full checkpoint, when not already listed;
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

"Usable" means status ``valid`` and not poisoned (a checkpoint that made a
resumed run fail before it advanced, see :func:`is_poisoned`). Corrupted,
expired, pending and poisoned checkpoints are listed in
:attr:`RecoveryPlan.skipped` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

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


def plan_recovery(
    records: Sequence[CheckpointRecord],
    spec: RecoverySpec | None = None,
    *,
    poisoned: Collection[str] = (),
    manual_step: int | None = None,
    force: bool = False,
) -> RecoveryPlan:
    """Build the ladder for ``records`` (see the module docstring)."""
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

    # rung 1: newest complete weights checkpoint + its prev chain
    complete = [r for r in usable if r.has_weights and not r.lightweight]
    if complete:
        head = complete[0]
        add(
            PlanStep(
                "resume",
                head.id,
                None,
                f"newest valid {head.tier.value} checkpoint (step {head.step})" + _describe(head),
                rung=1,
                step=head.step,
                tier=head.tier,
            )
        )
        by_hash = {r.manifest_hash: r for r in ordered if r.manifest_hash}
        cur, links = head, 0
        while links < spec.max_chain_links and cur.prev_hash:
            prev = by_hash.get(cur.prev_hash)
            if prev is None:
                skipped.setdefault(
                    f"<hash {cur.prev_hash[:12]}>",
                    f"chain from {cur.id} ends: previous manifest not in the catalog",
                )
                break
            links += 1
            if prev.id in skipped:
                skipped[prev.id] += f"; chain link {links} from {head.id} passed over"
            elif prev.has_weights:
                add(
                    PlanStep(
                        "resume",
                        prev.id,
                        None,
                        f"chain link {links}/{spec.max_chain_links} back from {head.id}, "
                        f"in case the newer ones fail verification" + _describe(prev),
                        rung=1,
                        step=prev.step,
                        tier=prev.tier,
                    )
                )
            cur = prev
        # rung 2: newest valid full
        fulls = [r for r in complete if r.tier == Tier.FULL]
        if fulls and fulls[0].id not in {s.checkpoint_id for s in steps}:
            f = fulls[0]
            add(
                PlanStep(
                    "resume",
                    f.id,
                    None,
                    f"newest valid full checkpoint (step {f.step}), beyond the chain walk",
                    rung=2,
                    step=f.step,
                    tier=f.tier,
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

    if any(not s.requires_force for s in steps):
        summary = f"{len(steps)} step(s); first: {steps[0].action} {steps[0].checkpoint_id}"
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
