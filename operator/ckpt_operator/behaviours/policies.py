"""CheckpointPolicies: validate, publish the agent ConfigMap, write ``Ready`` (guarded)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ckpt_agent.errors import StorageError
from ckpt_agent.policy import CheckpointPolicySpec, StorageType
from ckpt_operator.adapters.kube import ConflictError
from ckpt_operator.adapters.sources import GrantEscapeError
from ckpt_operator.behaviours.deps import Deps, Obj, list_all_jobs, set_job_status
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.model.jobs import job_facts
from ckpt_operator.planners.injection import build_config_map
from ckpt_operator.planners.status import policy_ready_status, set_condition
from ckpt_operator.planners.tenancy import storage_refusal
from ckpt_operator.planners.validation import parse_policy_spec

__all__ = ["STATUS_WRITE_ATTEMPTS", "reconcile_policy", "write_policy_status"]

#: Attempts of an optimistic (resourceVersion-guarded) policy status write.
STATUS_WRITE_ATTEMPTS = 3


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
                resource_version=meta_of(current).resource_version,
            )
            return status
        except ConflictError:
            continue
    raise ConflictError(409, f"policy {namespace}/{name}: status kept changing; not written")


def storage_access(deps: Deps, namespace: str, spec: CheckpointPolicySpec) -> str | None:
    """Why the operator will not open the policy's storage (None: it will), from the
    tenancy settings alone (no I/O)."""
    s3 = spec.storage.s3 if spec.storage.type == StorageType.S3 else None
    own_identity = (
        s3 is None or s3.credentials_secret is None or not deps.config.read_storage_secrets
    )
    return storage_refusal(namespace, spec, deps.config.tenancy, operator_identity=own_identity)


async def _link_refusal(
    deps: Deps, namespace: str, name: str, spec: CheckpointPolicySpec
) -> str | None:
    """A local path the grants allow as written may still leave them through a symbolic link,
    seen only where the kernel resolves it: opening the storage (the source is cached, so
    retention and restarts reuse it). Anything else that keeps it from opening (a PVC
    mounted in the pods only) is not a matter of what the administrator allows."""
    try:
        await deps.sources(namespace, name, spec)
    except GrantEscapeError as e:
        return str(e)
    except (StorageError, OSError, ValueError):  # not a tenancy verdict: retention reports it
        return None
    return None


async def reconcile_policy(deps: Deps, policy: Mapping[str, Any]) -> Obj:
    """Validate, publish the agent ConfigMap, wake jobs waiting for it, write ``Ready``.

    Returns the status written (or, when the policy is gone, the one computed from
    ``policy``).
    """
    meta = meta_of(policy)
    name, namespace = str(meta.name), str(meta.namespace)
    spec, errors = parse_policy_spec(policy.get("spec"))
    now = deps.clock()

    refusal = storage_access(deps, namespace, spec) if spec is not None else None
    if spec is not None and refusal is None and spec.storage.type == StorageType.LOCAL:
        refusal = await _link_refusal(deps, namespace, name, spec)

    async def write_ready() -> Obj:
        def build(current: Mapping[str, Any]) -> Obj:
            status = policy_ready_status(
                current.get("status"), generation=meta.generation, errors=errors, now=now
            )
            if spec is not None:  # StorageAccess: what the administrator allows (no I/O)
                status["conditions"] = set_condition(
                    status["conditions"],
                    "StorageAccess",
                    "False" if refusal else "True",
                    "StorageAccessDenied" if refusal else "Allowed",
                    refusal or "the operator may open this policy's storage",
                    now=now,
                    observed_generation=meta.generation,
                )
            return status

        written = await write_policy_status(deps, namespace, name, build)
        return written if written is not None else build(policy)

    if spec is None:
        deps.events.emit(policy, "Warning", "InvalidSpec", "; ".join(errors))
        return await write_ready()
    await deps.api.apply_config_map(build_config_map(name, namespace, spec, meta.uid))
    for job in await list_all_jobs(deps, namespace):
        facts = job_facts(job)
        if (
            facts.policy == name
            and facts.status is not None
            and facts.status.state == "PolicyMissing"
        ):
            await set_job_status(deps, job, "Watching", "PolicyFound", f"using policy {name}")
            deps.events.emit(job, "Normal", "PolicyFound", f"CheckpointPolicy {name} now exists")
    return await write_ready()
