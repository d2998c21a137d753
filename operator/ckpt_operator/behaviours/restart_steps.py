"""The steps a restart shares, for a failed PyTorchJob (:mod:`.recovery`) and a TrainJob's
JobSet restart attempt (:mod:`.attempts`) alike: the policy, the failed job's pods and
their reports, the run's checkpoints (its storage, or the pods' reports where the storage
is not reachable here), the plan's inputs, giving up, and the Events of a plan."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_agent.decide.mtbf import PoolEvidence
from ckpt_agent.policy import CheckpointPolicySpec, StorageType
from ckpt_agent.records import CheckpointRecord
from ckpt_operator.adapters.sources import (
    CheckpointSource,
    GrantEscapeError,
    ReportedCheckpointSource,
    StorageAccessDeniedError,
)
from ckpt_operator.behaviours.deps import (
    Deps,
    Obj,
    annotate_job,
    cached_policy,
    set_job_status,
)
from ckpt_operator.behaviours.guard import run_access, storage_call
from ckpt_operator.kinds.registry import kind_of
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jobs import (
    job_facts,
)
from ckpt_operator.planners.attempt_plan import planning_view
from ckpt_operator.planners.pools import node_names
from ckpt_operator.planners.reports import (
    KnownCheckpoints,
    known_checkpoints,
    last_verified_json,
    pod_reports,
)
from ckpt_operator.planners.restart import (
    LadderStep,
    PlanRequest,
    RestartDecision,
    terminating_pods_wait,
)
from ckpt_operator.planners.validation import parse_policy_spec

__all__ = [
    "PlanInputs",
    "gather_plan_inputs",
    "give_up",
    "job_pods",
    "job_ref",
    "load_policy_spec",
    "report_plan",
    "report_rebuild",
    "run_checkpoints",
    "take_reports",
    "wait_for_terminating_pods",
]

log = logging.getLogger(__name__)


def job_ref(job: Mapping[str, Any]) -> str:
    meta = meta_of(job)
    return f"{meta.namespace}/{meta.name}"


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


async def run_checkpoints(
    deps: Deps, job: Mapping[str, Any], spec: CheckpointPolicySpec, known: KnownCheckpoints
) -> tuple[CheckpointSource, list[CheckpointRecord]] | None:
    """Where the run's checkpoints are read (its storage, or the pods' reports when the
    storage is not reachable here) and what it lists; None: gave up (the storage refused,
    a link out of the grant, the run is another namespace's, or a legacy run nobody
    claimed: never restarted from)."""
    facts = job_facts(job)
    reported = ReportedCheckpointSource(known.report.records())
    assert facts.policy is not None
    source: CheckpointSource
    try:
        source = await deps.sources(facts.namespace, facts.policy, spec)
    except StorageAccessDeniedError as e:
        if spec.storage.type != StorageType.LOCAL or isinstance(e, GrantEscapeError):
            await give_up(deps, job, "StorageAccessDenied", str(e))
            return None
        # a PVC or node path of the namespace: the pods' reports need no access
        log.info("%s: %s; planning with the pods' reports", job_ref(job), e)
        source = reported
    if not await storage_call(deps, source.reachable):
        log.info("%s: storage not reachable here; using the pods' reports", job_ref(job))
        source = reported
    # the pods' reports: their agents check the owner at start (never a legacy run either)
    access = (
        None
        if source is reported
        else await run_access(deps, source, facts.run_id, facts.namespace)
    )
    if access is not None and access.refusal is not None:
        await give_up(deps, job, "RunOwnedElsewhere", access.refusal)
        return None
    records = await storage_call(deps, source.list_checkpoints, facts.run_id)
    unclaimed = None if access is None else access.unclaimed(records)
    if unclaimed is not None:
        await give_up(deps, job, "LegacyRunUnclaimed", unclaimed)
        return None
    if not records and reported.records:  # the storage here is not the pods'
        log.info("%s: storage lists no checkpoint; using the pods' reports", job_ref(job))
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
    phase = Body(pod).status.get("phase")
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
        log.info("%s: %s", job_ref(job), problem)
    known = known_checkpoints(facts.run_id, [facts.annotations.get(c.ANN_CHECKPOINTS)], reports)
    for problem in known.problems:
        log.warning("%s: %s", job_ref(job), problem)
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

    def request(self, spec: CheckpointPolicySpec, now: float) -> PlanRequest:
        """What the restart planner reads, under ``spec`` at ``now``."""
        return PlanRequest(
            spec.recovery,
            self.records,
            now,
            self.verify,
            self.progress,
            spec.scheduler.risk.mtbf_seconds,
            self.pool,
        )


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
