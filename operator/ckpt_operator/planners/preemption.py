"""Checkpoint-aware preemption with Kueue (pure): the priority boost, its writes, evictions.

Kueue (v0.17+, feature gate ``PriorityBoost``, KEP-7990) reads the Workload annotation
``kueue.x-k8s.io/priority-boost`` (a signed int32): effective priority = the Workload's
priority + the boost, and preemption evicts the lowest effective priority first. The
operator keeps the boost of an opted-in job's Workload in step with the job's **at-risk
work**: the time since its newest valid checkpoint (a pulse or full the validator passed)
plus the expected save time, one point per ``secondsPerPoint``, clamped to
``[0, maxBoost]`` (:func:`at_risk`, :func:`boost_points`). Among equal-priority victims
Kueue then picks the one that just checkpointed: the one that loses least.

Writes (:func:`plan_boost`):

* only while the Workload is admitted (``QuotaReserved``), not evicted, not finished,
  and its job still runs; otherwise the boost is removed (a pending Workload with a boost
  would also preempt more eagerly: Kueue compares effective priorities there too);
* at most one value change per ``minUpdateSeconds`` per Workload, and none for a change
  smaller than :func:`hysteresis_points` (no write storm, no flapping); a removal is
  never delayed (one write per state change);
* never over another controller: what the operator last wrote is recorded beside it
  (:data:`ANN_BOOST_WRITTEN`, :data:`ANN_BOOST_WRITTEN_AT`, in the same patch); a boost
  that differs from that record (or exists without one) belongs to someone else, and the
  operator backs off (``CONFLICT``) until both annotations are removed.

Evictions (:func:`ckpt_operator.planners.workload.eviction_of`): the Workload's
``Evicted`` condition turning ``True`` (reasons ``Preempted``, ``PodsReadyTimeout``,
``InactiveWorkload``/``Deactivated``, ``ClusterQueueStopped`` …) is the moment to ask the
pods for an emergency checkpoint, before the job is suspended and its pods get SIGTERM
(:func:`ckpt_operator.planners.disruption_signals.preemption_disruption`). The eviction
is marked on the Workload (:data:`ANN_PREEMPTED`); when it is admitted again, the steps
lost are the newest heartbeat's step minus the newest checkpoint's (:func:`lost_steps`).

The re-admission waits for the evicted pods (:func:`hold_release`, :func:`blocking_pods`):
Kueue re-admits as soon as the quota allows, possibly while they still save, and the
training-operator then fails the re-admitted job when it sees them end; the Workload is
held inactive (:data:`ANN_HELD`) until they are gone, at most their grace plus
:data:`HOLD_MARGIN_S`.

Grace (:func:`termination_grace`): the webhook raises a pod's
``terminationGracePeriodSeconds`` to cover the expected save (:data:`ANN_SAVE_SECONDS` on
the job, measured by the operator; else :data:`DEFAULT_SAVE_SECONDS`) plus
:data:`GRACE_MARGIN_S`, at most ``maxGraceSeconds``, never lowering a larger value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from ckpt_agent.policy.models import PreemptionSpec, PriorityBoostSpec
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.planners.workload import KUEUE_GROUP, WorkloadView

__all__ = [
    "ANN_BOOST",
    "ANN_BOOST_WRITTEN",
    "ANN_BOOST_WRITTEN_AT",
    "ANN_HELD",
    "ANN_PREEMPTED",
    "ANN_SAVE_SECONDS",
    "DEFAULT_SAVE_SECONDS",
    "GRACE_MARGIN_S",
    "HOLD_MARGIN_S",
    "AtRisk",
    "BoostAction",
    "BoostPlan",
    "Progress",
    "at_risk",
    "blocking_pods",
    "boost_due",
    "boost_points",
    "desired_boost",
    "expected_save_seconds",
    "hold_release",
    "hysteresis_points",
    "lost_steps",
    "plan_boost",
    "progress_of",
    "read_due",
    "save_seconds_update",
    "saved_seconds",
    "termination_grace",
]

#: Kueue's annotation (KEP-7990): a signed int32 string; an empty value is rejected.
ANN_BOOST: Final = f"{KUEUE_GROUP}/priority-boost"
#: On the Workload: the boost this operator last wrote (its ownership record).
ANN_BOOST_WRITTEN: Final = f"{c.PREFIX}/priority-boost-written"
#: On the Workload: when (unix seconds) it wrote it (the rate limit survives a restart).
ANN_BOOST_WRITTEN_AT: Final = f"{c.PREFIX}/priority-boost-written-at"
#: On the Workload: the eviction whose save was requested (until it is admitted again).
ANN_PREEMPTED: Final = f"{c.PREFIX}/preempted"
#: On the Workload: the operator holds its re-admission (``spec.active: false``) until the
#: pods Kueue's eviction ends have gone; the value: since when (unix seconds).
ANN_HELD: Final = f"{c.PREFIX}/held-for-evicted-pods"
#: On the job: the expected save time in seconds as the operator estimated it (the
#: webhook raises the pods' termination grace to cover it).
ANN_SAVE_SECONDS: Final = f"{c.PREFIX}/save-seconds"

#: Expected save time when nothing is known about the run (no checkpoint yet, storage out
#: of the operator's reach): a full save of a mid-sized model to object storage.
DEFAULT_SAVE_SECONDS: Final = 60.0
#: The shortest expected save (process start-up of the save, COMMIT, validation handoff).
MIN_SAVE_SECONDS: Final = 10.0
#: Write throughput assumed to turn a checkpoint's size into a save time (conservative for
#: object storage from one node).
ASSUMED_WRITE_BYTES_PER_S: Final = 100 * 1024 * 1024
#: Seconds of grace beyond the expected save (the COMMIT, the process's own exit).
GRACE_MARGIN_S: Final = 15.0
#: Seconds a hold outlasts the evicted pods' longest grace before it is released anyway
#: (a pod stuck terminating on a lost node must not keep the job out of its queue forever).
HOLD_MARGIN_S: Final = 60.0
#: Kubernetes' default ``terminationGracePeriodSeconds``.
DEFAULT_GRACE_S: Final = 30
#: A new save-time estimate is written to the job only when it differs this much (share).
SAVE_SECONDS_CHANGE: Final = 0.25


# --------------------------------------------------------------------------- at-risk work


@dataclass(frozen=True)
class Progress:
    """How far the run is and what of it is safe."""

    valid_step: int | None = None
    """Step of the newest valid checkpoint with weights (None: none)."""
    valid_at: float | None = None
    """When it was taken (unix seconds)."""
    newest_step: int | None = None
    """Step of the newest heartbeat (None: none)."""
    newest_at: float | None = None
    """When it was written."""
    saved_step: int | None = None
    """Step of the newest committed checkpoint with weights that is not known bad (valid, or
    still being validated): where a resume starts once validation passes."""


def progress_of(
    records: Iterable[CheckpointRecord], heartbeats: Sequence[tuple[int, float]]
) -> Progress:
    """A run's :class:`Progress` from its checkpoints and heartbeats ``(step, time)``."""
    weights = [r for r in records if r.has_weights]
    valid = max((r for r in weights if r.resumable), key=lambda r: r.step, default=None)
    saved = max(
        (r for r in weights if r.status in (CheckpointStatus.VALID, CheckpointStatus.PENDING)),
        key=lambda r: r.step,
        default=None,
    )
    newest = max(heartbeats, key=lambda h: h[0], default=None)
    return Progress(
        valid_step=valid.step if valid else None,
        valid_at=valid.created_at if valid else None,
        newest_step=newest[0] if newest else None,
        newest_at=newest[1] if newest else None,
        saved_step=saved.step if saved else None,
    )


def expected_save_seconds(records: Iterable[CheckpointRecord]) -> float:
    """The expected time of a full save: the largest checkpoint's bytes at
    :data:`ASSUMED_WRITE_BYTES_PER_S` (at least :data:`MIN_SAVE_SECONDS`), else
    :data:`DEFAULT_SAVE_SECONDS` when the run has none."""
    largest = max((r.size_bytes for r in records if r.has_weights), default=None)
    if largest is None:
        return DEFAULT_SAVE_SECONDS
    return max(MIN_SAVE_SECONDS, largest / ASSUMED_WRITE_BYTES_PER_S)


@dataclass(frozen=True)
class AtRisk:
    """Work a preemption would lose now (plus the save that would protect it)."""

    seconds: float
    """Training time not in a valid checkpoint, plus the expected save time."""
    steps: int | None
    """Steps since the newest valid checkpoint (None: unknown)."""
    save_seconds: float


def at_risk(
    progress: Progress, *, now: float, running_since: float | None, save_seconds: float
) -> AtRisk:
    """The at-risk work: from the newest valid checkpoint (none: ``running_since``, the
    run's start) to the newest heartbeat (none: ``now``), plus ``save_seconds``."""
    since = progress.valid_at if progress.valid_at is not None else running_since
    work = 0.0
    if since is not None:
        end = now if progress.newest_at is None else min(now, max(progress.newest_at, since))
        work = max(0.0, end - since)
    steps: int | None = None
    if progress.newest_step is not None:
        base = progress.valid_step if progress.valid_step is not None else 0
        steps = max(0, progress.newest_step - base)
    return AtRisk(seconds=work + max(0.0, save_seconds), steps=steps, save_seconds=save_seconds)


def boost_points(risk: AtRisk, spec: PriorityBoostSpec) -> int:
    """``risk.seconds / secondsPerPoint``, rounded down, clamped to ``[0, maxBoost]``."""
    points = math.floor(risk.seconds / spec.seconds_per_point)
    return max(0, min(spec.max_boost, points))


def hysteresis_points(spec: PriorityBoostSpec) -> int:
    """A smaller change than this is not written: 5% of ``maxBoost``, at least 1."""
    return max(1, math.ceil(spec.max_boost * 0.05))


def desired_boost(
    view: WorkloadView, spec: PreemptionSpec, risk: AtRisk | None, *, job_ended: bool
) -> int | None:
    """The boost the Workload should carry (None: none at all): only while the boost is
    enabled, the Workload admitted and not evicted or finished, its job running, and its
    at-risk work known (``risk`` None: the storage is out of the operator's reach)."""
    if not spec.priority_boost.enabled or job_ended or view.finished:
        return None
    if not view.admitted or view.eviction is not None or risk is None:
        return None
    return boost_points(risk, spec.priority_boost)


# --------------------------------------------------------------------------- writes


class BoostAction(StrEnum):
    NONE = "none"
    """Nothing to write (already as wanted, or nothing there and nothing wanted)."""
    WRITE = "write"
    REMOVE = "remove"
    HOLD = "hold"
    """A change is wanted but waits: rate limit or hysteresis."""
    CONFLICT = "conflict"
    """Another controller owns the annotation: back off."""


@dataclass(frozen=True)
class BoostPlan:
    action: BoostAction
    value: int | None
    """The boost wanted (None: none)."""
    previous: int | None
    """The boost this operator wrote before (None: none)."""
    annotations: Mapping[str, str | None]
    """The Workload's annotations to merge-patch (empty unless WRITE or REMOVE)."""
    why: str


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _written(annotations: Mapping[str, str]) -> tuple[str | None, str | None, str | None]:
    return (
        annotations.get(ANN_BOOST),
        annotations.get(ANN_BOOST_WRITTEN),
        annotations.get(ANN_BOOST_WRITTEN_AT),
    )


def boost_due(annotations: Mapping[str, str], *, now: float, spec: PriorityBoostSpec) -> bool:
    """Whether a periodic refresh should look at this Workload: False only while this
    operator's own last write is younger than ``minUpdateSeconds`` (the refresh then
    skips reading storage: it could change nothing)."""
    current, written, at = _written(annotations)
    when = _float(at)
    if written is None or current != written or when is None:
        return True
    return now - when >= spec.min_update_seconds


def read_due(last_read: float | None, *, now: float, spec: PriorityBoostSpec) -> bool:
    """Whether a look at an admitted Workload should read its run's storage again: at most
    once per ``minUpdateSeconds`` (a boost the hysteresis holds is never written, so
    :func:`boost_due` alone would have the refresh re-read the run every few seconds: at a
    hundred jobs on S3, tens of requests a second for nothing). A fresh checkpoint then
    lowers the boost at most ``minUpdateSeconds`` late, the write rate limit's own delay."""
    return last_read is None or now - last_read >= spec.min_update_seconds


def plan_boost(
    annotations: Mapping[str, str],
    desired: int | None,
    *,
    now: float,
    spec: PriorityBoostSpec,
) -> BoostPlan:
    """What to do with the Workload's boost (see the module doc)."""
    current, written, at = _written(annotations)
    mine = _int(written)
    ours_only = {ANN_BOOST_WRITTEN: None, ANN_BOOST_WRITTEN_AT: None}
    if written is None:
        if current is not None:
            return BoostPlan(
                BoostAction.CONFLICT,
                desired,
                None,
                {},
                f"{ANN_BOOST} is {current!r}, set by another controller",
            )
        if desired is None:
            return BoostPlan(BoostAction.NONE, None, None, {}, "no boost wanted, none set")
        return _write(desired, None, now, "first boost")
    if current is None and desired is None:
        # our record outlived the boost (removed by someone): drop the record, touch nothing else
        return BoostPlan(BoostAction.REMOVE, None, mine, ours_only, "boost gone; record dropped")
    if current != written or mine is None:
        shown = "removed" if current is None else f"{current!r}"
        return BoostPlan(
            BoostAction.CONFLICT,
            desired,
            mine,
            {},
            f"{ANN_BOOST} is {shown} but ckpt-operator last wrote {written!r}: another "
            "controller changed it",
        )
    if desired is None:
        return BoostPlan(
            BoostAction.REMOVE, None, mine, {ANN_BOOST: None, **ours_only}, "boost removed"
        )
    if desired == mine:
        return BoostPlan(BoostAction.NONE, desired, mine, {}, "boost unchanged")
    if abs(desired - mine) < hysteresis_points(spec):
        return BoostPlan(
            BoostAction.HOLD, desired, mine, {}, f"change {mine} → {desired} below hysteresis"
        )
    when = _float(at)
    if when is not None and now - when < spec.min_update_seconds:
        return BoostPlan(
            BoostAction.HOLD,
            desired,
            mine,
            {},
            f"last write {now - when:.0f}s ago (minUpdateSeconds {spec.min_update_seconds:g})",
        )
    return _write(desired, mine, now, f"boost {mine} → {desired}")


def _write(value: int, previous: int | None, now: float, why: str) -> BoostPlan:
    text = str(value)
    return BoostPlan(
        BoostAction.WRITE,
        value,
        previous,
        {ANN_BOOST: text, ANN_BOOST_WRITTEN: text, ANN_BOOST_WRITTEN_AT: f"{now:.0f}"},
        why,
    )


# --------------------------------------------------------------------------- after an eviction


def lost_steps(annotations: Mapping[str, str], progress: Progress) -> int | None:
    """Steps an eviction cost, once the Workload is admitted again (None: it was not
    marked as evicted, or the run's progress is unknown): the newest heartbeat's step (the
    last the evicted pods trained) minus the newest saved checkpoint's (where the resume
    starts)."""
    if not annotations.get(ANN_PREEMPTED) or progress.newest_step is None:
        return None
    base = progress.saved_step if progress.saved_step is not None else 0
    return max(0, progress.newest_step - base)


def blocking_pods(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods an eviction has not ended yet: being deleted (a process may still save, and
    the training-operator counts a pod it sees end as a failed replica of the re-admitted
    job), or not ended at all. A pod that ended and is not being deleted blocks nothing."""
    out = []
    for pod in pods:
        body = Body(pod)
        ended = body.status.get("phase") in ("Succeeded", "Failed")
        if meta_of(pod).deletion_timestamp or not ended:
            out.append(pod)
    return out


def _grace_of(pod: Mapping[str, Any]) -> float:
    meta = meta_of(pod)
    grace = meta.raw.get("deletionGracePeriodSeconds")
    if grace is None:
        grace = Body(pod).spec.get("terminationGracePeriodSeconds")
    return float(grace) if isinstance(grace, int | float) else float(DEFAULT_GRACE_S)


def hold_release(
    held: str | None, blocking: Sequence[Mapping[str, Any]], *, now: float, job_ended: bool
) -> str | None:
    """Why a Workload held after its eviction (``held``: the :data:`ANN_HELD` value) may be
    activated again now; None: keep holding. Kueue re-admits an evicted Workload as soon as
    the quota allows, which may be while its evicted pods still write their emergency
    checkpoint: the training-operator then sees them end and fails the re-admitted job. So
    the re-admission waits until they are gone, at most their longest grace plus
    :data:`HOLD_MARGIN_S`."""
    if job_ended:
        return "the job ended"
    if not blocking:
        return "the evicted pods have ended"
    since = _float(held)
    if since is None:
        return "the hold's start is unreadable"
    bound = max(_grace_of(p) for p in blocking) + HOLD_MARGIN_S
    if now - since >= bound:
        return (
            f"{len(blocking)} evicted pod(s) still there after {now - since:.0f}s (their grace "
            f"plus {HOLD_MARGIN_S:.0f}s): released so the job is not kept out of its queue"
        )
    return None


# --------------------------------------------------------------------------- grace


def saved_seconds(job_annotations: Mapping[str, str]) -> float | None:
    """The expected save time the operator recorded on the job (None: none, or unreadable)."""
    value = _float(job_annotations.get(ANN_SAVE_SECONDS))
    return value if value is not None and math.isfinite(value) and value > 0 else None


def save_seconds_update(job_annotations: Mapping[str, str], estimate: float) -> str | None:
    """The new :data:`ANN_SAVE_SECONDS` value, or None when the recorded one is close enough
    (within :data:`SAVE_SECONDS_CHANGE`): the job is written only when the estimate moves."""
    recorded = saved_seconds(job_annotations)
    if recorded is not None and abs(estimate - recorded) <= SAVE_SECONDS_CHANGE * recorded:
        return None
    return f"{math.ceil(estimate)}"


def termination_grace(
    current: object, job_annotations: Mapping[str, str], spec: PreemptionSpec
) -> int | None:
    """The ``terminationGracePeriodSeconds`` the webhook sets, or None to leave the pod's:
    the expected save (:func:`saved_seconds`, else :data:`DEFAULT_SAVE_SECONDS`) plus
    :data:`GRACE_MARGIN_S`, at most ``maxGraceSeconds``; never below the pod's own
    (absent: Kubernetes' 30 s), and nothing when saving on eviction is off."""
    if not spec.save_on_eviction or spec.max_grace_seconds <= 0:
        return None
    save = saved_seconds(job_annotations) or DEFAULT_SAVE_SECONDS
    want = min(spec.max_grace_seconds, math.ceil(save + GRACE_MARGIN_S))
    have = current if isinstance(current, int) and not isinstance(current, bool) else None
    return want if want > (DEFAULT_GRACE_S if have is None else have) else None
