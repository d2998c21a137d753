"""No silent fresh starts: pods whose training code never started the agent (pure).

The webhook injects the agent's configuration into every pod of an opted-in
job, but only training code that calls :class:`ckpt_agent.Checkpointer` writes
checkpoints. A pod that has been running for ``spec.agent.reportDeadlineSeconds``
while its run shows nothing newer than the pod's start (no heartbeat, no
checkpoint in storage) is *silent*: auto-resume would restart it from step 0.
:func:`silent_pods` finds them; the behaviour (:mod:`ckpt_operator.behaviours.agentcheck`)
posts a Warning Event on the job and a condition on the policy.

When the operator cannot read the storage (a PVC mounted in the pods only), the pods'
termination messages are what it has: the agent writes its checkpoint report at
``start()``, and the kubelet shows it once a container has ended. :func:`unreported_pods`
flags running pods whose containers ended at least once (restarted in place) without a
report; a pod whose container never ended tells nothing yet (no verdict).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_operator import constants as c
from ckpt_operator.jobkinds import PYTORCHJOB, JobKind, owner_of
from ckpt_operator.jobs import parse_time

__all__ = [
    "AGENT_MISSING",
    "SilentPod",
    "running_injected_pods",
    "silent_pods",
    "unreported_pods",
]

#: What the Event and the condition say.
AGENT_MISSING = (
    "training code does not use the ckpt agent; auto-resume would restart from step 0 "
    "(call Checkpointer(...).start() and .step(...) in the training loop: see the README)"
)


@dataclass(frozen=True)
class SilentPod:
    """A running injected pod whose run shows no sign of the agent since it started."""

    pod: str
    job: str
    run_id: str
    running_s: float
    kind: JobKind = PYTORCHJOB
    """The job's kind (a TrainJob's pods name it by their JobSet)."""


def running_injected_pods(
    pods: Iterable[Mapping[str, Any]], namespace: str, policy: str
) -> list[Mapping[str, Any]]:
    """The injected pods of ``policy``'s jobs in ``namespace`` that are running."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if meta.get("namespace") != namespace or ann.get(c.ANN_POLICY) != policy:
            continue
        if (pod.get("status") or {}).get("phase") == "Running" and not meta.get(
            "deletionTimestamp"
        ):
            out.append(pod)
    return out


def _overdue(
    pod: Mapping[str, Any], now: float, deadline_s: float
) -> tuple[SilentPod, float] | None:
    """The pod as a :class:`SilentPod` and its start, when it has a run id and has run
    for at least ``deadline_s``; else None."""
    meta = pod.get("metadata") or {}
    started = parse_time((pod.get("status") or {}).get("startTime")) or parse_time(
        meta.get("creationTimestamp")
    )
    run_id = (meta.get("annotations") or {}).get(c.ANN_RUN_ID)
    if deadline_s <= 0 or started is None or not run_id or now - started < deadline_s:
        return None
    owner = owner_of(pod)
    kind, job = owner if owner is not None else (PYTORCHJOB, "")
    silent = SilentPod(str(meta.get("name")), job, str(run_id), now - started, kind)
    return silent, started


def silent_pods(
    pods: Iterable[Mapping[str, Any]],
    activity: Mapping[str, Sequence[float]],
    now: float,
    deadline_s: float,
) -> list[SilentPod]:
    """Pods running for longer than ``deadline_s`` whose run (``ckpt.dev/run-id``) has no
    ``activity`` (times of heartbeats and checkpoints) since the pod started."""
    out: list[SilentPod] = []
    for pod in pods:
        overdue = _overdue(pod, now, deadline_s)
        if overdue is None:
            continue
        silent, started = overdue
        if not any(t >= started for t in activity.get(silent.run_id, ())):
            out.append(silent)
    return out


def _ended_once(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return any(
        (cs.get(state) or {}).get("terminated")
        for cs in status.get("containerStatuses") or ()
        for state in ("state", "lastState")
    )


def unreported_pods(
    pods: Iterable[Mapping[str, Any]],
    reported: Collection[str],
    now: float,
    deadline_s: float,
) -> list[SilentPod]:
    """For storage the operator cannot read: pods running for longer than ``deadline_s``
    whose containers ended at least once and none of which left a checkpoint report
    (``reported``: the names of the pods that did)."""
    out: list[SilentPod] = []
    for pod in pods:
        overdue = _overdue(pod, now, deadline_s)
        if overdue is not None and overdue[0].pod not in reported and _ended_once(pod):
            out.append(overdue[0])
    return out
