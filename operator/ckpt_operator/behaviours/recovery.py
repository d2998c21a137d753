"""Failed jobs: bookkeeping on every event, then plan → Events → recreate, once per failure."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_agent.decide.mtbf import PoolEvidence
from ckpt_agent.policy import CheckpointPolicySpec, StorageType
from ckpt_agent.records import CheckpointRecord
from ckpt_operator.adapters.kube import ApiError, ConflictError
from ckpt_operator.adapters.sources import (
    CheckpointSource,
    ReportedCheckpointSource,
    StorageAccessDeniedError,
)
from ckpt_operator.behaviours.deps import (
    Deps,
    Obj,
    annotate_job,
    cached_policy,
    kind_kw,
    set_job_status,
)
from ckpt_operator.behaviours.guard import run_refusal, storage_call
from ckpt_operator.kinds.registry import kind_of
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.model.jobs import (
    JobStatusAnnotation,
    condition,
    format_time,
    job_facts,
    parse_time,
)
from ckpt_operator.planners.agent_presence import AGENT_MISSING
from ckpt_operator.planners.attempt_plan import planning_view
from ckpt_operator.planners.manual import (
    RecoverRequest,
    blocked_reason,
    pending_request,
    plan_manual,
)
from ckpt_operator.planners.pools import node_names
from ckpt_operator.planners.reports import (
    KnownCheckpoints,
    known_checkpoints,
    last_verified_json,
    pod_reports,
)
from ckpt_operator.planners.restart import (
    GiveUp,
    LadderStep,
    Restart,
    RestartDecision,
    Skip,
    Wait,
    plan_restart,
    precheck_restart,
    run_mtbf,
    terminating_pods_wait,
)
from ckpt_operator.planners.validation import annotation_errors, parse_policy_spec

__all__ = [
    "give_up",
    "job_pods",
    "load_policy_spec",
    "observe_job",
    "recover_job",
    "report_plan",
    "report_rebuild",
    "run_checkpoints",
    "take_reports",
    "wait_for_terminating_pods",
]

log = logging.getLogger(__name__)


def _job_ref(job: Mapping[str, Any]) -> str:
    meta = meta_of(job)
    return f"{meta.namespace}/{meta.name}"


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


async def load_policy_spec(deps: Deps, job: Mapping[str, Any]) -> CheckpointPolicySpec | None:
    facts = job_facts(job)
    assert facts.policy is not None
    policy = await cached_policy(deps, facts.namespace, facts.policy)
    if policy is None:
        if facts.status is None or facts.status.state != "PolicyMissing":
            message = f"CheckpointPolicy {facts.policy!r} not found: cannot plan the restart"
            deps.events.emit(job, "Warning", "PolicyNotFound", message)
            await set_job_status(deps, job, "PolicyMissing", "PolicyNotFound", message)
        return None
    spec, errors = parse_policy_spec(policy.get("spec"))
    if spec is None:
        deps.events.emit(job, "Warning", "InvalidPolicy", "; ".join(errors))
    return spec


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
        pods = await job_pods(deps, job)
        inputs = await gather_plan_inputs(deps, job, pods, spec, now, pending_reports)
        if not isinstance(inputs, PlanInputs):
            return inputs
        job = inputs.job
        outcome = await storage_call(
            deps,
            plan_restart,
            planning_view(job),  # a TrainJob: counted from its last JobSet restart attempt
            *(spec.recovery, inputs.records, now, inputs.verify, inputs.progress),
            spec.scheduler.risk.mtbf_seconds,
            inputs.pool,
            timeout_s=deps.config.verify_timeout_s,
        )
        fresh = isinstance(outcome, Restart) and outcome.decision.action == "fresh"
        if fresh and not pod_reports(pods)[0]:  # the agent reports in at start()
            message = f"no pod of {facts.name} reported in: {AGENT_MISSING}"
            deps.events.emit(job, "Warning", "AgentMissing", message)

    if pending_reports and not isinstance(outcome, Restart):
        await annotate_job(deps, job, pending_reports)
    if isinstance(outcome, Skip):
        return None
    if isinstance(outcome, Wait):
        if facts.status is None or facts.status.state != "BackingOff":
            message = (
                f"job failed ({facts.failure_message or 'Failed condition'}); "
                f"restarting in {outcome.seconds:.0f}s ({outcome.reason})"
            )
            deps.events.emit(job, "Normal", "BackingOff", message)
            await set_job_status(deps, job, "BackingOff", "Backoff", message)
        return outcome.seconds
    if isinstance(outcome, GiveUp):
        deps.events.emit(job, "Warning", "GaveUp", f"{outcome.reason}: {outcome.message}")
        extra: dict[str, str | None] = {}
        if outcome.poisoned:
            extra[c.ANN_POISONED] = ",".join(outcome.poisoned)
        await set_job_status(deps, job, "GaveUp", outcome.reason, outcome.message, extra)
        if outcome.reason != "AutoResumeDisabled":
            deps.metrics.recoveries.labels("failure", outcome.reason).inc()
        return None
    assert isinstance(outcome, Restart)
    await _restart(deps, job, outcome, pending_reports)
    return None


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


async def run_checkpoints(
    deps: Deps, job: Mapping[str, Any], spec: CheckpointPolicySpec, known: KnownCheckpoints
) -> tuple[CheckpointSource, list[CheckpointRecord]] | None:
    """Where the run's checkpoints are read (its storage, or the pods' reports when the
    storage is not reachable here) and what it lists; None: gave up."""
    facts = job_facts(job)
    reported = ReportedCheckpointSource(known.report.records())
    assert facts.policy is not None
    source: CheckpointSource
    try:
        source = await deps.sources(facts.namespace, facts.policy, spec)
    except StorageAccessDeniedError as e:
        if spec.storage.type != StorageType.LOCAL:
            await give_up(deps, job, "StorageAccessDenied", str(e))
            return None
        # a PVC or node path of the namespace: the pods' reports need no access
        log.info("%s: %s; planning with the pods' reports", _job_ref(job), e)
        source = reported
    if not await storage_call(deps, source.reachable):
        log.info("%s: storage not reachable here; using the pods' reports", _job_ref(job))
        source = reported
    refusal = await run_refusal(deps, source, facts.run_id, facts)
    if refusal is not None:
        await give_up(deps, job, "RunOwnedElsewhere", refusal)
        return None
    records = await storage_call(deps, source.list_checkpoints, facts.run_id)
    if not records and reported.records:  # the storage here is not the pods'
        log.info("%s: storage lists no checkpoint; using the pods' reports", _job_ref(job))
        source, records = reported, reported.list_checkpoints(facts.run_id)
    return source, records


async def give_up(
    deps: Deps,
    job: Mapping[str, Any],
    reason: str,
    message: str,
    extra: Mapping[str, str | None] | None = None,
) -> None:
    """Terminal: a Warning Event, the ``GaveUp`` status (and ``extra``), the failure metric."""
    deps.events.emit(job, "Warning", "GaveUp", f"{reason}: {message}")
    await set_job_status(deps, job, "GaveUp", reason, message, extra)
    deps.metrics.recoveries.labels("failure", reason).inc()


async def job_pods(deps: Deps, job: Mapping[str, Any]) -> list[Obj]:
    """The failed job's pods: from the watch-fed index when it holds them all finished
    (their termination reports are final), else one namespaced LIST."""
    facts = job_facts(job)
    kind = kind_of(job)
    cached = deps.pod_index(kind).of_job(facts.namespace, facts.name)
    if cached and all(_finished(p) for p in cached):
        return cached
    return await deps.api.list_pods(
        node_name=None,
        label_selector=f"{kind.pod_job_label}={facts.name}",
        namespace=facts.namespace,
    )


def _finished(pod: Mapping[str, Any]) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return phase in ("Succeeded", "Failed") and not meta_of(pod).deletion_timestamp


async def take_reports(
    deps: Deps,
    job: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    pending: dict[str, str | None] | None = None,
) -> tuple[Mapping[str, Any], KnownCheckpoints]:
    """Merge the pods' checkpoint reports (termination messages) into the job's
    ``ckpt.dev/checkpoints`` (written — or added to ``pending`` for the caller's next
    write — and set on the returned copy of ``job`` so that the restart carries it) and
    ``ckpt.dev/last-verified-checkpoint``."""
    facts = job_facts(job)
    reports, problems = pod_reports(pods)
    for problem in problems:  # e.g. the application writes its own termination message
        log.info("%s: %s", _job_ref(job), problem)
    known = known_checkpoints(facts.run_id, [facts.annotations.get(c.ANN_CHECKPOINTS)], reports)
    for problem in known.problems:
        log.warning("%s: %s", _job_ref(job), problem)
    if not known.report.checkpoints:
        return job, known
    wanted = {
        c.ANN_CHECKPOINTS: known.annotation,
        c.ANN_LAST_VERIFIED: last_verified_json(known.report),
    }
    patch = {k: v for k, v in wanted.items() if v is not None and facts.annotations.get(k) != v}
    if patch and pending is not None:
        pending.update(patch)
    elif patch:
        await annotate_job(deps, job, patch)
    meta = dict(meta_of(job))
    meta["annotations"] = {**meta_of(job).annotations, c.ANN_CHECKPOINTS: known.annotation}
    return {**job, "metadata": meta}, known


@dataclass(frozen=True)
class PlanInputs:
    """What a restart plan reads: the job (with the pods' reports merged), the run's
    checkpoints, its progress and a verifier of one candidate."""

    job: Mapping[str, Any]
    records: list[CheckpointRecord]
    progress: list[tuple[int, float]]
    verify: Callable[[str], bool]
    pool: PoolEvidence | None = None
    """What other runs showed on the job's node pool (:mod:`ckpt_operator.planners.pools`)."""


def _pool_failure(
    deps: Deps, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], now: float
) -> PoolEvidence | None:
    """Book the failed job's running time and failure on its nodes' pools (once per job or
    TrainJob attempt); return what other runs showed on its pool."""
    facts = job_facts(planning_view(job))
    nodes = node_names(pods)
    if facts.created_at is not None:
        ended = facts.failed_at if facts.failed_at is not None else now
        key = f"{facts.uid}@{facts.created_at:.3f}"
        deps.pools.record(key, facts.run_id, nodes, ended - facts.created_at, failed=True)
    return deps.pools.evidence(facts.run_id, nodes)


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


async def gather_plan_inputs(
    deps: Deps,
    job: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    spec: CheckpointPolicySpec,
    now: float,
    pending: dict[str, str | None],
) -> PlanInputs | float | None:
    """Wait for ``pods`` still terminating (seconds until the next look), take their
    reports (into ``pending``), list the run's checkpoints (None: gave up) — the inputs
    of a PyTorchJob restart and of a JobSet restart attempt alike."""
    waiting = await wait_for_terminating_pods(deps, job, pods, now)
    if waiting is not None:
        return waiting
    pool = _pool_failure(deps, job, pods, now)
    job, known = await take_reports(deps, job, pods, pending)
    found = await run_checkpoints(deps, job, spec, known)
    if found is None:
        return None
    source, records = found
    run_id = job_facts(job).run_id
    progress = await storage_call(deps, source.progress, run_id)
    return PlanInputs(job, records, progress, functools.partial(source.verify, run_id), pool)


async def wait_for_terminating_pods(
    deps: Deps, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], now: float
) -> float | None:
    """Seconds until the next look while the failed job's pods are still terminating.

    They may be writing an emergency checkpoint (see
    :func:`ckpt_operator.planners.restart.terminating_pods_wait`); planning waits for them.
    """
    facts = job_facts(job)
    wait = terminating_pods_wait(pods, now)
    if wait is None:
        return None
    recheck, longest, names = wait
    if facts.status is None or facts.status.reason != "PodsTerminating":
        message = (
            f"waiting up to {longest:.0f}s for pod(s) {', '.join(names)} to finish "
            "terminating: they may still be writing an emergency checkpoint"
        )
        deps.events.emit(job, "Normal", "BackingOff", message)
        await set_job_status(deps, job, "BackingOff", "PodsTerminating", message)
    return recheck


def report_plan(
    deps: Deps, job: Mapping[str, Any], crash_loop: str | None, ladder: Sequence[LadderStep]
) -> None:
    """Events (and metrics) of a plan: the poisoned checkpoint, each rung looked at."""
    if crash_loop:
        deps.metrics.poisoned.inc()
        deps.metrics.recoveries.labels("failure", "CrashLoop").inc()
        deps.events.emit(
            job,
            "Warning",
            "CrashLoop",
            f"the run failed before advancing past {crash_loop} "
            f"(step {job_facts(job).resume_step}); checkpoint poisoned, the ladder walks "
            "further back",
        )
    for rung in ladder:
        if rung.accepted:
            deps.events.emit(
                job,
                "Normal",
                "LadderStep",
                f"rung {rung.rung}: {rung.action} {rung.checkpoint_id} (step {rung.step}) "
                f"accepted: {rung.why}",
            )
        else:
            deps.events.emit(
                job,
                "Warning",
                "CheckpointRejected",
                f"rung {rung.rung}: {rung.checkpoint_id} (step {rung.step}) rejected: {rung.why}",
            )


def report_rebuild(deps: Deps, job: Mapping[str, Any], decision: RestartDecision) -> None:
    """The ``HeartbeatRebuild`` Warning of a decision that continues from a heartbeat."""
    if decision.action != "rebuild_from_heartbeat":
        return
    deps.events.emit(
        job,
        "Warning",
        "HeartbeatRebuild",
        f"{decision.name} continues from the heartbeat at step {decision.resume_step} "
        f"with the weights of {decision.weights_from or 'the in-memory snapshot'}: "
        "the step, data position and RNG are the heartbeat's, the continuation is "
        "not exact",
    )


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
        log.info("restart %s of %s already exists (409): done", decision.name, _job_ref(job))
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
