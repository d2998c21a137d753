"""Restart planning for failed PyTorchJobs (pure; verification is an injected callable).

The protocol (``docs/operator.md``, "Restart protocol"):

1. Job ``J`` (run id ``R``, restart count ``k``) reaches ``Failed``.
2. The planner applies ``maxRestarts`` and the exponential backoff, detects a
   crash loop (``J`` was itself a restart from checkpoint ``S`` and wrote
   nothing past ``S``: ``S`` becomes poisoned, unless it fails verification, which
   explains the failure), and walks the recovery ladder
   of :mod:`ckpt_agent.decide.recovery` over ``R``'s checkpoints, verifying each
   candidate through ``verify``.
3. The outcome is a :class:`Restart` carrying the new job ``J-r<k+1>``
   (deterministic name: a ``409 Conflict`` on create means "already done"),
   same spec, ``run-id R``, ``restart-count k+1``, ``resume-from``; or a
   :class:`Wait`, a :class:`GiveUp` (terminal) or a :class:`Skip`.

Everything the planner needs is on the job (annotations) or in storage
(records), so a restarted operator reaches the same decision; once a
decision is written on ``J`` (``ckpt.dev/restart-decision``) it is replayed
verbatim instead of re-planned.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.decide.mtbf import PoolEvidence, estimate_mtbf
from ckpt_agent.decide.recovery import Verdicts, is_poisoned, plan_recovery, walk
from ckpt_agent.policy import RecoverySpec
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_operator.kinds.registry import kind_of
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jobs import JobFacts, job_facts, parse_time
from ckpt_operator.planners.runfacts import run_started_at

__all__ = [
    "GiveUp",
    "LadderStep",
    "PlanRequest",
    "Restart",
    "RestartDecision",
    "RestartOutcome",
    "Skip",
    "Wait",
    "backoff_delay",
    "build_restart_job",
    "crash_loop_checkpoint",
    "plan_restart",
    "precheck_restart",
    "restart_name",
    "run_mtbf",
    "terminating_pods_wait",
]

#: PyTorchJob names must be DNS-1035 labels (the training-operator derives pod names from them).
MAX_JOB_NAME = 63

#: Resolution of ``metadata.creationTimestamp`` (RFC 3339, whole seconds).
CREATION_TIMESTAMP_RESOLUTION_S = 1.0

#: How long past a terminating pod's ``deletionTimestamp`` (request time + grace period)
#: the planner keeps waiting for it: the kubelet needs a moment to report the exit and
#: remove the pod; a pod on a lost node never reports, so waiting must end.
TERMINATION_MARGIN_S = 15.0
#: How often the planner looks again while pods are terminating.
TERMINATION_RECHECK_S = 1.0

#: Annotations never copied onto the restarted job.
_DROP_ANNOTATIONS = frozenset({"kubectl.kubernetes.io/last-applied-configuration"})


def restart_name(name: str, restart_count: int) -> str:
    """``J`` → ``J-r1``; ``J-r1`` (count 1) → ``J-r2``: one suffix per chain, deterministic."""
    base = name
    suffix_old = f"-r{restart_count}"
    if restart_count > 0 and name.endswith(suffix_old):
        base = name[: -len(suffix_old)]
    suffix = f"-r{restart_count + 1}"
    base = base[: MAX_JOB_NAME - len(suffix)].rstrip("-")
    return base + suffix


def backoff_delay(spec: RecoverySpec, restart_count: int) -> float:
    """Seconds to wait after the failure of a job that is restart number ``restart_count``."""
    if spec.backoff_seconds <= 0:
        return 0.0
    exp = min(restart_count, 60)  # 2**60 s is beyond any cap; avoid float overflow
    return float(min(spec.backoff_seconds * (2**exp), spec.max_backoff_seconds))


def crash_loop_checkpoint(
    facts: JobFacts,
    records: Sequence[CheckpointRecord],
    progress: Sequence[tuple[int, float]] = (),
) -> str | None:
    """The checkpoint to poison when ``facts``' job was a restart that never advanced.

    "Advanced" means the run got past the resume step after the job was
    created: a committed checkpoint (any tier) or a heartbeat (``progress``:
    ``(step, time)`` pairs from the heartbeat ring) with a later step.
    """
    if not facts.resume_from:
        return None
    resume_step = facts.resume_step
    if resume_step is None:
        rec = next((r for r in records if r.id == facts.resume_from), None)
        if rec is None:
            return facts.resume_from  # resumed from something that is gone: do not retry it
        resume_step = rec.step
    # creationTimestamp has one-second resolution: the job was really created somewhere in
    # [T, T + 1). The previous run's last heartbeats can fall in that same second (a quick
    # restart); nothing of the new run can (its pod is not even scheduled yet).
    since = (facts.created_at or 0.0) + CREATION_TIMESTAMP_RESOLUTION_S
    reached = [r.step for r in records if r.created_at >= since and r.step > resume_step]
    reached += [step for step, t in progress if t >= since and step > resume_step]
    last = max(reached) if reached else None
    return facts.resume_from if is_poisoned(resume_step, last) else None


def terminating_pods_wait(
    pods: Sequence[Mapping[str, Any]],
    now: float,
    margin_s: float = TERMINATION_MARGIN_S,
) -> tuple[float, float, tuple[str, ...]] | None:
    """``(recheck in, give up waiting in, pod names)`` while the job's pods are terminating.

    The training-operator counts a pod that is being deleted (eviction, drain, preemption)
    as failed right away and marks the job Failed, while the pod is still in its grace
    period, where the agent writes its emergency (SIGTERM) checkpoint. Planning then would
    miss that checkpoint. A terminating pod is one with a ``deletionTimestamp`` whose
    phase is not final; waiting for it ends at its ``deletionTimestamp`` plus
    ``margin_s``. None: nothing to wait for.
    """
    waits: list[float] = []
    names: list[str] = []
    for pod in pods:
        meta = meta_of(pod)
        deadline = parse_time(meta.deletion_timestamp)
        if deadline is None:
            continue
        if Body(pod).status.get("phase") in ("Succeeded", "Failed"):
            continue
        left = deadline + margin_s - now
        if left > 0:
            waits.append(left)
            names.append(str(meta.name))
    if not waits:
        return None
    return min(TERMINATION_RECHECK_S, max(waits)), max(waits), tuple(sorted(names))


@dataclass(frozen=True)
class RestartDecision:
    """What the failed job is restarted as; stored on it as JSON before the create."""

    name: str
    restart_count: int
    resume_from: str | None
    resume_step: int | None
    action: str
    """``resume``, ``rebuild_from_heartbeat``, ``manual`` or ``fresh`` (no checkpoint yet)."""
    poisoned: tuple[str, ...] = ()
    weights_from: str | None = None
    reason: str = ""
    mtbf_seconds: float | None = None
    """The run's MTBF estimate handed to the new job's pods (None: the policy's)."""
    requested_by: str | None = None
    """A manual restart (``ckpt.dev/recover-step``): who asked, and why."""
    request_reason: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "restartCount": self.restart_count,
                "resumeFrom": self.resume_from,
                "resumeStep": self.resume_step,
                "action": self.action,
                "poisoned": list(self.poisoned),
                "weightsFrom": self.weights_from,
                "reason": self.reason,
                "mtbfSeconds": self.mtbf_seconds,
                "requestedBy": self.requested_by,
                "requestReason": self.request_reason,
            },
            sort_keys=True,
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> RestartDecision:
        step = data.get("resumeStep")
        return cls(
            name=str(data["name"]),
            restart_count=int(data["restartCount"]),
            resume_from=data.get("resumeFrom") or None,
            resume_step=int(step) if step is not None else None,
            action=str(data.get("action", "resume")),
            poisoned=tuple(str(p) for p in data.get("poisoned") or ()),
            weights_from=data.get("weightsFrom") or None,
            reason=str(data.get("reason", "")),
            mtbf_seconds=float(mtbf) if (mtbf := data.get("mtbfSeconds")) else None,
            requested_by=data.get("requestedBy") or None,
            request_reason=data.get("requestReason") or None,
        )


@dataclass(frozen=True)
class LadderStep:
    """One rung the planner looked at (for Events)."""

    checkpoint_id: str
    action: str
    rung: int
    step: int
    accepted: bool
    why: str


@dataclass(frozen=True)
class Skip:
    """Nothing to do (not failed, not opted in, succeeded, deleted, already handled)."""

    reason: str


@dataclass(frozen=True)
class Wait:
    """Backoff: try again in ``seconds``."""

    seconds: float
    reason: str


@dataclass(frozen=True)
class GiveUp:
    """Terminal: the job stays failed; ``reason`` is CamelCase for Events and the status."""

    reason: str
    message: str
    poisoned: tuple[str, ...] = ()


@dataclass(frozen=True)
class Restart:
    """Create ``job`` (the restart); ``replay``: the decision was already on the failed job."""

    decision: RestartDecision
    job: dict[str, Any]
    ladder: tuple[LadderStep, ...] = ()
    crash_loop: str | None = None
    replay: bool = False
    skipped: Mapping[str, str] = field(default_factory=dict)


RestartOutcome = Skip | Wait | GiveUp | Restart


@dataclass(frozen=True)
class PlanRequest:
    """What a restart plan reads about the run besides the job itself: the same for a
    PyTorchJob restart (:func:`plan_restart`) and a JobSet restart attempt
    (:func:`ckpt_operator.planners.attempt_plan.plan_attempt`).

    ``records`` are the run's checkpoints (all of them, as listed from the manifests);
    ``verify(checkpoint_id)`` re-checks one candidate (hashes and manifest) and is only
    called when the planner walks the ladder; ``progress`` the run's heartbeats
    ``(step, time)``; ``mtbf_prior_s`` the policy's ``mtbfSeconds``, which the decision
    carries blended with the run's failures and its node pool's, ``mtbf_pool``
    (:func:`ckpt_agent.decide.mtbf.estimate_mtbf`).
    """

    spec: RecoverySpec
    records: Sequence[CheckpointRecord]
    now: float
    verify: Callable[[str], bool]
    progress: Sequence[tuple[int, float]] = ()
    mtbf_prior_s: float | None = None
    mtbf_pool: PoolEvidence | None = None


def build_restart_job(job: Mapping[str, Any], decision: RestartDecision) -> dict[str, Any]:
    """The new job (PyTorchJob or TrainJob): same spec, labels and user annotations, the
    restart recorded."""
    facts = job_facts(job)
    meta = meta_of(job)
    annotations = {
        k: v
        for k, v in meta.annotations.items()
        if k not in c.OPERATOR_JOB_ANNOTATIONS
        and k not in c.RECOVER_REQUEST_ANNOTATIONS
        and k not in _DROP_ANNOTATIONS
        and not k.startswith(c.KOPF_PREFIX + "/")
    }
    annotations.update(
        {
            c.ANN_RUN_ID: facts.run_id,
            c.ANN_RESTART_COUNT: str(decision.restart_count),
            c.ANN_RESTART_OF: facts.name,
        }
    )
    if decision.resume_from:
        annotations[c.ANN_RESUME_FROM] = decision.resume_from
    if decision.resume_step is not None:
        annotations[c.ANN_RESUME_STEP] = str(decision.resume_step)
    if decision.poisoned:
        annotations[c.ANN_POISONED] = ",".join(decision.poisoned)
    if decision.weights_from:
        annotations[c.ANN_RESUME_WEIGHTS] = decision.weights_from
    started = run_started_at(facts)
    if started is not None:
        annotations[c.ANN_RUN_STARTED_AT] = f"{started:.0f}"
    if decision.mtbf_seconds is not None:
        annotations[c.ANN_MTBF_SECONDS] = f"{decision.mtbf_seconds:.6g}"
    if decision.requested_by is not None:  # a manual restart: its own pin, and the audit
        annotations[c.ANN_RESUME_PIN] = decision.name
        annotations[c.ANN_RECOVER_BY] = decision.requested_by
        annotations[c.ANN_RECOVER_REASON] = decision.request_reason or ""
    new_meta: dict[str, Any] = {
        "name": decision.name,
        "namespace": facts.namespace,
        "annotations": annotations,
    }
    if meta.get("labels"):
        new_meta["labels"] = dict(meta["labels"])
    if meta.owner_references:
        new_meta["ownerReferences"] = copy.deepcopy(meta["ownerReferences"])
    body = {
        "apiVersion": job.get("apiVersion") or f"{c.PYTORCHJOB_GROUP}/{c.PYTORCHJOB_VERSION}",
        "kind": job.get("kind") or c.PYTORCHJOB_KIND,
        "metadata": new_meta,
        "spec": copy.deepcopy(job.get("spec") or {}),
    }
    # its pods must reach the (fail-closed) injection webhook whatever the old job carried
    kind_of(body).label_in_place(body)
    return body


def run_mtbf(
    facts: JobFacts, prior_s: float | None, now: float, pool: PoolEvidence | None = None
) -> float | None:
    """The MTBF estimate after this job's failure, with its node ``pool``'s evidence
    (None: no prior known)."""
    if prior_s is None:
        return None
    started = run_started_at(facts)
    failed = facts.failed_at if facts.failed_at is not None else now
    elapsed = failed - started if started is not None else 0.0
    return estimate_mtbf(prior_s, facts.restart_count + 1, elapsed, pool)


def precheck_restart(
    job: Mapping[str, Any], spec: RecoverySpec, now: float
) -> RestartOutcome | None:
    """The outcome when it needs no storage (skip, give up, wait, replay); None: walk the ladder."""
    facts = job_facts(job)
    if not facts.opted_in or not facts.auto_resume:
        return Skip("not opted in to auto-resume")
    if facts.deleting:
        return Skip("the job is being deleted")
    if facts.succeeded:
        return Skip("the job succeeded")
    if not facts.failed:
        return Skip("the job has not failed")
    if facts.handled:
        assert facts.status is not None
        return Skip(f"already handled ({facts.status.state})")
    if not spec.auto_resume:
        return GiveUp("AutoResumeDisabled", "the policy disables auto-resume (recovery.autoResume)")

    # A decision already written on the job: replay it exactly (operator crashed mid-restart).
    if facts.restarted_as and facts.restart_decision is not None:
        try:
            decision = RestartDecision.from_mapping(facts.restart_decision)
        except (KeyError, TypeError, ValueError):
            decision = None
        if decision is not None and decision.name == facts.restarted_as:
            return Restart(decision, build_restart_job(job, decision), replay=True)

    if facts.restart_count >= spec.max_restarts:
        return GiveUp(
            "MaxRestartsExceeded",
            f"run {facts.run_id} was restarted {facts.restart_count} time(s); "
            f"recovery.maxRestarts is {spec.max_restarts}",
        )

    delay = backoff_delay(spec, facts.restart_count)
    due = (facts.failed_at if facts.failed_at is not None else now) + delay
    if now < due:
        return Wait(due - now, f"backoff {delay:.0f}s after restart #{facts.restart_count}")

    return None


def _fails(verdicts: Verdicts, cid: str, records: Sequence[CheckpointRecord]) -> bool:
    """Whether ``cid``, listed valid in ``records``, fails verification: a run that crashed
    on a corrupted checkpoint is explained (a pod's verdict, when the operator plans from the
    pods' reports), and the ladder keeps the checkpoint's place (its chain, the newest full)
    rejecting it, as it would had the operator found the corruption itself."""
    if not any(r.id == cid and r.status == CheckpointStatus.VALID for r in records):
        return False
    return not verdicts(cid)[0]


def plan_restart(job: Mapping[str, Any], request: PlanRequest) -> RestartOutcome:
    """Decide what to do about a (possibly) failed job; see the module docstring and
    :class:`PlanRequest` for what it reads."""
    spec, records, now, verify = request.spec, request.records, request.now, request.verify
    progress, mtbf_prior_s, mtbf_pool = request.progress, request.mtbf_prior_s, request.mtbf_pool
    early = precheck_restart(job, spec, now)
    if early is not None:
        return early
    facts = job_facts(job)
    poisoned = list(facts.poisoned)
    verdicts = Verdicts(verify)  # each checkpoint asked once, by the crash check and the walk
    crash = crash_loop_checkpoint(facts, records, progress)
    if crash is not None and _fails(verdicts, crash, records):
        crash = None  # explained: the ladder rejects it where it stands, not poisoned
    if crash is not None and crash not in poisoned:
        poisoned.append(crash)

    name = restart_name(facts.name, facts.restart_count)
    mtbf = run_mtbf(facts, mtbf_prior_s, now, mtbf_pool)
    if not records:
        if facts.resume_from:
            return GiveUp(
                "CheckpointsGone",
                f"run {facts.run_id} resumed from {facts.resume_from} but storage now lists "
                "no checkpoints; refusing to restart from scratch",
                tuple(poisoned),
            )
        decision = RestartDecision(
            name=name,
            restart_count=facts.restart_count + 1,
            resume_from=None,
            resume_step=None,
            action="fresh",
            poisoned=tuple(poisoned),
            reason="no checkpoint written yet: restarting from the beginning",
            mtbf_seconds=mtbf,
        )
        return Restart(decision, build_restart_job(job, decision), crash_loop=crash)

    plan = plan_recovery(records, spec, poisoned=poisoned)
    chosen, rejected = walk(plan, verify, verdicts)
    ladder = [
        LadderStep(s.checkpoint_id, s.action, s.rung, s.step, False, why) for s, why in rejected
    ]
    if chosen is None:
        tried = "; ".join(f"{s.checkpoint_id}: {why}" for s, why in rejected)
        message = f"recovery ladder exhausted for run {facts.run_id}: {plan.reason}"
        if tried:
            message += f" (tried {tried})"
        return GiveUp("LadderExhausted", message, tuple(poisoned))
    ladder.append(
        LadderStep(
            chosen.checkpoint_id, chosen.action, chosen.rung, chosen.step, True, chosen.reason
        )
    )
    decision = RestartDecision(
        name=name,
        restart_count=facts.restart_count + 1,
        resume_from=chosen.checkpoint_id,
        resume_step=chosen.step,
        action=chosen.action,
        poisoned=tuple(poisoned),
        weights_from=chosen.weights_from,
        reason=chosen.reason,
        mtbf_seconds=mtbf,
    )
    return Restart(
        decision,
        build_restart_job(job, decision),
        ladder=tuple(ladder),
        crash_loop=crash,
        skipped=dict(plan.skipped),
    )
