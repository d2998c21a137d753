"""Failed jobs: bookkeeping on every event, then plan → Events → recreate, once per failure."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, assert_never

from ckpt_operator.adapters.kube import ApiError, ConflictError
from ckpt_operator.behaviours.deps import (
    Deps,
    Obj,
    annotate_job,
    cached_policy,
    kind_kw,
    set_job_status,
)
from ckpt_operator.behaviours.guard import storage_call
from ckpt_operator.behaviours.restart_steps import (
    PlanInputs,
    gather_plan_inputs,
    give_up,
    job_pods,
    job_ref,
    load_policy_spec,
    report_plan,
    report_rebuild,
    run_checkpoints,
    take_reports,
)
from ckpt_operator.kinds.registry import kind_of, owner_of
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.model.jobs import (
    JobFacts,
    JobStatusAnnotation,
    condition,
    format_time,
    job_facts,
    parse_time,
)
from ckpt_operator.planners.agent_presence import AGENT_MISSING
from ckpt_operator.planners.attempt_plan import planning_view
from ckpt_operator.planners.fenced import FencedPod, fenced_message, fenced_pods
from ckpt_operator.planners.manual import (
    RecoverRequest,
    blocked_reason,
    pending_request,
    plan_manual,
)
from ckpt_operator.planners.pools import node_names
from ckpt_operator.planners.reports import (
    pod_reports,
)
from ckpt_operator.planners.restart import (
    GiveUp,
    Restart,
    RestartOutcome,
    Skip,
    Wait,
    plan_restart,
    precheck_restart,
    run_mtbf,
)
from ckpt_operator.planners.validation import annotation_errors

__all__ = ["observe_job", "post_fenced", "recover_job", "report_fenced_pod"]

log = logging.getLogger(__name__)


async def observe_job(deps: Deps, job: Mapping[str, Any]) -> bool:
    """Bookkeeping on every event of an opted-in job; True when it needs recovery.

    Records the run id, reports a missing policy (Event + status annotation),
    marks the job as watched, and labels its pod templates (``ckpt.dev/inject``) when the
    ``label-job`` webhook did not (created while the operator was down).
    """
    facts = job_facts(job)
    if not facts.opted_in or facts.deleting:
        return False
    assert facts.policy is not None
    patch: dict[str, str | None] = {}
    if not facts.annotations.get(c.ANN_RUN_ID):
        patch[c.ANN_RUN_ID] = facts.run_id
    finished = facts.succeeded or facts.handled
    if facts.succeeded:
        _pool_success(deps, job)
    if not finished and (
        facts.status is None or facts.status.state in ("Watching", "PolicyMissing")
    ):
        policy = await cached_policy(deps, facts.namespace, facts.policy)
        state = facts.status.state if facts.status else None
        if policy is None and state != "PolicyMissing":
            message = (
                f"CheckpointPolicy {facts.policy!r} not found in namespace {facts.namespace}: "
                "pods are not injected and the job is not auto-resumed until it exists"
            )
            deps.events.emit(job, "Warning", "PolicyNotFound", message)
            patch[c.ANN_STATUS] = JobStatusAnnotation(
                "PolicyMissing", "PolicyNotFound", message, format_time(deps.clock())
            ).to_json()
        elif policy is not None and state is None:
            patch[c.ANN_STATUS] = JobStatusAnnotation(
                "Watching", "PolicyFound", f"using policy {facts.policy}", format_time(deps.clock())
            ).to_json()
    kind = kind_of(job)
    labels = None if facts.failed or facts.succeeded else kind.label_patch(job)
    if labels is not None:  # one write for both
        body = {**labels, "metadata": {"annotations": patch}} if patch else labels
        await deps.api.patch_job(facts.namespace, facts.name, body, **kind_kw(kind))
    elif patch:
        await annotate_job(deps, job, patch)
    return facts.needs_recovery or pending_request(facts) is not None


async def recover_job(deps: Deps, job: Mapping[str, Any]) -> float | None:
    """Handle a failed job once; returns seconds after which to call again, or None when done."""
    facts = job_facts(job)
    request = pending_request(facts)
    if request is not None:  # a person's request wins, even after GaveUp
        return await _recover_manually(deps, job, request)
    if not facts.needs_recovery:
        return None
    invalid = annotation_errors(facts.annotations)
    if invalid:  # admitted before the webhook checked them: nothing to restart from, ever
        await give_up(deps, job, "InvalidAnnotation", "; ".join(invalid))
        return None
    spec = await load_policy_spec(deps, job)
    if spec is None:
        return deps.config.recovery.policy_missing_retry_s
    listed = None  # the job's pods, listed once per call (the fenced check and the plan)
    if not facts.handled and facts.failed and not facts.restarted_as:
        listed = await job_pods(deps, job)
        fenced = fenced_pods(listed)
        if fenced:  # not a crash: a newer writer holds the run and is already running
            await _fenced_job(deps, job, fenced, listed)
            return None
    if facts.status is None or facts.status.state not in ("BackingOff", "Restarting"):
        deps.events.emit(
            job,
            "Warning",
            "JobFailed",
            f"{facts.failure_message or 'the job failed'}; planning recovery of run "
            f"{facts.run_id} (restart {facts.restart_count + 1} of at most "
            f"{spec.recovery.max_restarts})",
        )
    now = deps.clock()
    outcome = precheck_restart(job, spec.recovery, now)
    # the pods' reports ride on the restart's intent write (one PATCH), else written alone
    pending_reports: dict[str, str | None] = {}
    if outcome is None:
        pods = listed if listed is not None else await job_pods(deps, job)
        inputs = await gather_plan_inputs(deps, job, pods, spec, now, pending_reports)
        if not isinstance(inputs, PlanInputs):
            return inputs
        job = inputs.job
        outcome = await storage_call(
            deps,
            plan_restart,
            planning_view(job),  # a TrainJob: counted from its last JobSet restart attempt
            inputs.request(spec, now),
            timeout_s=deps.config.verify_timeout_s,
        )
        fresh = isinstance(outcome, Restart) and outcome.decision.action == "fresh"
        if fresh and not pod_reports(pods)[0]:  # the agent reports in at start()
            message = f"no pod of {facts.name} reported in: {AGENT_MISSING}"
            deps.events.emit(job, "Warning", "AgentMissing", message)

    if pending_reports and not isinstance(outcome, Restart):
        await annotate_job(deps, job, pending_reports)
    return await _act_on(deps, job, facts, outcome, pending_reports)


async def _act_on(
    deps: Deps,
    job: Mapping[str, Any],
    facts: JobFacts,
    outcome: RestartOutcome,
    pending_reports: Mapping[str, str | None],
) -> float | None:
    """Carry out a restart plan's outcome; mypy proves every outcome handled."""
    match outcome:
        case Skip():
            return None
        case Wait(seconds=seconds, reason=reason):
            if facts.status is None or facts.status.state != "BackingOff":
                message = (
                    f"job failed ({facts.failure_message or 'Failed condition'}); "
                    f"restarting in {seconds:.0f}s ({reason})"
                )
                deps.events.emit(job, "Normal", "BackingOff", message)
                await set_job_status(deps, job, "BackingOff", "Backoff", message)
            return seconds
        case GiveUp():
            deps.events.emit(job, "Warning", "GaveUp", f"{outcome.reason}: {outcome.message}")
            extra: dict[str, str | None] = {}
            if outcome.poisoned:
                extra[c.ANN_POISONED] = ",".join(outcome.poisoned)
            await set_job_status(deps, job, "GaveUp", outcome.reason, outcome.message, extra)
            if outcome.reason != "AutoResumeDisabled":
                deps.metrics.recoveries.labels("failure", outcome.reason).inc()
            return None
        case Restart():
            await _restart(deps, job, outcome, pending_reports)
            return None
        case _:
            assert_never(outcome)


async def _recover_manually(
    deps: Deps, job: Mapping[str, Any], request: RecoverRequest
) -> float | None:
    """A person's ``ckpt.dev/recover-step`` (:mod:`ckpt_operator.planners.manual`): restart exactly
    there, or (dry run) report the plan; handled once, audited by Events."""
    facts = job_facts(job)
    handled: dict[str, str | None] = {c.ANN_RECOVER_HANDLED: request.key()}
    asked = f"manual recovery ({request.describe()})"
    refusal = blocked_reason(facts, request)
    spec = None if refusal is not None else await load_policy_spec(deps, job)
    if refusal is None and spec is None:
        return deps.config.recovery.policy_missing_retry_s
    outcome: Restart | GiveUp | None = None
    if spec is not None:
        pods = await job_pods(deps, job)
        job, known = await take_reports(deps, job, pods)
        found = await run_checkpoints(deps, job, spec, known)
        if found is None:
            return None
        source, records = found
        pool = deps.pools.evidence(facts.run_id, node_names(pods))
        mtbf = run_mtbf(facts, spec.scheduler.risk.mtbf_seconds, deps.clock(), pool)
        outcome = await storage_call(
            deps,
            plan_manual,
            *(job, request, records, spec.recovery),
            functools.partial(source.verify, facts.run_id),
            mtbf,
            timeout_s=deps.config.verify_timeout_s,
        )
        refusal = outcome.message if isinstance(outcome, GiveUp) else None
    if refusal is not None or not isinstance(outcome, Restart):
        deps.events.emit(job, "Warning", "RecoverRefused", f"{asked} refused: {refusal}")
        await annotate_job(deps, job, handled)
        return None
    d = outcome.decision
    plan = f"restart as {d.name} from {d.resume_from} (step {d.resume_step})" + (
        f" with the weights of {d.weights_from}" if d.weights_from else ""
    )
    if request.dry_run:
        deps.events.emit(job, "Normal", "RecoverPlanned", f"{asked}: would {plan}; nothing done")
        handled[c.ANN_RECOVER_PLAN] = d.to_json()
        await annotate_job(deps, job, handled)
        return None
    deps.events.emit(job, "Normal", "ManualRecover", f"{asked}: {plan}")
    await _restart(deps, job, outcome)
    await annotate_job(deps, job, handled)
    return None


def _post_fenced(
    deps: Deps, job: Mapping[str, Any] | None, pod: Mapping[str, Any] | None, found: FencedPod
) -> str:
    """The ``WriterFenced`` Event on the job (and the pod), once per pod."""
    name = meta_of(job).name if job is not None else "its job"
    message = fenced_message(str(name), found)
    uid = str(meta_of(pod).uid or "") if pod is not None else ""
    if uid and deps.fenced_pods.reported(uid):
        return message
    if uid:
        deps.fenced_pods.mark(uid)
    if pod is not None:
        deps.events.emit(pod, "Warning", "WriterFenced", message)
    if job is not None:
        deps.events.emit(job, "Warning", "WriterFenced", message)
    return message


def post_fenced(
    deps: Deps, job: Mapping[str, Any], fenced: Sequence[FencedPod], pods: Sequence[Obj]
) -> list[str]:
    """The ``WriterFenced`` Events of ``fenced`` (found among ``pods``) on each pod and on
    ``job``, once per pod; their messages."""
    by_name = {str(meta_of(p).name): p for p in pods}
    return [_post_fenced(deps, job, by_name.get(f.pod), f) for f in fenced]


async def _fenced_job(
    deps: Deps, job: Mapping[str, Any], fenced: list[FencedPod], pods: list[Obj]
) -> None:
    """A job that failed because its writer was fenced: Events naming the holder, no
    restart (the holder is already running), the status says why."""
    messages = post_fenced(deps, job, fenced, pods)
    await set_job_status(deps, job, "GaveUp", "WriterFenced", messages[0])


async def report_fenced_pod(deps: Deps, pod: Mapping[str, Any]) -> bool:
    """A training pod whose container stopped fenced (a zombie of a job already restarted,
    or of a second job on the same run id): the ``WriterFenced`` Event on it and its job,
    once per pod. True when posted now."""
    uid = str(meta_of(pod).uid or "")
    if not uid or deps.fenced_pods.reported(uid):
        return False
    found = fenced_pods([pod])
    if not found:
        return False
    owner = owner_of(pod)
    namespace = str(meta_of(pod).namespace or "")
    job = deps.job_cache(owner[0]).get(namespace, owner[1]) if owner is not None else None
    _post_fenced(deps, job, pod, found[0])
    return True


def _pool_success(deps: Deps, job: Mapping[str, Any]) -> None:
    """Book a succeeded job's running time on its nodes' pools (runs that never fail count:
    without them a pool's MTBF would be too short)."""
    facts = job_facts(planning_view(job))
    done = condition(job, "Succeeded") or condition(job, "Complete") or {}
    ended = parse_time(done.get("lastTransitionTime"))
    if facts.created_at is not None and ended is not None:
        pods = deps.pod_index(kind_of(job)).of_job(facts.namespace, facts.name)
        key = f"{facts.uid}@{facts.created_at:.3f}"
        seconds = ended - facts.created_at
        deps.pools.record(key, facts.run_id, node_names(pods), seconds, failed=False)


async def _restart(
    deps: Deps,
    job: Mapping[str, Any],
    outcome: Restart,
    extra: Mapping[str, str | None] | None = None,
) -> None:
    """Record the decision (with ``extra`` annotations, in the same write), create the
    restart, record the outcome."""
    facts = job_facts(job)
    decision = outcome.decision
    if not outcome.replay:
        report_plan(deps, job, outcome.crash_loop, outcome.ladder)
        # Intent first: a crash after this line replays exactly this decision.
        await set_job_status(
            deps,
            job,
            "Restarting",
            "RestartPlanned",
            f"restarting as {decision.name} ({decision.action} "
            f"{decision.resume_from or 'from the beginning'})",
            {
                **(extra or {}),
                c.ANN_RESTARTED_AS: decision.name,
                c.ANN_RESTART_DECISION: decision.to_json(),
            },
        )
    elif extra:  # a replay writes no intent: the reports go alone
        await annotate_job(deps, job, dict(extra))
    # born watched (run id copied, status set): its first event needs no bookkeeping write
    now = format_time(deps.clock(), precise=True)
    watching = JobStatusAnnotation("Watching", "PolicyFound", f"using policy {facts.policy}", now)
    body = {**outcome.job, "metadata": dict(meta_of(outcome.job))}
    body["metadata"]["annotations"] = {
        **meta_of(outcome.job).annotations,
        c.ANN_STATUS: watching.to_json(),
    }
    kind = kind_of(job)
    try:
        await deps.api.create_job(facts.namespace, body, **kind_kw(kind))
    except ConflictError:
        existing = await deps.api.get_job(facts.namespace, decision.name, **kind_kw(kind))
        of = meta_of(existing).annotations.get(c.ANN_RESTART_OF)
        if existing is not None and of != facts.name:
            message = (
                f"a {kind.kind} named {decision.name} exists and is not a restart of {facts.name}"
            )
            await give_up(deps, job, "NameTaken", message)
            return None
        log.info("restart %s of %s already exists (409): done", decision.name, job_ref(job))
    except ApiError as e:
        deps.metrics.recoveries.labels("failure", "CreateFailed").inc()
        deps.events.emit(job, "Warning", "RestartFailed", f"creating {decision.name} failed: {e}")
        raise
    if decision.resume_from:
        what = f"from step {decision.resume_step} ({decision.resume_from}, {decision.action})"
    else:
        what = "fresh, from step 0 (no checkpoint of the run)"
    message = f"restarted as {decision.name} {what}; restart {decision.restart_count}"
    deps.events.emit(job, "Normal", "Restarted", message)
    report_rebuild(deps, job, decision)
    await set_job_status(deps, job, "Restarted", "RestartCreated", message)
    deps.metrics.restarts.labels(decision.action).inc()
    deps.metrics.recoveries.labels("success", "Restarted").inc()
    if facts.failed_at is not None:
        deps.metrics.failure_to_restart.observe(max(0.0, deps.clock() - facts.failed_at))
    return None
