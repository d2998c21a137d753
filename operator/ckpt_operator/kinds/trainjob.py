"""The TrainJob kind (Kubeflow Trainer v2, ``trainer.kubeflow.org/v1alpha1``, on JobSet).

What Trainer v2 (v2.3) and JobSet (v0.12) do, as the operator relies on it:

* the TrainJob's JobSet has the TrainJob's name and a controller owner reference to it;
  JobSet labels (and annotates) every Job and pod with ``jobset.sigs.k8s.io/jobset-name``
  (so: the TrainJob's name) and ``jobset.sigs.k8s.io/restart-attempt`` (the JobSet's
  ``status.restarts`` when the pod was made: a JobSet restart, ``failurePolicy``, recreates
  every pod with the next number);
* the TrainJob's own labels and annotations reach neither the JobSet nor the pods; its
  ``spec.runtimePatches`` (one entry per ``manager``, made for admission webhooks) may
  label the pod templates of the runtime's replicated Jobs, by name. The operator's
  ``label-job`` webhook adds its entry (manager ``ckpt.dev/operator``) for the runtime's
  trainer Jobs, so every training pod carries ``ckpt.dev/inject`` and reaches the
  fail-closed pod webhook;
* the TrainJob gets ``Failed`` when its JobSet failed (JobSet gave up: its ``maxRestarts``
  spent) and ``Complete`` when it completed.

The restart attempts (the operator's side of a JobSet restart) are planned by
:mod:`ckpt_operator.planners.attempt_plan`; this module only reads the objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jobs import parse_time

__all__ = [
    "TRAINJOB",
    "add_inject_patch",
    "has_inject_patch",
    "jobset_restarts",
    "jobset_trainjob",
    "planned_attempt",
    "pod_attempt",
    "pod_ended_at",
    "restart_expected_until",
    "runtime_ref",
    "trainer_replicated_jobs",
]


def _int(value: object, default: int = 0) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def runtime_ref(trainjob: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(kind, name)`` of the runtime ``spec.runtimeRef`` names (kind defaults to
    ``ClusterTrainingRuntime``, as in Trainer); None: none named, or not a Trainer runtime."""
    ref = Body(trainjob).spec.get("runtimeRef") or {}
    name = ref.get("name") if isinstance(ref, Mapping) else None
    if not isinstance(name, str) or not name:
        return None
    group = ref.get("apiGroup") or c.TRAINJOB_GROUP
    kind = ref.get("kind") or c.CLUSTER_TRAINING_RUNTIME_KIND
    if group != c.TRAINJOB_GROUP or kind not in (
        c.CLUSTER_TRAINING_RUNTIME_KIND,
        c.TRAINING_RUNTIME_KIND,
    ):
        return None
    return str(kind), name


def trainer_replicated_jobs(runtime: Mapping[str, Any]) -> list[str]:
    """The runtime's replicated Jobs that train: those labelled
    ``trainer.kubeflow.org/trainjob-ancestor-step: trainer``; when none is, those with a
    ``node`` container; else all of them (never the initializers when they are labelled)."""
    rjobs = Body(Body(runtime).spec.get("template")).spec.get("replicatedJobs") or []
    named = [r for r in rjobs if isinstance(r, Mapping) and r.get("name")]

    def ancestor(r: Mapping[str, Any]) -> str | None:
        labels = meta_of(r.get("template")).labels
        value = labels.get(c.LABEL_TRAINER_ANCESTOR)
        return str(value) if value is not None else None

    def containers(r: Mapping[str, Any]) -> list[str]:
        job_template = Body(r.get("template"))  # a JobTemplateSpec, whose spec has the pods'
        pod_spec = Body(job_template.spec.get("template")).spec
        return [str(ctr.get("name")) for ctr in pod_spec.get("containers") or ()]

    trainers = [str(r["name"]) for r in named if ancestor(r) == c.TRAINER_ANCESTOR_TRAINER]
    if trainers:
        return trainers
    if any(ancestor(r) is not None for r in named):
        return []
    nodes = [str(r["name"]) for r in named if c.TRAINJOB_CONTAINER in containers(r)]
    return nodes or [str(r["name"]) for r in named]


def _patches(trainjob: Mapping[str, Any]) -> list[Any]:
    patches = Body(trainjob).spec.get("runtimePatches") or []
    return patches if isinstance(patches, list) else []


def has_inject_patch(trainjob: Mapping[str, Any]) -> bool:
    """The TrainJob carries the operator's runtime patch (its pods get ``ckpt.dev/inject``)."""
    return any(
        isinstance(p, Mapping) and p.get("manager") == c.RUNTIME_PATCH_MANAGER
        for p in _patches(trainjob)
    )


def add_inject_patch(trainjob: dict[str, Any], replicated_jobs: list[str]) -> bool:
    """Append the operator's runtime patch labelling ``replicated_jobs``' pod templates with
    ``ckpt.dev/inject: "true"`` (in place); True when added (False: present, or no Job)."""
    if has_inject_patch(trainjob) or not replicated_jobs:
        return False
    label = {"metadata": {"labels": {c.LABEL_INJECT: "true"}}}
    entry = {
        "manager": c.RUNTIME_PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": name, "template": {"spec": {"template": label}}}
                        for name in replicated_jobs
                    ]
                }
            }
        },
    }
    spec = trainjob.setdefault("spec", {})
    spec["runtimePatches"] = [*_patches(trainjob), entry]
    return True


def _unlabelled(trainjob: Mapping[str, Any]) -> list[str]:
    return [] if has_inject_patch(trainjob) else ["spec.runtimePatches"]


def _no_patch(_trainjob: Mapping[str, Any]) -> dict[str, Any] | None:
    # The runtime's Job names are needed (the label-job webhook reads the runtime), and
    # Trainer keeps runtime patches of a started TrainJob: the label comes at creation.
    return None


def _copied(_trainjob: dict[str, Any]) -> bool:
    # A restart copies the spec, the operator's runtime patch included.
    return False


def pod_attempt(pod: Mapping[str, Any]) -> int:
    """The JobSet restart attempt the pod belongs to (its ``restart-attempt`` label; 0)."""
    meta = meta_of(pod)
    raw = meta.labels.get(c.LABEL_JOBSET_RESTART_ATTEMPT)
    if raw is None:
        raw = meta.annotations.get(c.LABEL_JOBSET_RESTART_ATTEMPT)
    return max(0, _int(raw, 0))


def planned_attempt(annotations: Mapping[str, str]) -> int:
    """The JobSet restart attempt the operator planned last (``ckpt.dev/restart-attempt``)."""
    return max(0, _int(annotations.get(c.ANN_RESTART_ATTEMPT), 0))


#: How long after a pod of the planned attempt failed or started terminating the operator
#: keeps asking for the JobSet's restart (JobSet restarts at once; its Jobs may first retry
#: a pod, ``backoffLimit``).
RESTART_PROBE_S: Final = 120.0


def pod_ended_at(pod: Mapping[str, Any]) -> float | None:
    """When a pod failed or started terminating (None: it runs, or it succeeded)."""
    meta = meta_of(pod)
    deleting = parse_time(meta.deletion_timestamp)
    status = Body(pod).status
    if status.get("phase") != "Failed":
        return deleting
    times: list[float | None] = [deleting]
    for cs in status.get("containerStatuses") or ():
        times.append(
            parse_time(((cs.get("state") or {}).get("terminated") or {}).get("finishedAt"))
        )
    known = [t for t in times if t is not None]
    return max(known) if known else parse_time(meta.creation_timestamp)


def restart_expected_until(pods: Iterable[Mapping[str, Any]], planned: int) -> float | None:
    """Until when a JobSet restart is to be expected: :data:`RESTART_PROBE_S` after the last
    pod of attempt ``planned`` failed or started terminating; None: none did."""
    ended = [
        t for pod in pods if pod_attempt(pod) == planned and (t := pod_ended_at(pod)) is not None
    ]
    return max(ended) + RESTART_PROBE_S if ended else None


def jobset_restarts(jobset: Mapping[str, Any]) -> int:
    """The JobSet's ``status.restarts`` (its current restart attempt)."""
    return max(0, _int(Body(jobset).status.get("restarts"), 0))


def jobset_trainjob(jobset: Mapping[str, Any]) -> str | None:
    """The TrainJob controlling ``jobset`` (its controller owner reference), else None."""
    for ref in meta_of(jobset).owner_references:
        if (
            isinstance(ref, Mapping)
            and ref.get("kind") == c.TRAINJOB_KIND
            and str(ref.get("apiVersion", "")).startswith(f"{c.TRAINJOB_GROUP}/")
            and ref.get("controller")
        ):
            name = ref.get("name")
            if isinstance(name, str) and name:
                return name
    return None


TRAINJOB: Final = JobKind(
    kind=c.TRAINJOB_KIND,
    group=c.TRAINJOB_GROUP,
    version=c.TRAINJOB_VERSION,
    plural=c.TRAINJOB_PLURAL,
    pod_job_label=c.LABEL_JOBSET_NAME,
    unlabelled=_unlabelled,
    label_patch=_no_patch,
    label_in_place=_copied,
    default_container=c.TRAINJOB_CONTAINER,
)
