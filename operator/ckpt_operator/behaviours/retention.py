"""Retention: apply a policy's retention to its runs' storage and report it in the status."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ckpt_agent.policy import StorageType
from ckpt_agent.storage import StorageError
from ckpt_operator.adapters.sources import GrantEscapeError, StorageAccessDeniedError
from ckpt_operator.behaviours.deps import Deps, Obj, list_all_jobs
from ckpt_operator.behaviours.guard import run_access, storage_call
from ckpt_operator.behaviours.policies import write_policy_status
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jobs import JobFacts, job_facts
from ckpt_operator.planners.reports import (
    known_checkpoints,
    newest_entry,
    pod_reports,
    reported_status,
)
from ckpt_operator.planners.retention_plan import Deletion, plan_policy_retention, retention_status
from ckpt_operator.planners.status import set_condition
from ckpt_operator.planners.tenancy import summarize_error
from ckpt_operator.planners.validation import parse_policy_spec

__all__ = ["reconcile_retention"]

log = logging.getLogger(__name__)


def _reconciled(current: Mapping[str, Any], reason: str, message: str, now: float) -> list[Obj]:
    """``status.conditions`` with ``Reconciled`` set (True only for ``RetentionApplied``)."""
    return set_condition(
        (Body(current).status.get("conditions")),
        "Reconciled",
        "True" if reason == "RetentionApplied" else "False",
        reason,
        message[:2000],
        now=now,
        observed_generation=meta_of(current).generation,
    )


async def _refuse_policy(deps: Deps, policy: Mapping[str, Any], message: str) -> Obj | None:
    """The administrator did not allow the policy's storage: a condition and an Event only."""
    meta = meta_of(policy)
    now = deps.clock()

    def build(current: Mapping[str, Any]) -> Obj:
        return {"conditions": _reconciled(current, "StorageAccessDenied", message, now)}

    status = await write_policy_status(deps, str(meta.namespace), str(meta.name), build)
    deps.metrics.retention_errors.inc()
    deps.events.emit(policy, "Warning", "StorageAccessDenied", message[:1000])
    return status


async def _reported_status(
    deps: Deps, policy: Mapping[str, Any], jobs: list[Obj], now: float
) -> Obj | None:
    """Local storage the operator cannot read (a PVC mounted in the pods only): the status
    from what the pods reported (:mod:`ckpt_operator.planners.reports`); retention runs in the
    pods."""
    meta = meta_of(policy)
    namespace = str(meta.namespace)
    pods = await deps.api.list_pods(
        node_name=None, label_selector=f"{c.LABEL_INJECTED}=true", namespace=namespace
    )
    reports, _ = pod_reports(pods)  # unreadable messages are logged when a job is recovered
    carried: dict[str, list[str | None]] = {}
    for job in jobs:
        facts = job_facts(job)
        carried.setdefault(facts.run_id, []).append(facts.annotations.get(c.ANN_CHECKPOINTS))
    runs = {run: known_checkpoints(run, texts, reports).report for run, texts in carried.items()}

    def build(current: Mapping[str, Any]) -> Obj:
        status = reported_status(runs, previous=current.get("status"), jobs=len(jobs), now=now)
        status["conditions"] = set_condition(
            Body(current).status.get("conditions"),
            "Reconciled",
            "True",
            "RetentionInPods",
            "the storage is not reachable from the operator (local storage on a PVC): the "
            "agents apply retention after each save; checkpoints as the pods reported them",
            now=now,
            observed_generation=meta_of(current).generation,
        )
        return status

    return await write_policy_status(deps, namespace, str(meta.name), build)


async def reconcile_retention(deps: Deps, policy: Mapping[str, Any]) -> Obj | None:
    """Apply a policy's retention to the storage of its jobs' runs; returns the status written."""
    meta = meta_of(policy)
    name, namespace = str(meta.name), str(meta.namespace)
    spec, _ = parse_policy_spec(policy.get("spec"))
    if spec is None:
        return None
    now = deps.clock()
    jobs = [j for j in await list_all_jobs(deps, namespace) if job_facts(j).policy == name]
    users: dict[str, JobFacts] = {}
    for facts in sorted((job_facts(j) for j in jobs), key=lambda f: f.name):
        users.setdefault(facts.run_id, facts)
    try:
        source = await deps.sources(namespace, name, spec)
    except StorageAccessDeniedError as e:
        if spec.storage.type != StorageType.LOCAL or isinstance(e, GrantEscapeError):
            return await _refuse_policy(deps, policy, str(e))
        return await _reported_status(deps, policy, jobs, now)  # a PVC: no access needed
    if not await storage_call(deps, source.reachable):
        return await _reported_status(deps, policy, jobs, now)
    runs = {}
    problems: list[str] = []
    for run_id, user in sorted(users.items()):
        try:
            access = await run_access(deps, source, run_id, namespace)
            if access.refusal is not None:
                problems.append(f"job {user.name}: {access.refusal}")
                deps.events.emit(
                    policy, "Warning", "RunOwnedElsewhere", f"job {user.name}: {access.refusal}"
                )
                continue
            listed = await storage_call(
                deps, source.list_checkpoints, run_id, include_heartbeat=False
            )
            unclaimed = access.unclaimed(listed)  # a legacy run: nothing deleted
            if unclaimed is not None:
                problems.append(f"job {user.name}: {unclaimed}")
                deps.events.emit(
                    policy, "Warning", "LegacyRunUnclaimed", f"job {user.name}: {unclaimed}"
                )
                continue
            runs[run_id] = listed
        except (StorageError, ValueError) as e:
            problems.append(f"run {run_id[:253]}: listing failed: {summarize_error(e)}")
    plan = plan_policy_retention(runs, spec.retention, now)
    deleted: list[Deletion] = []
    for d in plan.deletions:
        try:
            await storage_call(deps, source.delete_checkpoint, d.run_id, d.checkpoint_id)
        except StorageError as e:
            deps.metrics.retention_errors.inc()
            problems.append(f"deleting {d.run_id}/{d.checkpoint_id} failed: {summarize_error(e)}")
            continue
        deleted.append(d)
        deps.metrics.retention_deletions.inc()
        deps.metrics.retention_bytes.inc(d.size_bytes)
    blobs = 0
    for run_id in sorted({d.run_id for d in deleted}):
        try:
            gc = await storage_call(deps, source.collect_garbage, run_id)
        except StorageError as e:
            problems.append(f"blob GC of {run_id} failed: {summarize_error(e)}")
            continue
        blobs += len(gc.deleted)
        deps.metrics.retention_bytes.inc(gc.freed_bytes)
        if gc.stale_folders:
            log.info("run %s: removed stale uncommitted folder(s) %s", run_id, gc.stale_folders)
    for warning in plan.warnings:
        log.warning("retention %s/%s: %s", namespace, name, warning)

    def build(current: Mapping[str, Any]) -> Obj:
        previous = current.get("status")
        status = retention_status(plan, deleted=deleted, previous=previous, jobs=len(jobs), now=now)
        newest = newest_entry(status["lastValid"])
        if newest is not None:
            status["lastVerifiedCheckpoint"] = {**newest, "source": "storage"}
        status["conditions"] = _reconciled(
            current,
            "StorageErrors" if problems else "RetentionApplied",
            "; ".join(problems)
            if problems
            else f"{len(deleted)} checkpoint(s) deleted, {blobs} unreferenced blob(s) collected",
            now,
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
