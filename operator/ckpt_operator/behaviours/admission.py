"""Admission: the validating (policies) and mutating (pods) webhooks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_operator.behaviours.deps import Deps, cached_job, cached_policy
from ckpt_operator.behaviours.replica_secrets import issue_replica_secret
from ckpt_operator.kinds.registry import owner_of
from ckpt_operator.kinds.trainjob import (
    TRAINJOB,
    has_inject_patch,
    pod_attempt,
    runtime_ref,
    trainer_replicated_jobs,
)
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.model.jobs import job_facts, template_label_ops
from ckpt_operator.model.jsonpatch import JSONPatchOp
from ckpt_operator.planners.attempt_plan import attempt_refusal
from ckpt_operator.planners.injection import (
    InjectionContext,
    build_pod_patch,
    is_unprotected,
)
from ckpt_operator.planners.replica_injection import mounts_replica_secret
from ckpt_operator.planners.runfacts import agent_run_env
from ckpt_operator.planners.validation import annotation_errors, parse_policy_spec

__all__ = [
    "InjectionOutcome",
    "inject_pod",
    "label_job_ops",
    "report_unprotected",
    "trainjob_label_targets",
    "validate_job",
    "validate_policy",
]


def validate_policy(spec: Mapping[str, Any] | None) -> list[str]:
    """Field-level errors of a CheckpointPolicy spec (empty: valid)."""
    return parse_policy_spec(spec)[1]


def validate_job(job: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """Bad ``ckpt.dev`` annotations of a PyTorchJob being created or updated (empty: fine).

    On an update only changed annotations count (see
    :func:`ckpt_operator.planners.validation.annotation_errors`).
    """

    def annotations(obj: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if obj is None:
            return None
        return meta_of(obj).annotations

    return annotation_errors(annotations(job) or {}, annotations(old))


def label_job_ops(job: Mapping[str, Any]) -> list[JSONPatchOp]:
    """The ``label-job`` webhook's answer: an opted-in job's pod templates get
    ``ckpt.dev/inject`` (:func:`ckpt_operator.model.jobs.template_label_ops`), so the pod webhook
    sees exactly its pods; empty: not opted in, or labelled already."""
    return template_label_ops(job) if job_facts(job).opted_in else []


async def trainjob_label_targets(deps: Deps, trainjob: Mapping[str, Any]) -> list[str]:
    """The ``label-trainjob`` webhook: the replicated Jobs of an opted-in TrainJob's runtime
    whose pod templates the operator's ``spec.runtimePatches`` entry labels
    (:func:`ckpt_operator.kinds.trainjob.add_inject_patch`); empty: nothing to do (not opted in,
    labelled already, or a runtime that does not exist: Trainer's own webhook refuses it)."""
    if not job_facts(trainjob).opted_in or has_inject_patch(trainjob):
        return []
    ref = runtime_ref(trainjob)
    if ref is None:
        return []
    kind, name = ref
    namespace = str(meta_of(trainjob).namespace or "")
    api = deps.admission_api if deps.admission_api is not None else deps.api
    if kind == c.CLUSTER_TRAINING_RUNTIME_KIND:
        plural, where = c.CLUSTER_TRAINING_RUNTIME_PLURAL, None
    else:
        plural, where = c.TRAINING_RUNTIME_PLURAL, namespace
    runtime = await api.get_custom(c.TRAINJOB_GROUP, c.TRAINJOB_VERSION, plural, where, name)
    return trainer_replicated_jobs(runtime) if runtime is not None else []


async def report_unprotected(deps: Deps, pod: Mapping[str, Any]) -> bool:
    """An opted-in pod running without the agent that the webhook would inject now (it was
    bypassed: disabled, ``failurePolicy: Ignore`` while the operator was down): a Warning
    Event on the pod and its job, the ``unprotected_pods`` metric; once per pod. Pods the
    webhook skips on purpose (policy missing, no training container) were reported at
    admission. True when reported.
    """
    meta = meta_of(pod)
    uid = str(meta.uid or "")
    if not uid or deps.reported_pods.reported(uid) or not is_unprotected(pod):
        return False
    namespace = str(meta.namespace or "")
    if (await inject_pod(deps, pod, namespace, quiet=True)).result != "injected":
        return False
    deps.reported_pods.mark(uid)
    deps.metrics.unprotected_pods.inc()
    name = meta.name
    owner = owner_of(pod)
    kind = owner[0] if owner is not None else None
    message = (
        f"pod {name} of an opted-in {kind.kind if kind else 'job'} runs WITHOUT the checkpoint "
        "agent (it was admitted while the ckpt-operator webhook was bypassed): it takes no "
        "checkpoints and a restart of it starts from step 0; delete the pod so that the "
        f"{'Job controller' if kind is TRAINJOB else 'training-operator'} recreates it "
        "injected, and keep webhook.inject.failurePolicy at Fail"
    )
    deps.events.emit(pod, "Warning", "NotInjected", message)
    job = deps.job_cache(owner[0]).get(namespace, owner[1]) if owner is not None else None
    if job is not None:
        deps.events.emit(job, "Warning", "NotInjected", message)
    return True


@dataclass(frozen=True)
class InjectionOutcome:
    ops: list[JSONPatchOp]
    warnings: list[str]
    result: str
    """``injected``, ``skipped``, ``already``, ``ignored`` (not an opted-in job's pod) or
    ``deferred`` (refused for now: a TrainJob restart attempt not planned yet)."""
    refusal: str = ""
    """Why a ``deferred`` pod is refused (the admission error)."""
    job: str = ""
    """A ``deferred`` pod's TrainJob (its attempt is in :attr:`Deps.attempts_seen`)."""


async def inject_pod(
    deps: Deps,
    pod: Mapping[str, Any],
    namespace: str,
    *,
    dryrun: bool = False,
    quiet: bool = False,
) -> InjectionOutcome:
    """The mutating webhook: the JSON Patch for a pod being created (never raises for bad input).

    Reads the job and the policy from the watch caches (one API read on a miss, on the
    webhook's own threads); never touches storage. ``quiet``: no Events, no metrics (the
    unprotected-pod check asks what the webhook would do).
    """
    owner = owner_of(pod)
    if owner is None:
        return InjectionOutcome([], [], "ignored")
    kind, job_name = owner
    job = await cached_job(deps, namespace, job_name, admission=True, kind=kind)
    if job is None:
        return InjectionOutcome(
            [],
            [f"ckpt-operator: {kind.kind} {namespace}/{job_name} not found; not injected"],
            "skipped",
        )
    facts = job_facts(job)
    if not facts.opted_in:
        return InjectionOutcome([], [], "ignored")
    assert facts.policy is not None
    refusal = attempt_refusal(facts, pod) if kind is TRAINJOB else None
    if refusal is not None and not quiet:
        deps.attempts_seen.note(namespace, job_name, pod_attempt(pod))
        return InjectionOutcome([], [], "deferred", refusal, job_name)
    pod_name = meta_of(pod).name or "(generated name)"

    def skipped(reason: str, event_reason: str) -> InjectionOutcome:
        message = f"pod {pod_name}: checkpoint agent not injected: {reason}"
        if not (dryrun or quiet):
            deps.events.emit(job, "Warning", event_reason, message)
        if not quiet:
            deps.metrics.injections.labels("skipped").inc()
        return InjectionOutcome([], [f"ckpt-operator: {message}"], "skipped")

    invalid = annotation_errors(facts.annotations)
    if invalid:
        return skipped(f"{kind.kind} {job_name}: {'; '.join(invalid)}", "InvalidAnnotation")
    policy = await cached_policy(deps, namespace, facts.policy, admission=True)
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
        job_name=facts.name,
        job_uid=facts.uid,
        resume_from=facts.resume_from,
        run_env=agent_run_env(facts),
        default_container=kind.default_container,
        job=job,
        agent_image=inj.agent_image,
        sidecar_command=inj.sidecar_command,
        sidecar_resources={
            "requests": {"cpu": inj.sidecar_cpu_request, "memory": inj.sidecar_memory_request},
            "limits": {"memory": inj.sidecar_memory_limit},
        },
    )
    result = build_pod_patch(pod, spec, facts.annotations, ctx)
    if result.already_injected:
        if not quiet:
            deps.metrics.injections.labels("already").inc()
        return InjectionOutcome([], [], "already")
    if result.skipped:
        return skipped(result.skipped, "InjectionSkipped")
    if quiet:
        return InjectionOutcome(result.ops, [], "injected")
    notes = list(result.notes)
    if deps.config.issue_replica_secrets and not dryrun and mounts_replica_secret(result.ops):
        note = await issue_replica_secret(deps, kind, job)
        if note is not None:
            notes.append(note)
    deps.metrics.injections.labels("injected").inc()
    where = f"resuming from {facts.resume_from}" if facts.resume_from else "fresh start"
    message = (
        f"pod {pod_name}: injected checkpoint agent "
        f"(policy {facts.policy}, run {facts.run_id}, {where})"
    )
    if notes:
        message += "; " + "; ".join(notes)
    if not dryrun:
        deps.events.emit(job, "Normal", "Injected", message)
    return InjectionOutcome(result.ops, [f"ckpt-operator: {n}" for n in notes], "injected")
