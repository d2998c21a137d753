"""Manual recovery through the control plane (pure; verification is an injected callable).

A person annotates a failed PyTorchJob (``ckpt recover --job J --step N`` does it)::

    ckpt.dev/recover-step: "N"            # required
    ckpt.dev/recover-by: "alice"          # required: who asks
    ckpt.dev/recover-reason: "loss spike" # required: why
    ckpt.dev/recover-force: "true"        # optional: lift the poisoned/pending exclusions
    ckpt.dev/recover-dry-run: "true"      # optional: report the plan, change nothing

The operator acts on it even after ``GaveUp`` (and past ``maxRestarts``): it plans
the step's checkpoints (:func:`plan_manual`; a weights checkpoint first, else a
heartbeat rebuild), verifies them and restarts the job exactly there as a new pin
(``ckpt.dev/resume-pin``: a new lineage epoch even when the checkpoint was pinned
before), the new job carrying ``recover-by``/``recover-reason`` as the audit. Without
force only a valid checkpoint that is not poisoned is used; a checkpoint marked
corrupted is never used (the agent refuses it). Each request is handled once
(``ckpt.dev/recover-handled`` holds its key); a dry run writes its plan to
``ckpt.dev/recover-plan`` and an Event.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ckpt_agent.decide.recovery import PlanStep, RecoveryPlan, plan_recovery, walk
from ckpt_agent.policy import RecoverySpec
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import JobFacts, job_facts
from ckpt_operator.planners.restart import (
    GiveUp,
    Restart,
    RestartDecision,
    build_restart_job,
    restart_name,
)

__all__ = ["RecoverRequest", "blocked_reason", "parse_request", "pending_request", "plan_manual"]

#: Job states in which a manual request would race a restart already made.
_RESTARTED = frozenset({"Restarting", "Restarted"})


@dataclass(frozen=True)
class RecoverRequest:
    """One manual recovery request, as the annotations state it."""

    step: int
    by: str
    reason: str
    force: bool = False
    dry_run: bool = False

    def key(self) -> str:
        """Its identity (what ``recover-handled`` records)."""
        return json.dumps(asdict(self), sort_keys=True)

    def describe(self) -> str:
        flags = "".join((", forced" if self.force else "", ", dry run" if self.dry_run else ""))
        return f"step {self.step}{flags}, asked by {self.by}: {self.reason}"


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def parse_request(annotations: Mapping[str, str]) -> RecoverRequest | None:
    """The request on a job (None: no ``recover-step``, or one that is not a step number;
    the admission webhook rejects those, see :mod:`ckpt_operator.planners.validation`)."""
    raw = annotations.get(c.ANN_RECOVER_STEP)
    if raw is None or not (raw.isascii() and raw.isdigit()):
        return None
    return RecoverRequest(
        step=int(raw),
        by=annotations.get(c.ANN_RECOVER_BY, "").strip(),
        reason=annotations.get(c.ANN_RECOVER_REASON, "").strip(),
        force=_true(annotations.get(c.ANN_RECOVER_FORCE)),
        dry_run=_true(annotations.get(c.ANN_RECOVER_DRY_RUN)),
    )


def pending_request(facts: JobFacts) -> RecoverRequest | None:
    """A request on ``facts``' job not handled yet (None: none)."""
    if facts.policy is None or facts.deleting:
        return None
    request = parse_request(facts.annotations)
    if request is None or facts.annotations.get(c.ANN_RECOVER_HANDLED) == request.key():
        return None
    return request


def blocked_reason(facts: JobFacts, request: RecoverRequest) -> str | None:
    """Why the request cannot be acted on (None: it can)."""
    if not request.by or not request.reason:
        return (
            f"{c.ANN_RECOVER_BY} and {c.ANN_RECOVER_REASON} are required with "
            f"{c.ANN_RECOVER_STEP}: say who asks and why (ckpt recover --job ... --reason ...)"
        )
    if facts.succeeded:
        return "the job succeeded: nothing to recover"
    if not facts.failed:
        return "the job has not failed: annotate it once it has (or delete it and recover)"
    if facts.status is not None and facts.status.state in _RESTARTED and facts.restarted_as:
        return (
            f"the job was already restarted as {facts.restarted_as}: annotate that job "
            "once it fails (or delete it first)"
        )
    return None


def _usable(r: CheckpointRecord, poisoned: frozenset[str]) -> bool:
    return r.status == CheckpointStatus.VALID and r.id not in poisoned


def plan_manual(
    job: Mapping[str, Any],
    request: RecoverRequest,
    records: Sequence[CheckpointRecord],
    spec: RecoverySpec,
    verify: Callable[[str], bool],
    mtbf_seconds: float | None = None,
) -> Restart | GiveUp:
    """The restart that resumes exactly at ``request.step``, or why there is none.

    The step's checkpoints come from :func:`ckpt_agent.decide.recovery.plan_recovery`
    (``manual_step``, forced); without ``request.force`` only those valid and not
    poisoned (and whose weights source is) are tried. Each is verified.
    """
    facts = job_facts(job)
    poisoned = frozenset(facts.poisoned)
    plan = plan_recovery(records, spec, poisoned=poisoned, manual_step=request.step, force=True)
    usable = {r.id for r in records if _usable(r, poisoned)}

    def allowed(s: PlanStep) -> bool:
        ids = [s.checkpoint_id] + ([s.weights_from] if s.weights_from else [])
        return request.force or all(i in usable for i in ids)

    steps = tuple(s for s in plan.steps if allowed(s))
    chosen, rejected = walk(RecoveryPlan(steps=steps, force=True), verify)
    if chosen is None:
        why = [f"{s.checkpoint_id}: {w}" for s, w in rejected]
        why += [
            f"{s.checkpoint_id}: {plan.skipped.get(s.checkpoint_id, 'not usable')} "
            f"(set {c.ANN_RECOVER_FORCE}=true / --force to use it anyway)"
            for s in plan.steps
            if s not in steps
        ]
        detail = "; ".join(why) or plan.reason
        return GiveUp(
            "ManualRecoverRefused",
            f"cannot resume run {facts.run_id} at step {request.step}: {detail}",
            facts.poisoned,
        )
    decision = RestartDecision(
        name=restart_name(facts.name, facts.restart_count),
        restart_count=facts.restart_count + 1,
        resume_from=chosen.checkpoint_id,
        resume_step=chosen.step,
        action="manual",
        poisoned=tuple(p for p in facts.poisoned if p != chosen.checkpoint_id),
        weights_from=chosen.weights_from,
        reason=f"manual recovery ({request.describe()}): {chosen.reason}",
        mtbf_seconds=mtbf_seconds,
        requested_by=request.by,
        request_reason=request.reason,
    )
    return Restart(decision, build_restart_job(job, decision), skipped=dict(plan.skipped))
