"""Failed jobs: bookkeeping on every event, then plan → Events → recreate, once per failure."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from typing import Any

from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_operator import constants as c
from ckpt_operator.behaviours.deps import Deps, set_job_status
from ckpt_operator.jobs import JobStatusAnnotation, format_time, job_facts
from ckpt_operator.kube import ApiError, ConflictError
from ckpt_operator.restart import (
    GiveUp,
    Restart,
    Skip,
    Wait,
    plan_restart,
    precheck_restart,
    terminating_pods_wait,
)
from ckpt_operator.validation import parse_policy_spec

__all__ = ["observe_job", "recover_job"]

log = logging.getLogger(__name__)


def _job_ref(job: Mapping[str, Any]) -> str:
    meta = job.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


async def observe_job(deps: Deps, job: Mapping[str, Any]) -> bool:
    """Bookkeeping on every event of an opted-in job; True when it needs recovery.

    Records the run id, reports a missing policy (Event + status annotation),
    marks the job as watched.
    """
    facts = job_facts(job)
    if not facts.opted_in or facts.deleting:
        return False
    assert facts.policy is not None
    patch: dict[str, str | None] = {}
    if not facts.annotations.get(c.ANN_RUN_ID):
        patch[c.ANN_RUN_ID] = facts.run_id
    finished = facts.succeeded or facts.handled
    if not finished and (
        facts.status is None or facts.status.state in ("Watching", "PolicyMissing")
    ):
        policy = await deps.api.get_policy(facts.namespace, facts.policy)
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
    if patch:
        await deps.api.patch_job_annotations(facts.namespace, facts.name, patch)
    return facts.needs_recovery


async def _load_policy_spec(deps: Deps, job: Mapping[str, Any]) -> CheckpointPolicySpec | None:
    facts = job_facts(job)
    assert facts.policy is not None
    policy = await deps.api.get_policy(facts.namespace, facts.policy)
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
    if not facts.needs_recovery:
        return None
    spec = await _load_policy_spec(deps, job)
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
    if outcome is None:
        waiting = await _wait_for_terminating_pods(deps, job, now)
        if waiting is not None:
            return waiting
        assert facts.policy is not None
        source = await deps.sources(facts.namespace, facts.policy, spec)
        records = await asyncio.to_thread(source.list_checkpoints, facts.run_id)
        progress = await asyncio.to_thread(source.progress, facts.run_id)
        verify = functools.partial(source.verify, facts.run_id)
        outcome = await asyncio.to_thread(
            plan_restart, job, spec.recovery, records, now, verify, progress
        )

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
    await _restart(deps, job, outcome)
    return None


async def _wait_for_terminating_pods(
    deps: Deps, job: Mapping[str, Any], now: float
) -> float | None:
    """Seconds until the next look while the failed job's pods are still terminating.

    They may be writing an emergency checkpoint (see
    :func:`ckpt_operator.restart.terminating_pods_wait`); planning waits for them.
    """
    facts = job_facts(job)
    pods = [
        p
        for p in await deps.api.list_pods(
            node_name=None, label_selector=f"{c.LABEL_TO_JOB_NAME}={facts.name}"
        )
        if (p.get("metadata") or {}).get("namespace") == facts.namespace
    ]
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


async def _restart(deps: Deps, job: Mapping[str, Any], outcome: Restart) -> None:
    facts = job_facts(job)
    decision = outcome.decision
    if not outcome.replay:
        if outcome.crash_loop:
            deps.metrics.poisoned.inc()
            deps.metrics.recoveries.labels("failure", "CrashLoop").inc()
            deps.events.emit(
                job,
                "Warning",
                "CrashLoop",
                f"the run failed before advancing past {outcome.crash_loop} "
                f"(step {facts.resume_step}); checkpoint poisoned, the ladder walks further back",
            )
        for rung in outcome.ladder:
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
                    f"rung {rung.rung}: {rung.checkpoint_id} (step {rung.step}) "
                    f"rejected: {rung.why}",
                )
        # Intent first: a crash after this line replays exactly this decision.
        await set_job_status(
            deps,
            job,
            "Restarting",
            "RestartPlanned",
            f"restarting as {decision.name} ({decision.action} "
            f"{decision.resume_from or 'from the beginning'})",
            {c.ANN_RESTARTED_AS: decision.name, c.ANN_RESTART_DECISION: decision.to_json()},
        )
    try:
        await deps.api.create_job(facts.namespace, outcome.job)
    except ConflictError:
        existing = await deps.api.get_job(facts.namespace, decision.name)
        of = ((existing or {}).get("metadata") or {}).get("annotations", {}).get(c.ANN_RESTART_OF)
        if existing is not None and of != facts.name:
            message = (
                f"a PyTorchJob named {decision.name} exists and is not a restart of {facts.name}"
            )
            deps.events.emit(job, "Warning", "GaveUp", f"NameTaken: {message}")
            await set_job_status(deps, job, "GaveUp", "NameTaken", message)
            deps.metrics.recoveries.labels("failure", "NameTaken").inc()
            return None
        log.info("restart %s of %s already exists (409): done", decision.name, _job_ref(job))
    except ApiError as e:
        deps.metrics.recoveries.labels("failure", "CreateFailed").inc()
        deps.events.emit(job, "Warning", "RestartFailed", f"creating {decision.name} failed: {e}")
        raise
    if decision.resume_from:
        what = f"from step {decision.resume_step} ({decision.resume_from}, {decision.action})"
    else:
        what = "from the beginning (no checkpoint yet)"
    message = f"restarted as {decision.name} {what}; restart {decision.restart_count}"
    deps.events.emit(job, "Normal", "Restarted", message)
    await set_job_status(deps, job, "Restarted", "RestartCreated", message)
    deps.metrics.restarts.labels(decision.action).inc()
    deps.metrics.recoveries.labels("success", "Restarted").inc()
    if facts.failed_at is not None:
        deps.metrics.failure_to_restart.observe(max(0.0, deps.clock() - facts.failed_at))
    return None
