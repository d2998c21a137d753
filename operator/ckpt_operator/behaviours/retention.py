"""Retention: apply a policy's retention to its runs' storage and report it in the status."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from typing import Any

from ckpt_agent.storage import StorageError
from ckpt_operator.behaviours.deps import Deps, Obj
from ckpt_operator.behaviours.policies import write_policy_status
from ckpt_operator.jobs import job_facts
from ckpt_operator.retention_reconcile import Deletion, plan_policy_retention, retention_status
from ckpt_operator.status import set_condition
from ckpt_operator.validation import parse_policy_spec

__all__ = ["reconcile_retention"]

log = logging.getLogger(__name__)


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
        blobs += len(gc.deleted)
        deps.metrics.retention_bytes.inc(gc.freed_bytes)
        if gc.stale_folders:
            log.info("run %s: removed stale uncommitted folder(s) %s", run_id, gc.stale_folders)
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
