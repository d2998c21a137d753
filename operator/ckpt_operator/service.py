"""What the operator does, as async functions over the API, storage and the pure planners.

The kopf handlers (:mod:`ckpt_operator.handlers`) are one-liners over these;
these are thin too: read objects, call a pure builder/planner, write the
result, emit Events and metrics. All state lives on Kubernetes objects
(annotations, policy status) so any of them can be interrupted and re-run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_agent.storage import StorageError
from ckpt_operator import constants as c
from ckpt_operator.config import OperatorConfig
from ckpt_operator.disruption import node_disruption, pod_disruption, save_now_patch
from ckpt_operator.events import EventSink
from ckpt_operator.injection import (
    InjectionContext,
    build_config_map,
    build_pod_patch,
)
from ckpt_operator.jobs import JobStatusAnnotation, format_time, job_facts, owner_job_name
from ckpt_operator.jsonpatch import JSONPatchOp
from ckpt_operator.kube import ApiError, ConflictError, KubeApi
from ckpt_operator.metrics import Metrics
from ckpt_operator.restart import (
    GiveUp,
    Restart,
    Skip,
    Wait,
    plan_restart,
    precheck_restart,
    terminating_pods_wait,
)
from ckpt_operator.retention_reconcile import Deletion, plan_policy_retention, retention_status
from ckpt_operator.sources import SourceFactory
from ckpt_operator.status import policy_ready_status, set_condition
from ckpt_operator.validation import parse_policy_spec

__all__ = [
    "Deps",
    "InjectionOutcome",
    "inject_pod",
    "observe_job",
    "reconcile_policy",
    "reconcile_retention",
    "recover_job",
    "signal_node",
    "signal_pod",
    "validate_policy",
    "write_policy_status",
]

log = logging.getLogger(__name__)
Obj = dict[str, Any]

#: Attempts of an optimistic (resourceVersion-guarded) policy status write.
STATUS_WRITE_ATTEMPTS = 3


@dataclass
class Deps:
    """Everything the operator's functions need (kopf passes it around in ``memo``)."""

    api: KubeApi
    events: EventSink
    metrics: Metrics
    sources: SourceFactory
    config: OperatorConfig = field(default_factory=OperatorConfig)
    clock: Callable[[], float] = time.time
    node_signals: dict[str, str] = field(default_factory=dict)
    """node name → last disruption request id signalled (avoids re-listing pods)."""


def _job_ref(job: Mapping[str, Any]) -> str:
    meta = job.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


async def _set_job_status(
    deps: Deps,
    job: Mapping[str, Any],
    state: str,
    reason: str,
    message: str,
    extra: Mapping[str, str | None] | None = None,
) -> None:
    facts = job_facts(job)
    status = JobStatusAnnotation(state, reason, message, format_time(deps.clock()))
    annotations: dict[str, str | None] = {c.ANN_STATUS: status.to_json()}
    annotations.update(extra or {})
    await deps.api.patch_job_annotations(facts.namespace, facts.name, annotations)


# --------------------------------------------------------------------------- admission


def validate_policy(spec: Mapping[str, Any] | None) -> list[str]:
    """Field-level errors of a CheckpointPolicy spec (empty: valid)."""
    return parse_policy_spec(spec)[1]


@dataclass(frozen=True)
class InjectionOutcome:
    ops: list[JSONPatchOp]
    warnings: list[str]
    result: str
    """``injected``, ``skipped``, ``already`` or ``ignored`` (not an opted-in job's pod)."""


async def inject_pod(
    deps: Deps, pod: Mapping[str, Any], namespace: str, *, dryrun: bool = False
) -> InjectionOutcome:
    """The mutating webhook: the JSON Patch for a pod being created (never raises for bad input)."""
    job_name = owner_job_name(pod)
    if not job_name:
        return InjectionOutcome([], [], "ignored")
    job = await deps.api.get_job(namespace, job_name)
    if job is None:
        return InjectionOutcome(
            [],
            [f"ckpt-operator: PyTorchJob {namespace}/{job_name} not found; not injected"],
            "skipped",
        )
    facts = job_facts(job)
    if not facts.opted_in:
        return InjectionOutcome([], [], "ignored")
    assert facts.policy is not None
    pod_name = (pod.get("metadata") or {}).get("name") or "(generated name)"

    def skipped(reason: str, event_reason: str) -> InjectionOutcome:
        message = f"pod {pod_name}: checkpoint agent not injected: {reason}"
        if not dryrun:
            deps.events.emit(job, "Warning", event_reason, message)
        deps.metrics.injections.labels("skipped").inc()
        return InjectionOutcome([], [f"ckpt-operator: {message}"], "skipped")

    policy = await deps.api.get_policy(namespace, facts.policy)
    if policy is None:
        return skipped(f"CheckpointPolicy {facts.policy!r} not found", "PolicyNotFound")
    spec, errors = parse_policy_spec(policy.get("spec"))
    if spec is None:
        return skipped(
            f"CheckpointPolicy {facts.policy!r} is invalid: {'; '.join(errors)}", "InvalidPolicy"
        )
    inj = deps.config.injection
    ctx = InjectionContext(
        policy_name=facts.policy,
        run_id=facts.run_id,
        resume_from=facts.resume_from,
        agent_image=inj.agent_image,
        sidecar_command=inj.sidecar_command,
        sidecar_resources={
            "requests": {"cpu": inj.sidecar_cpu_request, "memory": inj.sidecar_memory_request},
            "limits": {"memory": inj.sidecar_memory_limit},
        },
    )
    result = build_pod_patch(pod, spec, facts.annotations, ctx)
    if result.already_injected:
        deps.metrics.injections.labels("already").inc()
        return InjectionOutcome([], [], "already")
    if result.skipped:
        return skipped(result.skipped, "InjectionSkipped")
    deps.metrics.injections.labels("injected").inc()
    where = f"resuming from {facts.resume_from}" if facts.resume_from else "fresh start"
    message = (
        f"pod {pod_name}: injected checkpoint agent "
        f"(policy {facts.policy}, run {facts.run_id}, {where})"
    )
    if result.notes:
        message += "; " + "; ".join(result.notes)
    if not dryrun:
        deps.events.emit(job, "Normal", "Injected", message)
    return InjectionOutcome(result.ops, [f"ckpt-operator: {n}" for n in result.notes], "injected")


# --------------------------------------------------------------------------- policies


async def write_policy_status(
    deps: Deps,
    namespace: str,
    name: str,
    build: Callable[[Mapping[str, Any]], Obj],
) -> Obj | None:
    """Read-modify-write of a policy's status, guarded by its ``resourceVersion``.

    ``build(current policy) -> status patch``. Two writers share the status (the policy
    handler's ``Ready``, the retention loop's ``Reconciled`` and counts) and a merge
    patch replaces the whole ``conditions`` list, so each builds on the *current* status
    and a concurrent write makes it retry (409) instead of erasing the other's condition
    (found on the real control plane: a policy that never became Ready). Returns the
    status written, None if the policy is gone; raises :class:`ConflictError` if it kept
    changing (the caller is retried: kopf's handler, the retention loop's next pass).
    """
    for _ in range(STATUS_WRITE_ATTEMPTS):
        current = await deps.api.get_policy(namespace, name)
        if current is None:
            return None
        status = build(current)
        try:
            await deps.api.patch_policy_status(
                namespace,
                name,
                status,
                resource_version=(current.get("metadata") or {}).get("resourceVersion"),
            )
            return status
        except ConflictError:
            continue
    raise ConflictError(409, f"policy {namespace}/{name}: status kept changing; not written")


async def reconcile_policy(deps: Deps, policy: Mapping[str, Any]) -> Obj:
    """Validate, publish the agent ConfigMap, wake jobs waiting for it, write ``Ready``.

    Returns the status written (or, when the policy is gone, the one computed from
    ``policy``).
    """
    meta = policy.get("metadata") or {}
    name, namespace = str(meta.get("name")), str(meta.get("namespace"))
    spec, errors = parse_policy_spec(policy.get("spec"))
    now = deps.clock()

    async def write_ready() -> Obj:
        def build(current: Mapping[str, Any]) -> Obj:
            return policy_ready_status(
                current.get("status"), generation=meta.get("generation"), errors=errors, now=now
            )

        written = await write_policy_status(deps, namespace, name, build)
        return written if written is not None else build(policy)

    if spec is None:
        deps.events.emit(policy, "Warning", "InvalidSpec", "; ".join(errors))
        return await write_ready()
    await deps.api.apply_config_map(build_config_map(name, namespace, spec, meta.get("uid")))
    for job in await deps.api.list_jobs(namespace):
        facts = job_facts(job)
        if (
            facts.policy == name
            and facts.status is not None
            and facts.status.state == "PolicyMissing"
        ):
            await _set_job_status(deps, job, "Watching", "PolicyFound", f"using policy {name}")
            deps.events.emit(job, "Normal", "PolicyFound", f"CheckpointPolicy {name} now exists")
    return await write_ready()


# --------------------------------------------------------------------------- jobs


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
            await _set_job_status(deps, job, "PolicyMissing", "PolicyNotFound", message)
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
            await _set_job_status(deps, job, "BackingOff", "Backoff", message)
        return outcome.seconds
    if isinstance(outcome, GiveUp):
        deps.events.emit(job, "Warning", "GaveUp", f"{outcome.reason}: {outcome.message}")
        extra: dict[str, str | None] = {}
        if outcome.poisoned:
            extra[c.ANN_POISONED] = ",".join(outcome.poisoned)
        await _set_job_status(deps, job, "GaveUp", outcome.reason, outcome.message, extra)
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
        await _set_job_status(deps, job, "BackingOff", "PodsTerminating", message)
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
        await _set_job_status(
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
            await _set_job_status(deps, job, "GaveUp", "NameTaken", message)
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
    await _set_job_status(deps, job, "Restarted", "RestartCreated", message)
    deps.metrics.restarts.labels(decision.action).inc()
    deps.metrics.recoveries.labels("success", "Restarted").inc()
    if facts.failed_at is not None:
        deps.metrics.failure_to_restart.observe(max(0.0, deps.clock() - facts.failed_at))
    return None


# --------------------------------------------------------------------------- disruption


async def signal_pod(deps: Deps, pod: Mapping[str, Any]) -> bool:
    """Signal ``pod`` to save now when the pod itself announces a disruption."""
    disruption = pod_disruption(pod)
    if disruption is None:
        return False
    patch = save_now_patch(pod, disruption)
    if patch is None:
        return False
    meta = pod.get("metadata") or {}
    await deps.api.patch_pod(str(meta.get("namespace")), str(meta.get("name")), patch)
    deps.metrics.save_now.labels(disruption.reason).inc()
    deps.events.emit(
        pod, "Normal", "SaveNowRequested", f"emergency checkpoint requested: {disruption.message}"
    )
    return True


async def signal_node(deps: Deps, node: Mapping[str, Any]) -> int:
    """Signal every injected pod on a node that announces a disruption; returns pods signalled."""
    name = str((node.get("metadata") or {}).get("name") or "")
    disruption = node_disruption(node)
    if disruption is None:
        deps.node_signals.pop(name, None)
        return 0
    if deps.node_signals.get(name) == disruption.request_id:
        return 0
    pods = await deps.api.list_pods(node_name=name, label_selector=f"{c.LABEL_INJECTED}=true")
    n = 0
    for pod in pods:
        patch = save_now_patch(pod, disruption)
        if patch is None:
            continue
        meta = pod.get("metadata") or {}
        await deps.api.patch_pod(str(meta.get("namespace")), str(meta.get("name")), patch)
        deps.metrics.save_now.labels(disruption.reason).inc()
        deps.events.emit(
            pod,
            "Normal",
            "SaveNowRequested",
            f"emergency checkpoint requested: {disruption.message}",
        )
        n += 1
    deps.node_signals[name] = disruption.request_id
    return n


# --------------------------------------------------------------------------- retention


async def reconcile_retention(deps: Deps, policy: Mapping[str, Any]) -> Obj | None:
    """Apply a policy's retention to the storage of its jobs' runs; returns the status written."""
    meta = policy.get("metadata") or {}
    name, namespace = str(meta.get("name")), str(meta.get("namespace"))
    spec, _ = parse_policy_spec(policy.get("spec"))
    if spec is None:
        return None
    now = deps.clock()
    jobs = [j for j in await deps.api.list_jobs(namespace) if job_facts(j).policy == name]
    run_ids = sorted({job_facts(j).run_id for j in jobs})
    source = await deps.sources(namespace, name, spec)
    runs = {}
    problems: list[str] = []
    for run_id in run_ids:
        try:
            runs[run_id] = await asyncio.to_thread(
                functools.partial(source.list_checkpoints, run_id, include_heartbeat=False)
            )
        except (StorageError, ValueError) as e:
            problems.append(f"run {run_id}: listing failed: {e}")
    plan = plan_policy_retention(runs, spec.retention, now)
    deleted: list[Deletion] = []
    for d in plan.deletions:
        try:
            await asyncio.to_thread(source.delete_checkpoint, d.run_id, d.checkpoint_id)
        except StorageError as e:
            deps.metrics.retention_errors.inc()
            problems.append(f"deleting {d.run_id}/{d.checkpoint_id} failed: {e}")
            continue
        deleted.append(d)
        deps.metrics.retention_deletions.inc()
        deps.metrics.retention_bytes.inc(d.size_bytes)
    blobs = 0
    for run_id in sorted({d.run_id for d in deleted}):
        try:
            gc = await asyncio.to_thread(source.collect_garbage, run_id)
        except StorageError as e:
            problems.append(f"blob GC of {run_id} failed: {e}")
            continue
        blobs += gc.blobs_deleted
        deps.metrics.retention_bytes.inc(gc.bytes_freed)
    for warning in plan.warnings:
        log.warning("retention %s/%s: %s", namespace, name, warning)

    def build(current: Mapping[str, Any]) -> Obj:
        previous = current.get("status")
        status = retention_status(plan, deleted=deleted, previous=previous, jobs=len(jobs), now=now)
        status["conditions"] = set_condition(
            (previous or {}).get("conditions"),
            "Reconciled",
            "False" if problems else "True",
            "StorageErrors" if problems else "RetentionApplied",
            "; ".join(problems)[:2000]
            if problems
            else (f"{len(deleted)} checkpoint(s) deleted, {blobs} unreferenced blob(s) collected"),
            now=now,
            observed_generation=(current.get("metadata") or {}).get("generation"),
        )
        return status

    status = await write_policy_status(deps, namespace, name, build)
    if status is None:
        return None  # the policy was deleted meanwhile
    if deleted:
        ids = ", ".join(f"{d.run_id}/{d.checkpoint_id}" for d in deleted[:10])
        more = f" (+{len(deleted) - 10} more)" if len(deleted) > 10 else ""
        deps.events.emit(
            policy,
            "Normal",
            "RetentionApplied",
            f"deleted {len(deleted)} checkpoint(s): {ids}{more}",
        )
    if problems:
        deps.metrics.retention_errors.inc()
        deps.events.emit(policy, "Warning", "RetentionErrors", "; ".join(problems)[:1000])
    return status
