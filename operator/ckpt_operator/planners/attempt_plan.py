"""JobSet restart attempts of a TrainJob, planned on the restart protocol (pure).

A PyTorchJob that fails is replaced by a new job ``J-r<k>`` (:mod:`ckpt_operator.planners.restart`).
A TrainJob's JobSet restarts by itself (its ``failurePolicy``): it recreates every pod,
labelled with the next ``jobset.sigs.k8s.io/restart-attempt``. The operator maps each
attempt onto the same protocol, on the same object:

* **gate** — a pod of attempt ``m`` newer than the attempt the operator planned
  (``ckpt.dev/restart-attempt`` on the TrainJob) is refused by the pod webhook
  (:func:`attempt_refusal`); the Job controller retries it. No pod of an attempt runs
  before the attempt's decision is on the TrainJob.
* **plan** — when the JobSet reports attempt ``m`` the planner sees the TrainJob as a job
  that just failed (:func:`attempt_view`: created when the previous attempt was planned,
  ``Failed`` now) and runs :func:`ckpt_operator.planners.restart.plan_restart` on it without backoff
  (JobSet restarts at once): budget (``restart-count`` counts attempts and restarts of the
  chain alike), crash loop (the previous attempt never advanced past its resume step:
  poisoned), the ladder with verification.
* **decide** — one PATCH of the TrainJob (:func:`attempt_annotations`): the attempt number,
  its start, ``restart-count``, ``resume-from``/``resume-step``/``poisoned``. The webhook
  injects them into the attempt's pods (``CKPT_RESUME_FROM``: the pod-side ladder and its
  lineage rule then apply exactly as for a restarted PyTorchJob) and lets them in.
  Exactly once: the PATCH is the only effect and the attempt number makes a second plan a
  :class:`~ckpt_operator.planners.restart.Skip`; an operator killed before it re-plans (no pod of
  the attempt ran).
* **give up** — budget spent, ladder exhausted, checkpoints gone: ``GaveUp`` (Event and
  status) and the TrainJob is suspended, which ends the JobSet's pods.

When JobSet itself gives up (its ``maxRestarts`` spent) the TrainJob is ``Failed`` and the
PyTorchJob path applies: a new TrainJob ``J-r<k>`` with the resume point, if the budget
allows (:func:`planning_view` gives its planner the last attempt's start).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.policy import RecoverySpec
from ckpt_operator.kinds.trainjob import TRAINJOB, planned_attempt, pod_attempt
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.model.jobs import JobFacts, format_time, job_facts, parse_time
from ckpt_operator.planners.restart import (
    GiveUp,
    LadderStep,
    PlanRequest,
    Restart,
    RestartDecision,
    Skip,
    plan_restart,
    precheck_restart,
)
from ckpt_operator.planners.runfacts import run_started_at

__all__ = [
    "AttemptOutcome",
    "AttemptPlan",
    "attempt_annotations",
    "attempt_refusal",
    "attempt_view",
    "plan_attempt",
    "planning_view",
    "precheck_attempt",
]

#: What the planner of an attempt must not see (it would replay or skip the attempt).
_VIEW_DROPS = (c.ANN_STATUS, c.ANN_RESTARTED_AS, c.ANN_RESTART_DECISION)


@dataclass(frozen=True)
class AttemptPlan:
    """Attempt ``attempt`` resumes as ``decision`` says; ``annotations`` go on the TrainJob."""

    attempt: int
    decision: RestartDecision
    annotations: Mapping[str, str | None]
    ladder: tuple[LadderStep, ...] = ()
    crash_loop: str | None = None
    skipped: Mapping[str, str] = field(default_factory=dict)


AttemptOutcome = Skip | GiveUp | AttemptPlan


def attempt_refusal(facts: JobFacts, pod: Mapping[str, Any]) -> str | None:
    """Why the pod webhook refuses ``pod`` of ``facts``' TrainJob now (None: admit it).

    Only pods of an attempt newer than the planned one, of a TrainJob that auto-resumes.
    """
    attempt = pod_attempt(pod)
    planned = planned_attempt(facts.annotations)
    if attempt <= planned or not facts.auto_resume:
        return None
    if facts.status is not None and facts.status.state == "GaveUp":
        return (
            f"the ckpt-operator gave up on run {facts.run_id} ({facts.status.reason}); pods "
            f"of JobSet restart attempt {attempt} are refused: see the TrainJob's GaveUp "
            "Event, then recover it by hand (ckpt recover) or delete it"
        )
    return (
        f"JobSet restart attempt {attempt} of TrainJob {facts.name} is not planned yet "
        f"(planned: {planned}): the ckpt-operator first picks the checkpoint it resumes "
        "from, then admits its pods; the Job controller retries this pod"
    )


def planning_view(job: Mapping[str, Any]) -> Mapping[str, Any]:
    """The job as the restart planner sees it: a TrainJob that went through JobSet restart
    attempts is "created" when its last attempt was planned (crash-loop detection counts
    progress from there); any other job as it is."""
    if not TRAINJOB.matches(job):
        return job
    meta = meta_of(job)
    ann = meta.annotations
    started = parse_time(ann.get(c.ANN_ATTEMPT_STARTED_AT))
    if planned_attempt(ann) <= 0 or started is None:
        return job
    view = dict(job)
    view["metadata"] = {**meta, "creationTimestamp": format_time(started, precise=True)}
    return view


def attempt_view(trainjob: Mapping[str, Any], now: float) -> dict[str, Any]:
    """The TrainJob as if it had just failed: its previous attempt ended ``now``."""
    view = copy.deepcopy(dict(planning_view(trainjob)))
    meta = view.setdefault("metadata", {})
    meta["annotations"] = {
        k: v for k, v in (meta.get("annotations") or {}).items() if k not in _VIEW_DROPS
    }
    when = format_time(now, precise=True)
    view["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "lastTransitionTime": when}]
    }
    return view


def _no_backoff(spec: RecoverySpec) -> RecoverySpec:
    return spec.model_copy(update={"backoff_seconds": 0})


def precheck_attempt(
    trainjob: Mapping[str, Any], attempt: int, spec: RecoverySpec, now: float
) -> AttemptOutcome | None:
    """The outcome when it needs no storage (skip, give up); None: walk the ladder."""
    facts = job_facts(trainjob)
    if attempt <= planned_attempt(facts.annotations):
        return Skip(f"restart attempt {attempt} is planned already")
    if facts.failed or facts.succeeded:
        return Skip("the TrainJob finished: its JobSet restarts no more")
    if facts.status is not None and facts.status.state == "GaveUp":
        return Skip(f"already handled ({facts.status.state})")
    early = precheck_restart(attempt_view(trainjob, now), _no_backoff(spec), now)
    if early is None or isinstance(early, Skip | GiveUp):
        return early
    return Skip(f"unexpected precheck outcome {type(early).__name__}")  # pragma: no cover


def attempt_annotations(
    trainjob: Mapping[str, Any], attempt: int, decision: RestartDecision, now: float
) -> dict[str, str | None]:
    """What the TrainJob records for the attempt (None: remove the annotation)."""
    facts = job_facts(trainjob)
    started = run_started_at(facts)

    def opt(value: object) -> str | None:
        return None if value is None or value == "" else str(value)

    return {
        c.ANN_RUN_ID: facts.run_id,
        c.ANN_RESTART_ATTEMPT: str(attempt),
        c.ANN_ATTEMPT_STARTED_AT: format_time(now, precise=True),
        c.ANN_RESTART_COUNT: str(decision.restart_count),
        c.ANN_RESUME_FROM: opt(decision.resume_from),
        c.ANN_RESUME_STEP: opt(decision.resume_step),
        c.ANN_RESUME_WEIGHTS: opt(decision.weights_from),
        c.ANN_RESUME_PIN: None,
        c.ANN_POISONED: opt(",".join(decision.poisoned)),
        c.ANN_RUN_STARTED_AT: f"{started:.0f}" if started is not None else None,
        c.ANN_MTBF_SECONDS: (
            f"{decision.mtbf_seconds:.6g}" if decision.mtbf_seconds is not None else None
        ),
    }


def plan_attempt(trainjob: Mapping[str, Any], attempt: int, request: PlanRequest) -> AttemptOutcome:
    """Plan JobSet restart attempt ``attempt`` of ``trainjob`` (see the module docstring)."""
    now = request.now
    early = precheck_attempt(trainjob, attempt, request.spec, now)
    if early is not None:
        return early
    view = attempt_view(trainjob, now)
    outcome = plan_restart(view, dataclasses.replace(request, spec=_no_backoff(request.spec)))
    if not isinstance(outcome, Restart):
        return outcome if isinstance(outcome, Skip | GiveUp) else Skip("nothing to plan")
    return AttemptPlan(
        attempt=attempt,
        decision=outcome.decision,
        annotations=attempt_annotations(trainjob, attempt, outcome.decision, now),
        ladder=outcome.ladder,
        crash_loop=outcome.crash_loop,
        skipped=outcome.skipped,
    )
