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
Bodies are stored as the watch delivered them, less ``metadata.managedFields``
(which nothing here reads: a large share of each body), packed with :mod:`marshal`
(our own bytes, written and read by this process only): a few kB in one block per
object instead of ~6x that in small Python objects, which at fleet scale made the
peak heap, and the fragments of it CPython keeps after the objects are deleted
(issue #19). Each read unpacks a fresh copy (tens of microseconds).
"""

from __future__ import annotations

import marshal
from collections.abc import Mapping
from typing import Any, cast

from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of

__all__ = ["Key", "ObjectCache", "PodIndex", "key_of", "lean"]

Obj = dict[str, Any]
Key = tuple[str, str]
#: A cached body: marshal bytes (a body of other than JSON types: as it is).
Stored = bytes | Obj


def key_of(obj: Mapping[str, Any]) -> Key:
    """``(namespace, name)`` of an object."""
    meta = meta_of(obj)
    return str(meta.namespace or ""), str(meta.name or "")


def lean(obj: Mapping[str, Any]) -> Obj:
    """A shallow copy of ``obj`` without ``metadata.managedFields``."""
    out = dict(obj)
    meta = out.get("metadata")
    if isinstance(meta, Mapping) and "managedFields" in meta:
        out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return out


def _pack(obj: Mapping[str, Any]) -> Stored:
    body = lean(obj)
    try:
        return marshal.dumps(body)
    except ValueError:  # not plain JSON types (never from the API server)
        return body


def _unpack(stored: Stored) -> Obj:
    return cast(Obj, marshal.loads(stored)) if isinstance(stored, bytes) else stored


def _resource_version(obj: Mapping[str, Any]) -> int:
    try:
        return int(str(meta_of(obj).resource_version or 0))
    except ValueError:
        return 0


class ObjectCache:
    """Latest body per ``(namespace, name)``; an older resourceVersion never replaces a newer."""

    def __init__(self) -> None:
        self._items: dict[Key, tuple[int, Stored]] = {}  # resourceVersion, body

    def __len__(self) -> int:
        return len(self._items)

    def get(self, namespace: str, name: str) -> Obj | None:
        entry = self._items.get((namespace, name))
        return _unpack(entry[1]) if entry is not None else None

    def upsert(self, obj: Mapping[str, Any]) -> None:
        key = key_of(obj)
        version = _resource_version(obj)
        old = self._items.get(key)
        if old is not None and old[0] > version > 0:
            return  # a late read (API fallback) must not undo a newer watch event
        self._items[key] = (version, _pack(obj))

    def remove(self, namespace: str, name: str) -> None:
        self._items.pop((namespace, name), None)


class PodIndex:
    """Training pods by ``(namespace, job name)``: the job's name is the pod's ``label``
    (the training-operator's ``job-name``; JobSet's ``jobset-name`` for TrainJobs)."""

    def __init__(self, label: str = c.LABEL_TO_JOB_NAME) -> None:
        self._by_job: dict[Key, dict[str, Stored]] = {}
        self._label = label

    def __len__(self) -> int:
        return sum(len(pods) for pods in self._by_job.values())

    def _job_key(self, pod: Mapping[str, Any]) -> Key | None:
        meta = meta_of(pod)
        job = meta.labels.get(self._label)
        if not job:
            return None
        return str(meta.namespace or ""), str(job)

    def upsert(self, pod: Mapping[str, Any]) -> None:
        key = self._job_key(pod)
        if key is not None:
            self._by_job.setdefault(key, {})[key_of(pod)[1]] = _pack(pod)

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
        return [_unpack(p) for p in (self._by_job.get((namespace, job)) or {}).values()]
