"""Watch-fed caches: what the webhook and the recovery loop read instead of the API server.

kopf's watch handlers (``on.event``) feed them with every object they see —
the initial listing at start, then each change — and drop objects on
``DELETED``, so memory follows the live objects and nothing else:

* :class:`ObjectCache` — CheckpointPolicies and opted-in PyTorchJobs by
  ``(namespace, name)``;
* :class:`PodIndex` — the training-operator's pods by ``(namespace, job name)``
  (replaces a cluster-wide pod LIST per restart).

A cache never invents an answer: a miss (``None``) means "not seen yet", and
callers fall back to one API read (see :func:`ckpt_operator.behaviours.deps.cached_policy`).
Bodies are stored as the watch delivered them and handed out as-is: callers
never mutate them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_operator import constants as c

__all__ = ["Key", "ObjectCache", "PodIndex", "key_of"]

Obj = dict[str, Any]
Key = tuple[str, str]


def key_of(obj: Mapping[str, Any]) -> Key:
    """``(namespace, name)`` of an object."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _resource_version(obj: Mapping[str, Any]) -> int:
    try:
        return int(str((obj.get("metadata") or {}).get("resourceVersion") or 0))
    except ValueError:
        return 0


class ObjectCache:
    """Latest body per ``(namespace, name)``; an older resourceVersion never replaces a newer."""

    def __init__(self) -> None:
        self._items: dict[Key, Obj] = {}

    def __len__(self) -> int:
        return len(self._items)

    def get(self, namespace: str, name: str) -> Obj | None:
        return self._items.get((namespace, name))

    def upsert(self, obj: Mapping[str, Any]) -> None:
        key = key_of(obj)
        old = self._items.get(key)
        if old is not None and _resource_version(old) > _resource_version(obj) > 0:
            return  # a late read (API fallback) must not undo a newer watch event
        self._items[key] = dict(obj)

    def remove(self, namespace: str, name: str) -> None:
        self._items.pop((namespace, name), None)


class PodIndex:
    """Training-operator pods by ``(namespace, job name)`` (their ``job-name`` label)."""

    def __init__(self) -> None:
        self._by_job: dict[Key, dict[str, Obj]] = {}

    def __len__(self) -> int:
        return sum(len(pods) for pods in self._by_job.values())

    @staticmethod
    def _job_key(pod: Mapping[str, Any]) -> Key | None:
        meta = pod.get("metadata") or {}
        job = (meta.get("labels") or {}).get(c.LABEL_TO_JOB_NAME)
        if not job:
            return None
        return str(meta.get("namespace") or ""), str(job)

    def upsert(self, pod: Mapping[str, Any]) -> None:
        key = self._job_key(pod)
        if key is not None:
            self._by_job.setdefault(key, {})[key_of(pod)[1]] = dict(pod)

    def remove(self, pod: Mapping[str, Any]) -> None:
        key = self._job_key(pod)
        pods = self._by_job.get(key) if key is not None else None
        if pods is None or key is None:
            return
        pods.pop(key_of(pod)[1], None)
        if not pods:
            del self._by_job[key]

    def of_job(self, namespace: str, job: str) -> list[Obj]:
        """The job's pods as last seen (empty: none seen)."""
        return list((self._by_job.get((namespace, job)) or {}).values())
