"""The LocalPods of one pod: what ties their lifetimes together.

Several :class:`~ckpt_e2e.localpod.LocalPod` may run containers of the same pod (its uid):
a trainer, its native sidecar, a trainer restarted in place. Semantics: the "One pod,
several LocalPods", "Deletion" and "Native sidecars" sections of the ``ckpt_e2e.localpod``
docstring. This module keeps the bookkeeping behind them:

* which LocalPods of a pod are started and not yet stopped (:func:`join`, :func:`leave`):
  the pod's volumes live while one of them does, so the last one to stop removes them;
* whose pid the pod's ``e2e.ckpt.dev/local-process`` annotation names once a container
  has exited (:func:`annotation_pid`): another container of the pod still running here,
  else none (the annotation is removed);
* when a native sidecar ends with its pod (:func:`sidecar_ends`): once the pod is
  Succeeded/Failed, as the kubelet ends sidecars after the main containers.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["TERMINAL_PHASES", "Member", "annotation_pid", "join", "leave", "sidecar_ends"]

#: Pod phases after which a native sidecar is stopped (the kubelet ends it with the pod).
TERMINAL_PHASES = ("Succeeded", "Failed")


class Member(Protocol):
    """What the bookkeeping needs of a LocalPod."""

    @property
    def pod_uid(self) -> str: ...

    @property
    def running(self) -> bool: ...

    @property
    def pid(self) -> int: ...


#: Pod uid → the LocalPods of that pod started and not yet stopped (any container): the pod's
#: volumes live while one of them does, and its local-process annotation while one runs.
_holders: dict[str, set[Member]] = {}
_holders_lock = threading.Lock()


def join(member: Member) -> None:
    """``member`` was started: the pod's volumes live at least until it leaves."""
    with _holders_lock:
        _holders.setdefault(member.pod_uid, set()).add(member)


def leave(member: Member) -> bool:
    """``member`` is stopped; True when it was the last LocalPod of its pod (remove the
    pod's volumes), False while the pod's other containers still use them."""
    with _holders_lock:
        holders = _holders.get(member.pod_uid, set())
        holders.discard(member)
        last = not holders
        if last:
            _holders.pop(member.pod_uid, None)
    return last


def _others(member: Member) -> list[Member]:
    with _holders_lock:
        return [o for o in _holders.get(member.pod_uid, ()) if o is not member]


def annotation_pid(member: Member) -> int | None:
    """The pid for the pod's local-process annotation after ``member``'s container exited:
    another running container's of the pod (the annotation stays), else None (removed)."""
    alive = [o for o in _others(member) if o.running]
    return alive[0].pid if alive else None


def sidecar_ends(is_sidecar: bool, pod: Mapping[str, Any] | None) -> bool:
    """A native sidecar's pod is Succeeded/Failed: its LocalPod ends it like a deletion."""
    return (
        is_sidecar and pod is not None and (pod.get("status") or {}).get("phase") in TERMINAL_PHASES
    )
