"""No silent fresh starts: pods whose training code never started the agent (pure).

The webhook injects the agent's configuration into every pod of an opted-in
job, but only training code that calls :class:`ckpt_agent.Checkpointer` writes
checkpoints. A pod that has been running for ``spec.agent.reportDeadlineSeconds``
while its run shows nothing newer than the pod's start (no heartbeat, no
checkpoint in storage) is *silent*: auto-resume would restart it from step 0.
:func:`silent_pods` finds them; the behaviour (:mod:`ckpt_operator.behaviours.agentcheck`)
posts a Warning Event on the job and a condition on the policy.

When the operator cannot read the storage (a PVC mounted in the pods only), it has two
signals. The agent serves its metrics port from the start of ``start()``: a probe of it
(:mod:`ckpt_operator.adapters.agentprobe`; :func:`probe_target` says where) that is refused means
no agent, while a timeout or an unreachable pod (a NetworkPolicy) means nothing. And the
agent writes its checkpoint report at ``start()`` into the termination message, which the
kubelet shows once a container has ended. :func:`unreported_pods` flags running pods
without a report whose port refused the probe, or whose containers ended at least once
(restarted in place) while the probe could not tell; a pod whose agent answers is fine.

What a refusal proves: only that nothing listened at that moment. A process that is
still starting (a large image just pulled, torch imported on a loaded node, a model
built before ``start()``) refuses too. So the deadline counts from the start of the
pod's current processes (the newest running container's ``startedAt``, not the pod's
``startTime``, which precedes the image pull), and a refusal is proof of absence only
when the same processes have never answered and their port has refused on every probe
for at least one more deadline (``refused_since``): the agent had the deadline to come
up, then the deadline again while the operator already suspected it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from ckpt_agent.policy.agent_config import ENV_METRICS_PORT
from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.kinds.registry import owner_of
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jobs import parse_time

__all__ = [
    "AGENT_MISSING",
    "Presence",
    "ProbeResult",
    "SilentPod",
    "overdue_unreported",
    "probe_target",
    "processes_started",
    "restarts",
    "running_injected_pods",
    "silent_pods",
    "unreported_pods",
]

#: What the Event and the condition say.
AGENT_MISSING = (
    "training code does not use the ckpt agent; auto-resume would restart from step 0 "
    "(call Checkpointer(...).start() and .step(...) in the training loop: see the README)"
)


class Presence(StrEnum):
    """What a probe of a pod's agent metrics port found."""

    SERVING = "serving"
    """The agent's metrics answered."""
    ABSENT = "absent"
    """The pod refused the connection: nothing listens on the agent's port (now: proof of
    absence only once refusals span a deadline, :func:`unreported_pods`)."""
    UNKNOWN = "unknown"
    """No verdict: a timeout, an unreachable pod, something else on the port."""


@dataclass(frozen=True)
class ProbeResult:
    presence: Presence
    detail: str
    """What happened, for the Event and the log (``10.0.3.7:9400 refused the connection``)."""


@dataclass(frozen=True)
class SilentPod:
    """A running injected pod whose run shows no sign of the agent since it started."""

    pod: str
    job: str
    run_id: str
    running_s: float
    kind: JobKind = PYTORCHJOB
    """The job's kind (a TrainJob's pods name it by their JobSet)."""
    evidence: str = ""
    """Besides the missing heartbeats and reports: what the probe found (or empty)."""


def probe_target(pod: Mapping[str, Any]) -> tuple[str, int] | None:
    """Where the pod's agent serves its metrics: the pod IP and the injected container port
    ``ckpt-metrics`` (else a container's ``CKPT_METRICS_PORT``); None when the pod has no
    IP yet or the agent's server is off (port 0)."""
    ip = Body(pod).status.get("podIP")
    containers = Body(pod).spec.get("containers") or ()
    port = next(
        (
            p.get("containerPort")
            for ctr in containers
            for p in ctr.get("ports") or ()
            if p.get("name") == c.METRICS_PORT_NAME
        ),
        None,
    )
    if port is None:
        port = next(
            (
                e.get("value")
                for ctr in containers
                for e in ctr.get("env") or ()
                if e.get("name") == ENV_METRICS_PORT
            ),
            None,
        )
    try:
        number = int(port) if port is not None else 0
    except (TypeError, ValueError):
        return None
    if not ip or not 0 < number < 65536:
        return None
    return str(ip), number


def running_injected_pods(
    pods: Iterable[Mapping[str, Any]], namespace: str, policy: str
) -> list[Mapping[str, Any]]:
    """The injected pods of ``policy``'s jobs in ``namespace`` that are running."""
    out = []
    for pod in pods:
        meta = meta_of(pod)
        ann = meta.annotations
        if meta.namespace != namespace or ann.get(c.ANN_POLICY) != policy:
            continue
        if Body(pod).status.get("phase") == "Running" and not meta.deletion_timestamp:
            out.append(pod)
    return out


def _overdue(
    pod: Mapping[str, Any], now: float, deadline_s: float
) -> tuple[SilentPod, float] | None:
    """The pod as a :class:`SilentPod` and its start, when it has a run id and its current
    processes have run for at least ``deadline_s`` (:func:`processes_started`); else None."""
    meta = meta_of(pod)
    started = processes_started(pod)
    run_id = meta.annotations.get(c.ANN_RUN_ID)
    if deadline_s <= 0 or started is None or not run_id or now - started < deadline_s:
        return None
    owner = owner_of(pod)
    kind, job = owner if owner is not None else (PYTORCHJOB, "")
    silent = SilentPod(str(meta.name), job, str(run_id), now - started, kind)
    return silent, started


def processes_started(pod: Mapping[str, Any]) -> float | None:
    """When the pod's current processes started: the newest ``state.running.startedAt`` of
    its containers (the kubelet sets it once the image is there and the process runs; a
    container restarted in place is a new process), else the pod's ``startTime``, else its
    creation; None when it has none of them."""
    status = Body(pod).status
    running = [
        t
        for cs in status.get("containerStatuses") or ()
        if (t := parse_time(((cs.get("state") or {}).get("running") or {}).get("startedAt")))
        is not None
    ]
    if running:
        return max(running)
    return parse_time(status.get("startTime")) or parse_time(meta_of(pod).creation_timestamp)


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
    status = Body(pod).status
    return any(
        (cs.get(state) or {}).get("terminated")
        for cs in status.get("containerStatuses") or ()
        for state in ("state", "lastState")
    )


def restarts(pod: Mapping[str, Any]) -> int:
    """How often the pod's containers restarted (summed): a new process may lack the agent."""
    statuses = Body(pod).status.get("containerStatuses") or ()
    return sum(int(cs.get("restartCount") or 0) for cs in statuses)


def overdue_unreported(
    pods: Iterable[Mapping[str, Any]], reported: Collection[str], now: float, deadline_s: float
) -> list[Mapping[str, Any]]:
    """The pods running for longer than ``deadline_s`` that left no checkpoint report
    (``reported``: the names of the pods that did): the ones worth a probe."""
    return [
        p
        for p in pods
        if _overdue(p, now, deadline_s) is not None and str(meta_of(p).name) not in reported
    ]


def unreported_pods(
    pods: Iterable[Mapping[str, Any]],
    reported: Collection[str],
    now: float,
    deadline_s: float,
    probes: Mapping[str, ProbeResult] | None = None,
    refused_since: Mapping[str, float] | None = None,
) -> list[SilentPod]:
    """For storage the operator cannot read: pods whose current processes have run for
    longer than ``deadline_s`` without a checkpoint report (``reported``: the names of the
    pods that did) whose agent port has refused the probe (``probes`` by pod name) on every
    probe since ``refused_since[pod]`` (the first refusal of the same processes; none:
    this one) and that for ``deadline_s`` at least, or whose containers ended at least once
    while the probe could not tell. A pod whose agent serves is never silent."""
    out: list[SilentPod] = []
    for pod in pods:
        overdue = _overdue(pod, now, deadline_s)
        if overdue is None or overdue[0].pod in reported:
            continue
        probe = (probes or {}).get(overdue[0].pod)
        presence = probe.presence if probe is not None else Presence.UNKNOWN
        if presence is Presence.ABSENT:
            refusing_s = now - (refused_since or {}).get(overdue[0].pod, now)
            if refusing_s >= deadline_s:
                assert probe is not None
                evidence = f"{probe.detail} on every probe for {refusing_s:.0f}s"
                out.append(replace(overdue[0], evidence=evidence))
        elif presence is Presence.UNKNOWN and _ended_once(pod):
            evidence = "" if probe is None else probe.detail
            out.append(replace(overdue[0], evidence=evidence))
    return out
