"""Checkpoint-aware preemption with Kueue: the Workload's priority boost, the save on eviction.

For each Kueue Workload owned by an opted-in job (PyTorchJob or TrainJob; only with the
operator's ``--kueue``), :func:`reconcile_workload` (every watch event, and a periodic
refresh: at-risk work grows with no event at all):

* on an eviction (``Evicted=True``): every pod of the job gets the save-now signal
  (:func:`ckpt_operator.behaviours.disruption.signal_save_now`, reason ``Preemption``),
  a ``PreemptionSave`` Event on the job and the Workload with the steps at risk, and the
  Workload is marked (:data:`~ckpt_operator.planners.preemption.ANN_PREEMPTED`);
* admitted again after that: the steps lost (``ckpt_preemption_lost_steps``) and a
  ``PreemptionResumed`` Event;
* the boost (:func:`ckpt_operator.planners.preemption.plan_boost`): written, removed, held
  (rate limit, hysteresis), or left to another controller (``PriorityBoostConflict``,
  once per value); each change a ``PriorityBoostChanged`` Event. Storage the operator
  cannot read gives no boost, said once (``PriorityBoostUnavailable``).

The decisions are :mod:`ckpt_operator.planners.preemption`'s; the Workload carries the
operator's record of its writes, so a restarted operator resumes where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_agent.records import CheckpointRecord
from ckpt_agent.storage import StorageError
from ckpt_agent.text import clean
from ckpt_operator.adapters.events import EventType
from ckpt_operator.adapters.kube import ConflictError, NotFoundError
from ckpt_operator.behaviours.deps import Deps, Obj, annotate_job, cached_policy
from ckpt_operator.behaviours.disruption import signal_save_now
from ckpt_operator.behaviours.guard import read_refusal, storage_call
from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.kinds.trainjob import TRAINJOB
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.model.jobs import JobFacts, job_facts
from ckpt_operator.planners.disruption_signals import preemption_disruption
from ckpt_operator.planners.preemption import (
    ANN_HELD,
    ANN_PREEMPTED,
    ANN_SAVE_SECONDS,
    HOLD_MARGIN_S,
    AtRisk,
    BoostAction,
    BoostPlan,
    Progress,
    at_risk,
    blocking_pods,
    boost_due,
    desired_boost,
    expected_save_seconds,
    hold_release,
    lost_steps,
    plan_boost,
    progress_of,
    read_due,
    save_seconds_update,
)
from ckpt_operator.planners.validation import parse_policy_spec
from ckpt_operator.planners.workload import (
    KUEUE_GROUP,
    KUEUE_VERSION,
    WORKLOADS,
    Eviction,
    WorkloadView,
    workload_view,
)

__all__ = ["PreemptionState", "RunRead", "reconcile_workload", "slim_workload"]

log = logging.getLogger(__name__)


def slim_workload(workload: Mapping[str, Any]) -> Obj:
    """What the refresh keeps of a Workload (no pod templates): identity, annotations,
    owners and conditions."""
    meta = meta_of(workload)
    keep = ("name", "namespace", "uid", "resourceVersion", "annotations", "ownerReferences")
    return {
        "apiVersion": workload.get("apiVersion", f"{KUEUE_GROUP}/{KUEUE_VERSION}"),
        "kind": workload.get("kind", "Workload"),
        "metadata": {k: meta[k] for k in keep if k in meta},
        "status": {"conditions": list((workload.get("status") or {}).get("conditions") or ())},
    }


@dataclass
class PreemptionState:
    """What the Workload handler remembers in memory (the Workload's annotations hold the
    rest): the Workloads to refresh, the conflicts and blind runs already reported."""

    workloads: dict[tuple[str, str], Obj] = field(default_factory=dict)
    conflicts: dict[str, str] = field(default_factory=dict)
    """Workload uid → the conflict last reported (reported again only when it changes)."""
    blind: set[str] = field(default_factory=set)
    """Workload uids whose run the operator could not read, already reported."""
    last_read: dict[str, float] = field(default_factory=dict)
    """Workload uid → when its run's storage was last read for the boost."""

    def upsert(self, workload: Mapping[str, Any]) -> None:
        meta = meta_of(workload)
        self.workloads[(str(meta.namespace), str(meta.name))] = slim_workload(workload)

    def forget(self, workload: Mapping[str, Any]) -> None:
        meta = meta_of(workload)
        self.workloads.pop((str(meta.namespace), str(meta.name)), None)
        uid = str(meta.uid or "")
        self.conflicts.pop(uid, None)
        self.blind.discard(uid)
        self.last_read.pop(uid, None)

    def all(self) -> Iterator[Obj]:
        yield from list(self.workloads.values())


@dataclass(frozen=True)
class RunRead:
    """The run's checkpoints and heartbeats, or why they could not be read."""

    records: list[CheckpointRecord]
    heartbeats: list[tuple[int, float]]
    blind: str | None = None

    @property
    def progress(self) -> Progress | None:
        return None if self.blind else progress_of(self.records, self.heartbeats)


async def _read_run(
    deps: Deps, facts: JobFacts, spec: CheckpointPolicySpec, namespace: str
) -> RunRead:
    try:
        source = await deps.sources(namespace, str(facts.policy), spec)
        if not await storage_call(deps, source.reachable):
            return RunRead([], [], "its storage is not reachable from the operator")
        refusal = await read_refusal(deps, source, facts.run_id, namespace)
        if refusal is not None:
            return RunRead([], [], refusal)
        records = await storage_call(
            deps, source.list_checkpoints, facts.run_id, include_heartbeat=False
        )
        beats = await storage_call(deps, source.progress, facts.run_id)
    except (StorageError, CheckpointFormatError, ValueError) as e:
        return RunRead([], [], f"{type(e).__name__}: {e}")
    return RunRead(records, beats)


def _kind(view: WorkloadView) -> JobKind:
    assert view.owner is not None
    return TRAINJOB if view.owner.kind == c.TRAINJOB_KIND else PYTORCHJOB


async def _patch_workload(
    deps: Deps,
    view: WorkloadView,
    version: object,
    annotations: Mapping[str, str | None],
    *,
    spec: Obj | None = None,
) -> bool:
    """Merge-patch the Workload's annotations (and ``spec`` fields), on the version read
    (False: it changed or went meanwhile; the next event or refresh looks again)."""
    patch: Obj = {"metadata": {"annotations": dict(annotations)}}
    if spec:
        patch["spec"] = dict(spec)
    if version:
        patch["metadata"]["resourceVersion"] = str(version)
    try:
        await deps.api.patch_custom(
            KUEUE_GROUP, KUEUE_VERSION, WORKLOADS, view.namespace, view.name, patch
        )
    except (ConflictError, NotFoundError) as e:
        log.debug("Workload %s/%s not patched: %s", view.namespace, view.name, clean(e))
        return False
    return True


def _emit(
    deps: Deps, objs: tuple[Mapping[str, Any], ...], type_: EventType, reason: str, msg: str
) -> None:
    for obj in objs:
        deps.events.emit(obj, type_, reason, msg)


async def reconcile_workload(
    deps: Deps, state: PreemptionState, workload: Mapping[str, Any]
) -> BoostPlan | None:
    """One look at a Workload (see the module doc); returns the boost plan applied (None:
    not an opted-in job's, or nothing was planned). Storage is read only when a boost
    write could be due (:func:`~ckpt_operator.planners.preemption.boost_due`), on a watch
    event as on a periodic look."""
    view = workload_view(workload)
    if view.owner is None:
        return None
    kind = _kind(view)
    # the opted-in jobs' watch cache only: a Workload of any other job costs no API read
    job = deps.job_cache(kind).get(view.namespace, view.owner.name)
    if job is None:
        return None
    facts = job_facts(job)
    if not facts.opted_in:
        return None
    policy = await cached_policy(deps, view.namespace, str(facts.policy))
    spec, _ = parse_policy_spec(policy.get("spec")) if policy is not None else (None, [])
    if spec is None:
        return None
    pre = spec.preemption
    now = deps.clock()
    ended = facts.succeeded or facts.failed or facts.deleting
    version = meta_of(workload).resource_version
    objs = (job, workload)
    if ANN_HELD in view.annotations:  # re-admission held until the evicted pods are gone
        await _release_if_due(deps, view, objs, kind, facts, ended=ended, now=now)
    elif view.eviction is not None and pre.save_on_eviction and not ended:
        await _save_on_eviction(deps, view, objs, kind, facts, spec, hold=view.active, now=now)
        # the boost's removal goes with the next look (the mark changed the version)
        if ANN_PREEMPTED not in view.annotations:
            return None
    elif view.admitted and view.eviction is None and ANN_PREEMPTED in view.annotations:
        await _resumed(deps, view, objs, facts, spec, version)
        return None

    boosting = (
        pre.priority_boost.enabled
        and view.admitted
        and view.eviction is None
        and not view.finished
        and not ended
    )
    if boosting and not boost_due(view.annotations, now=now, spec=pre.priority_boost):
        return None  # our last write is too recent to change: no storage read (any event)
    if boosting and not read_due(state.last_read.get(view.uid), now=now, spec=pre.priority_boost):
        return None  # read moments ago (a boost the hysteresis holds): no storage read
    risk: AtRisk | None = None
    if boosting:
        state.last_read[view.uid] = now
        run = await _read_run(deps, facts, spec, view.namespace)
        progress = run.progress
        if progress is None:
            if view.uid not in state.blind:
                state.blind.add(view.uid)
                _emit(
                    deps,
                    objs,
                    "Normal",
                    "PriorityBoostUnavailable",
                    f"no Kueue priority boost for run {facts.run_id}: the operator cannot read "
                    f"its checkpoints ({run.blind}); Kueue orders this job by its priority "
                    "alone",
                )
        else:
            state.blind.discard(view.uid)
            save_s = expected_save_seconds(run.records)
            running_since = view.admitted_at or facts.created_at
            risk = at_risk(progress, now=now, running_since=running_since, save_seconds=save_s)
            update = save_seconds_update(facts.annotations, save_s)
            if update is not None and pre.save_on_eviction:
                await annotate_job(deps, job, {ANN_SAVE_SECONDS: update})
    desired = desired_boost(view, pre, risk, job_ended=ended)
    plan = plan_boost(view.annotations, desired, now=now, spec=pre.priority_boost)
    await _apply(deps, state, view, objs, plan, risk, version, spec, ended)
    return plan


def _why_removed(view: WorkloadView, ended: bool, enabled: bool) -> str:
    if not enabled:
        return "the policy's preemption.priorityBoost.enabled is false"
    if ended:
        return "the job ended"
    if view.finished:
        return "the Workload finished"
    if view.eviction is not None:
        return f"the Workload was evicted ({view.eviction.reason})"
    if not view.admitted:
        return "the Workload is not admitted"
    return "the run's checkpoints cannot be read"


async def _apply(
    deps: Deps,
    state: PreemptionState,
    view: WorkloadView,
    objs: tuple[Mapping[str, Any], ...],
    plan: BoostPlan,
    risk: AtRisk | None,
    version: object,
    spec: CheckpointPolicySpec,
    ended: bool,
) -> None:
    boost = spec.preemption.priority_boost
    if plan.action is BoostAction.CONFLICT:
        if state.conflicts.get(view.uid) != plan.why:
            state.conflicts[view.uid] = plan.why
            _emit(
                deps,
                objs,
                "Warning",
                "PriorityBoostConflict",
                f"{plan.why}; ckpt-operator backs off and leaves it alone. To hand it back, "
                "remove both kueue.x-k8s.io/priority-boost and ckpt.dev/priority-boost-written "
                "from the Workload",
            )
        return
    if plan.action not in (BoostAction.WRITE, BoostAction.REMOVE):
        return
    if not await _patch_workload(deps, view, version, plan.annotations):
        return
    state.conflicts.pop(view.uid, None)
    action = plan.action.value
    deps.metrics.boost_writes.labels(action).inc()
    if plan.action is BoostAction.WRITE and risk is not None:
        steps = "?" if risk.steps is None else str(risk.steps)
        message = (
            f"Kueue priority boost {plan.previous if plan.previous is not None else 0} → "
            f"{plan.value}: {steps} steps / {risk.seconds:.0f}s at risk (expected save "
            f"{risk.save_seconds:.0f}s; 1 point per {boost.seconds_per_point:g}s, at most "
            f"{boost.max_boost})"
        )
    elif plan.action is BoostAction.REMOVE and plan.previous is not None:
        message = (
            f"Kueue priority boost {plan.previous} removed: "
            f"{_why_removed(view, ended, boost.enabled)}"
        )
    else:
        return  # only our stale record was dropped
    _emit(deps, objs, "Normal", "PriorityBoostChanged", message)


async def _save_on_eviction(
    deps: Deps,
    view: WorkloadView,
    objs: tuple[Mapping[str, Any], ...],
    kind: JobKind,
    facts: JobFacts,
    spec: CheckpointPolicySpec,
    *,
    hold: bool,
    now: float,
) -> None:
    """Signal every pod of the job (once per eviction), mark the Workload, tell. With
    ``hold`` (the Workload is active: nobody deactivated it on purpose) and pods still
    there, its re-admission is held (``spec.active: false``, :data:`ANN_HELD`) until they
    have gone (:func:`_release_if_due`)."""
    eviction = view.eviction
    assert eviction is not None
    disruption = preemption_disruption(eviction)
    if view.annotations.get(ANN_PREEMPTED) == disruption.request_id:
        return  # handled (the mark is written after the signals; the pod index may lag)
    pods = deps.pod_index(kind).of_job(view.namespace, facts.name)
    signalled = 0
    for pod in pods:
        try:
            signalled += await signal_save_now(deps, pod, disruption)
        except NotFoundError:  # gone meanwhile: nothing to save there
            continue
    blocking = blocking_pods(pods) if hold else []
    mark: dict[str, str | None] = {ANN_PREEMPTED: disruption.request_id}
    if blocking:
        mark[ANN_HELD] = f"{now:.3f}"
    # before the Event: a restarted operator never books it twice
    held = await _patch_workload(
        deps, view, None, mark, spec={"active": False} if blocking else None
    )
    if held and blocking:
        _emit(
            deps,
            objs,
            "Normal",
            "PreemptionHold",
            f"Kueue's re-admission of the Workload waits until its {len(blocking)} evicted "
            "pod(s) have ended (their emergency checkpoint; the training-operator would count "
            "a pod ending after the re-admission as a failure): spec.active is false meanwhile, "
            f"at most their grace plus {HOLD_MARGIN_S:.0f}s",
        )
    if not signalled:
        return
    deps.metrics.preemption_saves.labels(eviction.reason).inc()
    run = await _read_run(deps, facts, spec, view.namespace)
    _emit(deps, objs, "Normal", "PreemptionSave", _save_text(eviction, signalled, run))


async def _release_if_due(
    deps: Deps,
    view: WorkloadView,
    objs: tuple[Mapping[str, Any], ...],
    kind: JobKind,
    facts: JobFacts,
    *,
    ended: bool,
    now: float,
) -> None:
    """Activate a held Workload again once its evicted pods are gone (the refresh looks
    every few seconds; :func:`~ckpt_operator.planners.preemption.hold_release` decides)."""
    pods = deps.pod_index(kind).of_job(view.namespace, facts.name)
    why = hold_release(
        view.annotations.get(ANN_HELD), blocking_pods(pods), now=now, job_ended=ended
    )
    if why is None:
        return
    if await _patch_workload(deps, view, None, {ANN_HELD: None}, spec={"active": True}):
        _emit(
            deps, objs, "Normal", "PreemptionReleased", f"Kueue may admit the Workload again: {why}"
        )


def _save_text(eviction: Eviction, pods: int, run: RunRead) -> str:
    progress = run.progress
    at_risk_text = "steps at risk unknown"
    if progress is not None and progress.newest_step is not None:
        base = progress.valid_step
        # the heartbeat ring is flushed a moment behind: a checkpoint may be newer than it
        newest = max(progress.newest_step, base if base is not None else 0)
        risk = newest - (base if base is not None else 0)
        at_risk_text = (
            f"{risk} steps at risk (step {newest}, newest valid checkpoint "
            f"{'none' if base is None else f'step {base}'})"
        )
    return (
        f"Kueue evicted the Workload ({eviction.reason}): emergency checkpoint requested "
        f"from {pods} pod(s) before SIGTERM; {at_risk_text}"
    )


async def _resumed(
    deps: Deps,
    view: WorkloadView,
    objs: tuple[Mapping[str, Any], ...],
    facts: JobFacts,
    spec: CheckpointPolicySpec,
    version: object,
) -> RunRead:
    """Admitted again after an eviction: the steps it cost, then the mark goes."""
    run = await _read_run(deps, facts, spec, view.namespace)
    progress = run.progress
    lost = lost_steps(view.annotations, progress) if progress is not None else None
    if not await _patch_workload(deps, view, version, {ANN_PREEMPTED: None}):
        return run  # looked at again with the next event
    if lost is None or progress is None:
        log.info("run %s re-admitted; steps lost unknown (%s)", facts.run_id, run.blind)
        return run
    deps.metrics.preemption_lost_steps.observe(lost)
    _emit(
        deps,
        objs,
        "Normal",
        "PreemptionResumed",
        f"Workload admitted again after its eviction: {lost} step(s) lost (trained to step "
        f"{progress.newest_step}, resumes from "
        f"{'step 0' if progress.saved_step is None else f'checkpoint step {progress.saved_step}'})",
    )
    return run
