"""TrainJobs: each JobSet restart attempt planned on the restart protocol, once.

The pure side is :mod:`ckpt_operator.planners.attempt_plan`; this module reads what it needs (the
JobSet's restart attempt, the pods' reports, the run's checkpoints), writes the decision on
the TrainJob in one PATCH (which lets the attempt's pods through the webhook) and posts the
Events. A TrainJob that JobSet gave up on (``Failed``) goes the PyTorchJob way
(:func:`ckpt_operator.behaviours.recovery.recover_job`: a new TrainJob ``J-r<k>``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, assert_never

from ckpt_agent.text import clean
from ckpt_operator.adapters.kube import ApiError
from ckpt_operator.behaviours.deps import Deps, annotate_job, set_job_status
from ckpt_operator.behaviours.guard import storage_call
from ckpt_operator.behaviours.recovery import observe_job, post_fenced, recover_job
from ckpt_operator.behaviours.restart_steps import (
    PlanInputs,
    gather_plan_inputs,
    give_up,
    job_pods,
    load_policy_spec,
    report_plan,
    report_rebuild,
)
from ckpt_operator.kinds.trainjob import (
    TRAINJOB,
    has_inject_patch,
    jobset_restarts,
    jobset_trainjob,
    planned_attempt,
    pod_attempt,
    restart_expected_until,
)
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import job_facts
from ckpt_operator.planners.attempt_plan import AttemptPlan, plan_attempt, precheck_attempt
from ckpt_operator.planners.fenced import fenced_pods
from ckpt_operator.planners.manual import pending_request
from ckpt_operator.planners.restart import GiveUp, Skip

__all__ = [
    "attempt_due",
    "observe_trainjob",
    "plan_jobset_attempt",
    "recover_trainjob",
    "restart_expected",
]

log = logging.getLogger(__name__)

#: After a decision, look once more (seconds): an event that arrived while the attempt was
#: planned (the next attempt, JobSet giving up) found the TrainJob's task busy.
RECHECK_S = 1.0
#: How often the JobSet is read while its restart is expected but not seen.
PROBE_INTERVAL_S = 1.0


def _plans_attempts(trainjob: Mapping[str, Any]) -> bool:
    facts = job_facts(trainjob)
    return facts.opted_in and facts.auto_resume and not (facts.deleting or facts.failed)


def attempt_due(deps: Deps, trainjob: Mapping[str, Any]) -> int | None:
    """The JobSet restart attempt waiting for a plan (from the JobSet cache, or the attempt
    of a pod the webhook refused, :attr:`Deps.attempts_seen`), else None."""
    facts = job_facts(trainjob)
    if not _plans_attempts(trainjob):
        return None
    jobset = deps.jobsets.get(facts.namespace, facts.name)
    attempt = max(
        jobset_restarts(jobset) if jobset is not None else 0,
        deps.attempts_seen.newest(facts.namespace, facts.name),
    )
    return attempt if attempt > planned_attempt(facts.annotations) else None


async def observe_trainjob(deps: Deps, trainjob: Mapping[str, Any]) -> bool:
    """Bookkeeping of an opted-in TrainJob; True when it needs the recovery scheduler
    (JobSet gave up, a manual request, or a restart attempt to plan).

    A TrainJob first seen without the operator's runtime patch (created while the
    ``label-trainjob`` webhook was bypassed) gets a ``NotInjected`` Warning, once: its pods
    never reach the injection webhook, and Trainer keeps a started TrainJob's patches.
    """
    facts = job_facts(trainjob)
    if facts.opted_in and facts.status is None and not has_inject_patch(trainjob):
        deps.events.emit(
            trainjob,
            "Warning",
            "NotInjected",
            f"TrainJob {facts.name} was admitted without the ckpt-operator's runtime patch "
            "(the label-trainjob webhook was bypassed): its pods run WITHOUT the checkpoint "
            "agent and a restart starts from step 0; delete and recreate it while the "
            "operator runs, and keep webhook.labelJobs.failurePolicy at Fail",
        )
    due = await observe_job(deps, trainjob)
    return due or attempt_due(deps, trainjob) is not None


def restart_expected(deps: Deps, trainjob: Mapping[str, Any]) -> bool:
    """A pod of the planned attempt failed or is terminating, recently enough that a JobSet
    restart is to be expected (:func:`ckpt_operator.kinds.trainjob.restart_expected_until`)."""
    facts = job_facts(trainjob)
    if not _plans_attempts(trainjob):
        return False
    pods = deps.trainjob_pods.of_job(facts.namespace, facts.name)
    until = restart_expected_until(pods, planned_attempt(facts.annotations))
    return until is not None and deps.clock() < until


async def _read_jobset(deps: Deps, trainjob: Mapping[str, Any]) -> int | None:
    """:func:`attempt_due` after reading the TrainJob's JobSet from the API: the JobSet watch
    may be silent (kopf serves a resource only once it has discovered its CRD)."""
    facts = job_facts(trainjob)
    jobset = await deps.api.get_custom(
        c.JOBSET_GROUP, c.JOBSET_VERSION, c.JOBSET_PLURAL, facts.namespace, facts.name
    )
    if jobset is not None and jobset_trainjob(jobset) == facts.name:
        deps.jobsets.upsert(jobset)
    return attempt_due(deps, trainjob)


async def recover_trainjob(deps: Deps, trainjob: Mapping[str, Any]) -> float | None:
    """The recovery scheduler's step for a TrainJob (seconds to the next, None: done).

    While a restart is expected and the JobSet cache shows none, the JobSet is read every
    :data:`PROBE_INTERVAL_S`."""
    facts = job_facts(trainjob)
    if facts.needs_recovery or pending_request(facts) is not None:
        return await recover_job(deps, trainjob)
    attempt = attempt_due(deps, trainjob)
    if attempt is None and restart_expected(deps, trainjob):
        attempt = await _read_jobset(deps, trainjob)
        if attempt is None:
            return PROBE_INTERVAL_S
    if attempt is None:
        return None
    return await plan_jobset_attempt(deps, trainjob, attempt)


async def plan_jobset_attempt(
    deps: Deps, trainjob: Mapping[str, Any], attempt: int
) -> float | None:
    """Plan JobSet restart attempt ``attempt`` (see :mod:`ckpt_operator.planners.attempt_plan`);
    seconds until the scheduler looks again (None: done)."""
    spec = await load_policy_spec(deps, trainjob)
    if spec is None:
        return deps.config.recovery.policy_missing_retry_s
    now = deps.clock()
    outcome = precheck_attempt(trainjob, attempt, spec.recovery, now)
    pending: dict[str, str | None] = {}
    if outcome is None:
        # the previous attempts' pods: their reports, and those still terminating (JobSet
        # deletes them as it restarts) may be writing their emergency checkpoint
        older = [p for p in await job_pods(deps, trainjob) if pod_attempt(p) < attempt]
        fenced = fenced_pods(older)
        if fenced:  # not a crash: a newer writer holds the run. JobSet's new pods (new uids)
            # would claim it back from that writer: the TrainJob stops here instead.
            messages = post_fenced(deps, trainjob, fenced, older)
            outcome = GiveUp("WriterFenced", messages[0])
            await _give_up_attempt(deps, trainjob, attempt, outcome, pending)
            return RECHECK_S
        inputs = await gather_plan_inputs(deps, trainjob, older, spec, now, pending)
        if not isinstance(inputs, PlanInputs):
            return inputs
        trainjob = inputs.job
        outcome = await storage_call(
            deps,
            plan_attempt,
            *(trainjob, attempt, inputs.request(spec, now)),
            timeout_s=deps.config.verify_timeout_s,
        )
    match outcome:
        case Skip():
            if pending:
                await annotate_job(deps, trainjob, pending)
            return None
        case GiveUp():
            await _give_up_attempt(deps, trainjob, attempt, outcome, pending)
            return RECHECK_S
        case AttemptPlan():
            await _admit_attempt(deps, trainjob, outcome, pending)
            return RECHECK_S
        case _:
            assert_never(outcome)


async def _admit_attempt(
    deps: Deps, trainjob: Mapping[str, Any], plan: AttemptPlan, pending: Mapping[str, str | None]
) -> None:
    """Write the attempt's decision (one PATCH: the webhook then lets its pods in)."""
    d = plan.decision
    report_plan(deps, trainjob, plan.crash_loop, plan.ladder)
    if d.resume_from:
        what = f"resumes from step {d.resume_step} ({d.resume_from}, {d.action})"
    else:
        what = "starts fresh, from step 0 (no checkpoint of the run)"
    message = f"JobSet restart attempt {plan.attempt} {what}; restart {d.restart_count}"
    await set_job_status(
        deps, trainjob, "Watching", "RestartAttempt", message, {**pending, **plan.annotations}
    )
    deps.events.emit(trainjob, "Normal", "Restarted", message)
    report_rebuild(deps, trainjob, d)
    deps.metrics.restarts.labels(d.action).inc()
    deps.metrics.recoveries.labels("success", "Restarted").inc()


async def _give_up_attempt(
    deps: Deps,
    trainjob: Mapping[str, Any],
    attempt: int,
    outcome: GiveUp,
    pending: Mapping[str, str | None],
) -> None:
    """Terminal for the run: ``GaveUp`` and the TrainJob suspended (its pods end). A policy
    without auto-resume only lets the attempt through: JobSet restarts it on its own."""
    facts = job_facts(trainjob)
    if outcome.reason == "AutoResumeDisabled":
        await annotate_job(deps, trainjob, {**pending, c.ANN_RESTART_ATTEMPT: str(attempt)})
        return
    extra = {**pending}
    if outcome.poisoned:
        extra[c.ANN_POISONED] = ",".join(outcome.poisoned)
    message = f"{outcome.message} (JobSet restart attempt {attempt}); TrainJob suspended"
    await give_up(deps, trainjob, outcome.reason, message, extra)
    try:
        await deps.api.patch_job(
            facts.namespace, facts.name, {"spec": {"suspend": True}}, kind=TRAINJOB
        )
    except ApiError as e:  # the verdict stands; the webhook keeps refusing the pods
        log.warning("suspending TrainJob %s/%s failed: %s", facts.namespace, facts.name, clean(e))
