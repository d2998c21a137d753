"""Admission: the validating (policies) and mutating (pods) webhooks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.injection import InjectionContext, build_pod_patch
from ckpt_operator.jobs import job_facts, owner_job_name
from ckpt_operator.jsonpatch import JSONPatchOp
from ckpt_operator.validation import parse_policy_spec

__all__ = ["InjectionOutcome", "inject_pod", "validate_policy"]


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
