"""A Kueue Workload as the operator reads it (pure): the job that owns it, whether it holds
quota, whether it finished, its eviction.

Kueue (v0.17, ``kueue.x-k8s.io/v1beta2``) creates one Workload per job it manages, owned by
the job (a controller owner reference to the PyTorchJob or TrainJob). What the operator
decides from it is :mod:`ckpt_operator.planners.preemption`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jobs import parse_time

__all__ = [
    "KUEUE_GROUP",
    "KUEUE_VERSION",
    "WORKLOADS",
    "WORKLOAD_KIND",
    "Eviction",
    "JobRef",
    "WorkloadView",
    "eviction_of",
    "workload_view",
]

KUEUE_GROUP: Final = "kueue.x-k8s.io"
KUEUE_VERSION: Final = "v1beta2"
WORKLOADS: Final = "workloads"
WORKLOAD_KIND: Final = "Workload"

# --------------------------------------------------------------------------- the Workload


@dataclass(frozen=True)
class JobRef:
    """The job a Workload belongs to (its owner reference)."""

    kind: str
    """``PyTorchJob`` or ``TrainJob``."""
    name: str


@dataclass(frozen=True)
class Eviction:
    """The Workload's ``Evicted=True`` condition."""

    reason: str
    """Kueue's reason: ``Preempted``, ``PodsReadyTimeout``, ``Deactivated`` …"""
    message: str
    since: str
    """The condition's ``lastTransitionTime`` (one eviction; the next has another)."""
    workload_uid: str

    @property
    def key(self) -> str:
        """What identifies this eviction (the save-now request id is derived from it)."""
        return f"workload/{self.workload_uid}/Evicted/{self.reason}/{self.since}"


@dataclass(frozen=True)
class WorkloadView:
    """What the operator reads of a Kueue Workload."""

    namespace: str
    name: str
    uid: str
    owner: JobRef | None
    admitted: bool
    """``QuotaReserved=True`` (Kueue counts it against the quota: a preemption victim)."""
    admitted_at: float | None
    finished: bool
    eviction: Eviction | None
    annotations: Mapping[str, str]
    active: bool = True
    """``spec.active`` (False: deactivated, by its owner or by the operator's hold)."""


_OWNER_KINDS: Final = {
    c.PYTORCHJOB_KIND: c.PYTORCHJOB_GROUP,
    c.TRAINJOB_KIND: c.TRAINJOB_GROUP,
}


def _owner(refs: Iterable[Any]) -> JobRef | None:
    found: list[tuple[bool, JobRef]] = []
    for ref in refs:
        if not isinstance(ref, Mapping):
            continue
        kind, name = ref.get("kind"), ref.get("name")
        group = _OWNER_KINDS.get(str(kind))
        if group is None or not isinstance(name, str) or not name:
            continue
        if not str(ref.get("apiVersion", "")).startswith(f"{group}/"):
            continue
        found.append((ref.get("controller") is True, JobRef(str(kind), name)))
    found.sort(key=lambda f: not f[0])  # the controller first
    return found[0][1] if found else None


def _conditions(obj: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for cond in Body(obj).status.get("conditions") or ():
        if isinstance(cond, Mapping):
            out[str(cond.get("type"))] = cond
    return out


def _true(cond: Mapping[str, Any] | None) -> bool:
    return cond is not None and cond.get("status") == "True"


def eviction_of(workload: Mapping[str, Any]) -> Eviction | None:
    """The Workload's eviction while ``Evicted`` is ``True`` (None otherwise)."""
    cond = _conditions(workload).get("Evicted")
    if not _true(cond):
        return None
    assert cond is not None
    reason = str(cond.get("reason") or "Evicted")
    return Eviction(
        reason=reason,
        message=str(cond.get("message") or f"evicted by Kueue ({reason})"),
        since=str(cond.get("lastTransitionTime") or ""),
        workload_uid=str(meta_of(workload).uid or meta_of(workload).name or ""),
    )


def workload_view(workload: Mapping[str, Any]) -> WorkloadView:
    """Read ``workload``."""
    meta = meta_of(workload)
    conds = _conditions(workload)
    reserved = conds.get("QuotaReserved")
    admitted_at = None
    if _true(reserved):
        assert reserved is not None
        admitted_at = parse_time(reserved.get("lastTransitionTime"))
    return WorkloadView(
        namespace=str(meta.namespace or ""),
        name=str(meta.name or ""),
        uid=str(meta.uid or ""),
        owner=_owner(meta.owner_references),
        admitted=_true(reserved),
        admitted_at=admitted_at,
        finished=_true(conds.get("Finished")),
        eviction=eviction_of(workload),
        annotations={str(k): str(v) for k, v in meta.annotations.items() if v is not None},
        active=Body(workload).spec.get("active") is not False,
    )
