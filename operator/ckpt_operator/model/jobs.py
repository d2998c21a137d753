"""Reading PyTorchJob objects: opt-in, identity, restart chain and lifecycle phase.

Pure functions over the raw JSON the API server returns (``dict``), so the
webhook, the job watcher and the restart planner read a job the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from ckpt_agent.text import STATUS_LIMIT, clean
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jsonpatch import JSONPatchOp, add, apply_patch_in_place, pointer

__all__ = [
    "JobFacts",
    "JobStatusAnnotation",
    "condition",
    "inject_label_patch",
    "job_facts",
    "label_templates_in_place",
    "owner_job_name",
    "parse_time",
    "run_id_of",
    "template_label_ops",
    "unlabelled_replicas",
]

#: Where a PyTorchJob keeps its replica types (each with a pod ``template``).
REPLICA_SPECS: Final = "pytorchReplicaSpecs"


def parse_time(value: object) -> float | None:
    """RFC 3339 (``2024-05-01T10:00:00Z``) → Unix seconds; None for anything else."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def format_time(ts: float, *, precise: bool = False) -> str:
    """Unix seconds → RFC 3339 UTC with a ``Z`` (what Kubernetes writes); ``precise``:
    with milliseconds (the operator's own annotations: backoffs are sub-second)."""
    when = datetime.fromtimestamp(ts, tz=UTC)
    if precise:
        return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(obj: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    """The ``status.conditions`` entry of ``type_`` (None when absent)."""
    status = Body(obj).status
    for cond in status.get("conditions") or ():
        if isinstance(cond, Mapping) and cond.get("type") == type_:
            return cond
    return None


def _is_true(obj: Mapping[str, Any], type_: str) -> bool:
    cond = condition(obj, type_)
    return cond is not None and cond.get("status") == "True"


def run_id_of(job: Mapping[str, Any]) -> str:
    """The job's run id: its ``ckpt.dev/run-id`` annotation, else ``<name>-<uid[:8]>``.

    The fallback is computable from the job alone, by the webhook (from the
    pod's owner reference and the job) and by the watcher, so both agree
    before the watcher has written the annotation; the uid part keeps a new
    job that reuses an old name from resuming the old run's checkpoints.
    Restarts copy the annotation, so the whole chain shares one run id.
    """
    meta = meta_of(job)
    annotations = meta.annotations
    explicit = annotations.get(c.ANN_RUN_ID)
    if isinstance(explicit, str) and explicit:
        return explicit
    uid = str(meta.uid or "")
    name = str(meta.name or "job")
    return f"{name}-{uid[:8]}" if uid else name


def owner_job_name(pod: Mapping[str, Any]) -> str | None:
    """Name of the PyTorchJob controlling ``pod`` (owner reference, else the training label)."""
    meta = meta_of(pod)
    for ref in meta.owner_references:
        if (
            isinstance(ref, Mapping)
            and ref.get("kind") == c.PYTORCHJOB_KIND
            and str(ref.get("apiVersion", "")).startswith(f"{c.PYTORCHJOB_GROUP}/")
        ):
            name = ref.get("name")
            if isinstance(name, str) and name:
                return name
    label = meta.labels.get(c.LABEL_TO_JOB_NAME)
    return label if isinstance(label, str) and label else None


def _int(value: object, default: int = 0) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


@dataclass(frozen=True)
class JobStatusAnnotation:
    """The operator's view of a job, stored as JSON in ``ckpt.dev/status``."""

    state: str
    """``Watching``, ``PolicyMissing``, ``BackingOff``, ``Restarting``, ``Restarted``,
    ``GaveUp``."""
    reason: str = ""
    message: str = ""
    time: str = ""

    def to_json(self) -> str:
        """The annotation's JSON; reason and message through :func:`clean` (``kubectl
        describe`` shows them, and they quote stored ids, reasons and errors)."""
        data = {
            "state": self.state,
            "reason": clean(self.reason, STATUS_LIMIT),
            "message": clean(self.message, STATUS_LIMIT),
        }
        if self.time:
            data["time"] = self.time
        return json.dumps(data, sort_keys=True)

    @classmethod
    def parse(cls, text: object) -> JobStatusAnnotation | None:
        if not isinstance(text, str) or not text:
            return None
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("state"), str):
            return None
        return cls(
            state=data["state"],
            reason=str(data.get("reason", "")),
            message=str(data.get("message", "")),
            time=str(data.get("time", "")),
        )


#: States after which the operator never touches the job again.
TERMINAL_STATES = frozenset({"Restarted", "GaveUp", "AutoResumeDisabled"})

_POISON_SPLIT = re.compile(r"[,\s]+")


@dataclass(frozen=True)
class JobFacts:
    """Everything the operator needs to know about one PyTorchJob."""

    name: str
    namespace: str
    uid: str
    policy: str | None
    auto_resume: bool
    run_id: str
    restart_count: int
    resume_from: str | None
    resume_step: int | None
    poisoned: tuple[str, ...]
    restarted_as: str | None
    restart_decision: Mapping[str, Any] | None
    status: JobStatusAnnotation | None
    created_at: float | None
    deleting: bool
    succeeded: bool
    failed: bool
    failed_at: float | None
    failure_message: str
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def opted_in(self) -> bool:
        return self.policy is not None

    @property
    def handled(self) -> bool:
        """The operator already finished with this job's failure."""
        return self.status is not None and self.status.state in TERMINAL_STATES

    @property
    def needs_recovery(self) -> bool:
        """Failed, opted in to auto-resume, not deleted, not succeeded, not yet handled."""
        return (
            self.opted_in
            and self.auto_resume
            and self.failed
            and not self.succeeded
            and not self.deleting
            and not self.handled
        )


def job_facts(job: Mapping[str, Any]) -> JobFacts:
    """Parse a PyTorchJob body."""
    meta = meta_of(job)
    ann: dict[str, str] = {str(k): str(v) for k, v in meta.annotations.items() if v is not None}
    policy = ann.get(c.ANN_POLICY) or None
    poisoned = tuple(p for p in _POISON_SPLIT.split(ann.get(c.ANN_POISONED, "")) if p)
    decision: Mapping[str, Any] | None = None
    raw_decision = ann.get(c.ANN_RESTART_DECISION)
    if raw_decision:
        try:
            parsed = json.loads(raw_decision)
        except ValueError:
            parsed = None
        decision = parsed if isinstance(parsed, dict) else None
    failed_cond = condition(job, "Failed")
    resume_step_raw = ann.get(c.ANN_RESUME_STEP, "")
    resume_step: int | None = _int(resume_step_raw, -1) if resume_step_raw else None
    if resume_step is not None and resume_step < 0:
        resume_step = None
    return JobFacts(
        name=str(meta.name or ""),
        namespace=str(meta.namespace or ""),
        uid=str(meta.uid or ""),
        policy=policy,
        auto_resume=ann.get(c.ANN_AUTO_RESUME, "").strip().lower() == "true",
        run_id=run_id_of(job),
        restart_count=max(0, _int(ann.get(c.ANN_RESTART_COUNT), 0)),
        resume_from=ann.get(c.ANN_RESUME_FROM) or None,
        resume_step=resume_step,
        poisoned=poisoned,
        restarted_as=ann.get(c.ANN_RESTARTED_AS) or None,
        restart_decision=decision,
        status=JobStatusAnnotation.parse(ann.get(c.ANN_STATUS)),
        created_at=parse_time(meta.creation_timestamp),
        deleting=bool(meta.deletion_timestamp),
        # Trainer v2's TrainJob says ``Complete`` (JobSet's ``Completed``)
        succeeded=_is_true(job, "Succeeded") or _is_true(job, "Complete"),
        failed=_is_true(job, "Failed"),
        failed_at=parse_time((failed_cond or {}).get("lastTransitionTime")),
        failure_message=str((failed_cond or {}).get("message") or ""),
        annotations=ann,
    )


# --------------------------------------------------------------------------- pod template label


def _replica_specs(job: Mapping[str, Any]) -> Mapping[str, Any]:
    specs = Body(job).spec.get(REPLICA_SPECS) or {}
    return specs if isinstance(specs, Mapping) else {}


def unlabelled_replicas(job: Mapping[str, Any]) -> list[str]:
    """Replica types whose pod template lacks ``ckpt.dev/inject: "true"`` (sorted)."""
    missing = []
    for rtype, rspec in _replica_specs(job).items():
        if not isinstance(rspec, Mapping):
            continue
        template = rspec.get("template") or {}
        labels = meta_of(template).labels
        if labels.get(c.LABEL_INJECT) != "true":
            missing.append(str(rtype))
    return sorted(missing)


def inject_label_patch(job: Mapping[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch adding the inject label to every unlabelled pod template (None:
    all carry it)."""
    missing = unlabelled_replicas(job)
    if not missing:
        return None
    label = {"template": {"metadata": {"labels": {c.LABEL_INJECT: "true"}}}}
    return {"spec": {REPLICA_SPECS: {rtype: label for rtype in missing}}}


def template_label_ops(job: Mapping[str, Any]) -> list[JSONPatchOp]:
    """RFC 6902 ops (against ``job``) adding the inject label to every pod template that
    lacks it (empty: all carry it); built without copying the job, so that the
    ``label-job`` webhook can answer with them (issue #19)."""
    label = {c.LABEL_INJECT: "true"}
    ops: list[JSONPatchOp] = []
    for rtype, rspec in _replica_specs(job).items():
        if not isinstance(rspec, dict):
            continue
        at = ("spec", REPLICA_SPECS, str(rtype), "template")
        template = rspec.get("template")
        if "template" not in rspec:
            ops.append(add(pointer(*at), {"metadata": {"labels": label}}))
        elif not isinstance(template, dict):
            continue
        elif "metadata" not in template:
            ops.append(add(pointer(*at, "metadata"), {"labels": label}))
        elif not isinstance(template["metadata"], dict):
            continue
        elif not isinstance(labels := template["metadata"].get("labels"), dict):
            ops.append(add(pointer(*at, "metadata", "labels"), label))
        elif labels.get(c.LABEL_INJECT) != "true":
            ops.append(add(pointer(*at, "metadata", "labels", c.LABEL_INJECT), "true"))
    return ops


def label_templates_in_place(job: dict[str, Any]) -> bool:
    """Add the inject label to every pod template of ``job`` (in place); True when changed."""
    ops = template_label_ops(job)
    apply_patch_in_place(job, ops)
    return bool(ops)
