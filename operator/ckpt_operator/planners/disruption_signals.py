"""Disruption detection → "save now" signals (pure).

A pod about to be stopped should take an emergency checkpoint first. The
watchers call these functions on every pod/node event and patch the pods
they return:

* pod: a ``DisruptionTarget`` condition with status ``True`` (eviction,
  preemption, taint-manager deletion, kubelet shutdown), or a
  ``deletionTimestamp`` (deletion started; the kubelet sends SIGTERM too,
  which the agent also handles);
* Kueue: the job's Workload evicted (``Evicted=True``: preemption, a quota change, a
  ``waitForPodsReady`` timeout; :func:`preemption_disruption`), before the job is suspended
  and its pods get SIGTERM;
* node: cordoned (``spec.unschedulable``) or tainted as about to go away
  (see :data:`DISRUPTION_TAINTS`), ``NotReady``, or under memory, disk or PID
  pressure (see :data:`PRESSURE_CONDITIONS`).

The signal is the pod annotation ``ckpt.dev/save-now`` (a request id),
mounted into the pod by the webhook as ``$CKPT_SIGNAL_FILE`` through a
downward-API volume. The request id is derived from what triggered it, so
repeated events for the same disruption produce the same id and no new patch
(idempotent), while a new disruption gets a new id.

The content says what kind of request it is (:mod:`ckpt_agent.format.signal`):
the pod's own disruption is a plain save-now (an emergency checkpoint); every
node disruption is a *warning* (the agent saves once and sizes its interval for
a higher failure hazard while it holds), and a calm node again *clears* the
warning its pods hold (the interval relaxes ``risk.warningHoldSeconds`` later).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ckpt_agent.format.signal import KIND_CLEAR, KIND_WARNING, compose_signal, parse_signal
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.planners.workload import (
    Eviction,
)

__all__ = [
    "DISRUPTION_TAINTS",
    "PREEMPTION",
    "PRESSURE_CONDITIONS",
    "Disruption",
    "clear_patch",
    "node_disruption",
    "pod_disruption",
    "preemption_disruption",
    "save_now_patch",
]

#: The reason of every save-now request for a Kueue eviction (Kueue's own reason is in the
#: message: the metric label stays one fixed value).
PREEMPTION: Final = "Preemption"

#: Node conditions that warn while ``True`` (the kubelet sets them; they evict pods next).
PRESSURE_CONDITIONS: Mapping[str, str] = {
    "MemoryPressure": "NodeMemoryPressure",
    "DiskPressure": "NodeDiskPressure",
    "PIDPressure": "NodePIDPressure",
}

#: Taint keys that announce a node going away (drain tooling, autoscalers, clouds).
DISRUPTION_TAINTS: Mapping[str, str] = {
    "node.kubernetes.io/unschedulable": "NodeCordoned",
    "node.kubernetes.io/out-of-service": "NodeOutOfService",
    "node.cloudprovider.kubernetes.io/shutdown": "NodeShutdown",
    "ToBeDeletedByClusterAutoscaler": "ClusterAutoscalerScaleDown",
    "DeletionCandidateOfClusterAutoscaler": "ClusterAutoscalerCandidate",
    "karpenter.sh/disrupted": "KarpenterDisruption",
    "karpenter.sh/disruption": "KarpenterDisruption",
    "cloud.google.com/impending-node-termination": "GCEImpendingTermination",
    "aws-node-termination-handler/spot-itn": "AWSSpotInterruption",
    "aws-node-termination-handler/scheduled-maintenance": "AWSScheduledMaintenance",
    "aws-node-termination-handler/rebalance-recommendation": "AWSRebalanceRecommendation",
}


@dataclass(frozen=True)
class Disruption:
    """Why a pod should save now; ``key`` identifies this disruption (the request id source)."""

    reason: str
    message: str
    key: str
    warning: bool = False
    """A node warning (holds until cleared), not the pod's own save-now."""

    @property
    def request_id(self) -> str:
        """The value written to ``ckpt.dev/save-now``: short, stable per disruption."""
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:12]
        return f"{self.reason}-{digest}"

    @property
    def signal(self) -> str:
        """The annotation value: the request id, plus ``warning <message>`` for a warning."""
        if not self.warning:
            return self.request_id
        return compose_signal(self.request_id, KIND_WARNING, self.message)


def pod_disruption(pod: Mapping[str, Any]) -> Disruption | None:
    """The disruption announced on the pod itself, if any (DisruptionTarget first)."""
    meta = meta_of(pod)
    uid = str(meta.uid or meta.name or "")
    for cond in Body(pod).status.get("conditions") or ():
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            reason = str(cond.get("reason") or "DisruptionTarget")
            return Disruption(
                reason=reason,
                message=str(cond.get("message") or f"pod is a disruption target ({reason})"),
                key=f"pod/{uid}/DisruptionTarget/{reason}/{cond.get('lastTransitionTime', '')}",
            )
    deleting = meta.deletion_timestamp
    if deleting:
        return Disruption(
            reason="PodDeleting",
            message=f"pod deletion started at {deleting} (grace period "
            f"{meta.get('deletionGracePeriodSeconds', '?')}s)",
            key=f"pod/{uid}/deletion/{deleting}",
        )
    return None


def preemption_disruption(eviction: Eviction) -> Disruption:
    """The save-now request for every pod of a job whose Kueue Workload was evicted (one
    request id per eviction: a repeated event patches nothing)."""
    return Disruption(
        reason=PREEMPTION,
        message=f"Kueue evicted the job's Workload ({eviction.reason}): {eviction.message}",
        key=eviction.key,
    )


def node_disruption(node: Mapping[str, Any]) -> Disruption | None:
    """The warning a node announces, if any: a going-away taint first, then a cordon,
    then ``NotReady``, then a pressure condition (always a warning: see the module doc)."""
    meta = meta_of(node)
    name = str(meta.name or "")
    uid = meta.get("uid", name)
    spec = Body(node).spec
    for taint in spec.get("taints") or ():
        key = str(taint.get("key") or "")
        reason = DISRUPTION_TAINTS.get(key)
        if reason is None:
            continue
        added = str(taint.get("timeAdded") or taint.get("value") or "")
        return Disruption(
            reason=reason,
            message=f"node {name} tainted {key}:{taint.get('effect', '')}",
            key=f"node/{uid}/taint/{key}/{added}",
            warning=True,
        )
    if spec.get("unschedulable"):
        return Disruption(
            reason="NodeCordoned",
            message=f"node {name} is cordoned (spec.unschedulable)",
            key=f"node/{uid}/cordon",
            warning=True,
        )
    conditions = {str(cond.get("type")): cond for cond in Body(node).status.get("conditions") or ()}
    ready = conditions.get("Ready")
    if ready is not None and ready.get("status") in ("False", "Unknown"):
        return _condition_warning(name, uid, ready, "NodeNotReady", "is NotReady")
    for kind, reason in PRESSURE_CONDITIONS.items():
        cond = conditions.get(kind)
        if cond is not None and cond.get("status") == "True":
            return _condition_warning(name, uid, cond, reason, f"has {kind}")
    return None


def _condition_warning(
    name: str, uid: object, cond: Mapping[str, Any], reason: str, what: str
) -> Disruption:
    since = str(cond.get("lastTransitionTime") or "")
    why = cond.get("reason") or cond.get("status")
    return Disruption(
        reason=reason,
        message=f"node {name} {what} ({why})",
        key=f"node/{uid}/condition/{cond.get('type')}/{since}",
        warning=True,
    )


def save_now_patch(pod: Mapping[str, Any], disruption: Disruption) -> dict[str, Any] | None:
    """The merge patch that signals ``pod``, or None when it already carries this request.

    Only injected pods are signalled (others have no agent to listen), and
    only pods that are still running (a finished pod has nothing to save).
    """
    meta = meta_of(pod)
    labels = meta.labels
    if labels.get(c.LABEL_INJECTED) != "true":
        return None
    phase = Body(pod).status.get("phase")
    if phase in ("Succeeded", "Failed"):
        return None
    annotations = meta.annotations
    if annotations.get(c.ANN_SAVE_NOW) == disruption.signal:
        return None
    return {
        "metadata": {
            "annotations": {
                c.ANN_SAVE_NOW: disruption.signal,
                c.ANN_SAVE_NOW_REASON: f"{disruption.reason}: {disruption.message}",
            }
        }
    }


def clear_patch(pod: Mapping[str, Any], node: str) -> dict[str, Any] | None:
    """The merge patch that tells ``pod`` its node's warning went, or None when the pod
    holds no warning (a plain save-now, or already cleared)."""
    meta = meta_of(pod)
    held = parse_signal(str(meta.annotations.get(c.ANN_SAVE_NOW) or ""))
    if held is None or held.kind != KIND_WARNING:
        return None
    if Body(pod).status.get("phase") in ("Succeeded", "Failed"):
        return None
    message = f"node {node}: the warning went"
    return {
        "metadata": {
            "annotations": {
                c.ANN_SAVE_NOW: compose_signal(held.request, KIND_CLEAR, message),
                c.ANN_SAVE_NOW_REASON: f"NodeWarningCleared: {message}",
            }
        }
    }
