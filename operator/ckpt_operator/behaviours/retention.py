"""Retention: apply a policy's retention to its runs' storage and report it in the status.

A pass is bounded (issue #28) by a :class:`~ckpt_operator.planners.retention_plan.PassBudget`
(``--retention-budget`` seconds, ``--retention-max-entries`` listed entries): listings get
half the time, split among the runs, and stop at their share
(:func:`ckpt_agent.format.listing.scan_checkpoints`); deletions go in batches
(:func:`~ckpt_operator.planners.retention_plan.deletion_batches`), each batch one call in a
worker thread that checks the clock before every chunk of :data:`DELETE_CHUNK` checkpoints.
A pass stops only at a **safe point**: between two runs' listings, or between two
chunks of whole checkpoint deletions — never inside one (a chunk's COMMITs first, in one
batched delete, then their folders:
:func:`ckpt_agent.persist.housekeeping.delete_checkpoints`), so a cut leaves every
checkpoint either committed and whole or gone from readers' sight (an uncommitted folder
left by a failure is the blob GC's after its grace, as after a crash); deletions run
newest first within a run, so nothing kept loses a dependency. What was not done is done
by the next pass (at the policy's next interval): the condition says
``RetentionCutShort`` and a
Warning Event says what was left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckpt_agent.format.listing import ListingLimits
from ckpt_agent.policy import StorageType
from ckpt_agent.storage import StorageError
from ckpt_agent.text import clean
from ckpt_operator.adapters.sources import (
    CheckpointSource,
    GrantEscapeError,
    StorageAccessDeniedError,
)
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
from ckpt_operator.planners.retention_plan import (
    Deletion,
    PassBudget,
    deletion_batches,
    manifest_refusal,
    plan_policy_retention,
    retention_status,
)
from ckpt_operator.planners.status import set_condition
from ckpt_operator.planners.tenancy import summarize_error
from ckpt_operator.planners.validation import parse_policy_spec

__all__ = ["DELETE_BATCH", "DELETE_CHUNK", "reconcile_retention"]

log = logging.getLogger(__name__)

DELETE_BATCH = 100
"""Checkpoints deleted per worker-thread call (one run's)."""
DELETE_CHUNK = 10
"""Checkpoints per :meth:`~ckpt_operator.adapters.sources.CheckpointSource.delete_checkpoints`
call: their COMMITs in one batched delete (S3 ``DeleteObjects``), then their folders; the
pass's clock is read between chunks, so a pass overruns its budget by one chunk at most."""


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


def _delete_batch(
    source: CheckpointSource,
    batch: Sequence[Deletion],
    stop_at: float,
    clock: Callable[[], float],
) -> tuple[list[Deletion], list[tuple[Deletion, StorageError]], Exception | None]:
    """Delete ``batch`` (one run's) :data:`DELETE_CHUNK` whole checkpoints at a time —
    their COMMITs in one batched delete, then their folders — until ``stop_at`` (runs in a
    worker thread; the clock is read between chunks only: the safe points). A chunk that
    fails is retried one checkpoint at a time, so each failure is named and the others
    still go. Returns (done, failed, an unexpected error that stopped the batch)."""
    done: list[Deletion] = []
    failed: list[tuple[Deletion, StorageError]] = []
    for i in range(0, len(batch), DELETE_CHUNK):
        if clock() >= stop_at:
            break
        chunk = batch[i : i + DELETE_CHUNK]
        try:
            source.delete_checkpoints(chunk[0].run_id, [d.checkpoint_id for d in chunk])
            done += chunk
            continue
        except StorageError:
            pass  # which ones went is not known: one at a time (a delete is idempotent)
        except Exception as e:
            return done, failed, e
        for d in chunk:
            try:
                source.delete_checkpoint(d.run_id, d.checkpoint_id)
            except StorageError as e:
                failed.append((d, e))
                continue
            except Exception as e:
                return done, failed, e
            done.append(d)
    return done, failed, None


async def _delete_in_time(
    deps: Deps,
    source: CheckpointSource,
    batch: Sequence[Deletion],
    budget: PassBudget,
    deleted: list[Deletion],
    problems: list[str],
) -> int:
    """Delete ``batch`` in worker-thread calls while the budget lasts (each call also ends
    well within the storage timeout); returns how many were tried (done or failed)."""
    rest = batch
    while rest and not budget.expired():
        deadline = budget.deadline
        stop_at = budget.clock() + deps.config.storage_timeout_s / 2
        if deadline is not None:
            stop_at = min(stop_at, deadline)
        done, failed, error = await storage_call(
            deps, _delete_batch, source, rest, stop_at, budget.clock
        )
        for d in done:
            deleted.append(d)
            deps.metrics.retention_deletions.inc()
            deps.metrics.retention_bytes.inc(d.size_bytes)
        for d, err in failed:
            deps.metrics.retention_errors.inc()
            problems.append(f"deleting {d.run_id}/{d.checkpoint_id} failed: {summarize_error(err)}")
        if error is not None:
            raise error
        if not done and not failed:
            break  # the clock is past stop_at already
        rest = rest[len(done) + len(failed) :]
    return len(batch) - len(rest)


async def _collect(
    deps: Deps,
    source: CheckpointSource,
    run_id: str,
    largest: tuple[str, int] | None,
    budget: PassBudget,
    problems: list[str],
) -> int:
    """The run's blob GC, unless a rank manifest is over the limit or the budget is spent;
    returns the blobs deleted."""
    refusal = manifest_refusal(run_id, largest, deps.config.retention.gc_max_manifest_bytes)
    if refusal is not None:
        problems.append(refusal)
        return 0
    if budget.expired():
        budget.cut(f"blob GC of run {run_id} left for a later pass")
        return 0
    try:
        gc = await storage_call(deps, source.collect_garbage, run_id)
    except StorageError as e:
        problems.append(f"blob GC of {run_id} failed: {summarize_error(e)}")
        return 0
    deps.metrics.retention_bytes.inc(gc.freed_bytes)
    if gc.stale_folders:
        log.info(
            "run %s: removed stale uncommitted folder(s) %s",
            clean(run_id),
            clean(_names(gc.stale_folders)),
        )
    return len(gc.deleted)


def _names(ids: Sequence[str]) -> str:
    return ", ".join(ids[:5]) + (f" (+{len(ids) - 5} more)" if len(ids) > 5 else "")


async def reconcile_retention(
    deps: Deps, policy: Mapping[str, Any], *, budget: PassBudget | None = None
) -> Obj | None:
    """Apply a policy's retention to the storage of its jobs' runs; returns the status written.

    ``budget`` bounds the pass (default: ``--retention-budget`` seconds and
    ``--retention-max-entries`` listed entries from now; see the module docstring).
    """
    cfg = deps.config.retention
    budget = budget if budget is not None else PassBudget(cfg.budget_s, cfg.max_entries)
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
    partial: set[str] = set()
    largest: dict[str, tuple[str, int] | None] = {}
    carried: list[str] = []
    problems: list[str] = []
    ordered = sorted(users.items())
    for i, (run_id, user) in enumerate(ordered):
        if budget.expired():
            carried = [r for r, _ in ordered[i:]]
            budget.cut(f"run(s) not listed this pass: {_names(carried)}")
            break
        try:
            access = await run_access(deps, source, run_id, namespace)
            if access.refusal is not None:
                problems.append(f"job {user.name}: {access.refusal}")
                deps.events.emit(
                    policy, "Warning", "RunOwnedElsewhere", f"job {user.name}: {access.refusal}"
                )
                continue
            left = len(ordered) - i
            limits = ListingLimits(
                max_entries=budget.entries_for(left),
                deadline=budget.listing_deadline(left),
                clock=budget.clock,
            )
            listing = await storage_call(deps, source.scan_checkpoints, run_id, limits)
            budget.spend(listing.entries)
            listed = listing.records
            unclaimed = access.unclaimed(listed)  # a legacy run: nothing deleted
            if unclaimed is not None:
                problems.append(f"job {user.name}: {unclaimed}")
                deps.events.emit(
                    policy, "Warning", "LegacyRunUnclaimed", f"job {user.name}: {unclaimed}"
                )
                continue
            if not listing.complete:
                partial.add(run_id)
                budget.cut(
                    f"run {run_id}: listing {listing.cut}, {len(listed)} checkpoint(s) seen: "
                    "only corrupted ones deleted, no blob GC"
                )
            runs[run_id] = listed
            largest[run_id] = listing.largest_manifest
        except (StorageError, ValueError) as e:
            problems.append(f"run {run_id[:253]}: listing failed: {summarize_error(e)}")
    plan = plan_policy_retention(runs, spec.retention, now, partial=partial)
    deleted: list[Deletion] = []
    tried = blobs = 0
    batches = deletion_batches(plan, DELETE_BATCH)
    for k, batch in enumerate(batches):
        n = await _delete_in_time(deps, source, batch, budget, deleted, problems)
        tried += n
        if n < len(batch):
            break  # the budget is spent
        run_id = batch[0].run_id
        if k + 1 < len(batches) and batches[k + 1][0].run_id == run_id:
            continue
        # the run's last batch: its blobs, before a larger run takes what is left
        if run_id not in partial and any(d.run_id == run_id for d in deleted):
            blobs += await _collect(deps, source, run_id, largest.get(run_id), budget, problems)
    planned = len(plan.deletions)
    if tried < planned:
        budget.cut(f"{planned - tried} deletion(s) left for the next pass")
    for warning in plan.warnings:
        log.warning("retention %s/%s: %s", namespace, name, clean(warning))
    cut = budget.summary(deleted=len(deleted), planned=planned) if budget.cut_short else ""
    if cut:
        log.info("retention %s/%s: %s", namespace, name, clean(cut))

    def build(current: Mapping[str, Any]) -> Obj:
        previous = current.get("status")
        status = retention_status(
            plan, deleted=deleted, previous=previous, jobs=len(jobs), now=now, carried=carried
        )
        newest = newest_entry(status["lastValid"])
        if newest is not None:
            status["lastVerifiedCheckpoint"] = {**newest, "source": "storage"}
        if problems:
            reason, message = "StorageErrors", "; ".join(problems + ([cut] if cut else []))
        elif cut:
            reason, message = "RetentionCutShort", cut
        else:
            reason = "RetentionApplied"
            message = (
                f"{len(deleted)} checkpoint(s) deleted, {blobs} unreferenced blob(s) collected"
            )
        status["conditions"] = _reconciled(current, reason, message, now)
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
    if cut:
        deps.events.emit(policy, "Warning", "RetentionCutShort", cut[:1000])
    if problems:
        deps.metrics.retention_errors.inc()
        deps.events.emit(policy, "Warning", "RetentionErrors", "; ".join(problems)[:1000])
    return status
