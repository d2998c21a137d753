"""What every behaviour needs (:class:`Deps`) and the job status write they share."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_operator import constants as c
from ckpt_operator.caches import ObjectCache, PodIndex
from ckpt_operator.config import OperatorConfig
from ckpt_operator.events import EventSink
from ckpt_operator.jobs import JobStatusAnnotation, format_time, job_facts
from ckpt_operator.kube import KubeApi
from ckpt_operator.metrics import Metrics
from ckpt_operator.sources import SourceFactory

__all__ = [
    "Deps",
    "Obj",
    "cached_job",
    "cached_policy",
    "patch_job_annotations",
    "set_job_status",
]

Obj = dict[str, Any]


@dataclass
class Deps:
    """Everything the operator's functions need (kopf passes it around in ``memo``)."""

    api: KubeApi
    events: EventSink
    metrics: Metrics
    sources: SourceFactory
    config: OperatorConfig = field(default_factory=OperatorConfig)
    clock: Callable[[], float] = time.time
    node_signals: dict[str, str] = field(default_factory=dict)
    """node name → last disruption request id signalled (avoids re-listing pods)."""
    policies: ObjectCache = field(default_factory=ObjectCache)
    """CheckpointPolicies as the watch delivered them."""
    jobs: ObjectCache = field(default_factory=ObjectCache)
    """Opted-in PyTorchJobs as the watch delivered them."""
    pods: PodIndex = field(default_factory=PodIndex)
    """The training-operator's pods by job."""
    reported_pods: set[str] = field(default_factory=set)
    """uids of unprotected pods already reported (dropped when the pod is deleted)."""
    admission_api: KubeApi | None = None
    """The API client the webhook falls back to on a cache miss (its own worker threads,
    so admission never waits behind reconciliation); None: ``api``."""


async def cached_policy(
    deps: Deps, namespace: str, name: str, *, admission: bool = False
) -> Obj | None:
    """The policy from the watch cache; on a miss one API read (remembered)."""
    policy = deps.policies.get(namespace, name)
    if policy is None:
        api = deps.admission_api if admission and deps.admission_api is not None else deps.api
        policy = await api.get_policy(namespace, name)
        if policy is not None:
            deps.policies.upsert(policy)
    return policy


async def cached_job(
    deps: Deps, namespace: str, name: str, *, admission: bool = False
) -> Obj | None:
    """The opted-in job from the watch cache; on a miss one API read (not remembered: only
    opted-in jobs are cached, and their watch delivers them)."""
    job = deps.jobs.get(namespace, name)
    if job is None:
        api = deps.admission_api if admission and deps.admission_api is not None else deps.api
        job = await api.get_job(namespace, name)
    return job


async def set_job_status(
    deps: Deps,
    job: Mapping[str, Any],
    state: str,
    reason: str,
    message: str,
    extra: Mapping[str, str | None] | None = None,
) -> None:
    """Write the job's status annotation (``state``, ``reason``, ``message``) and ``extra``."""
    facts = job_facts(job)
    status = JobStatusAnnotation(state, reason, message, format_time(deps.clock(), precise=True))
    annotations: dict[str, str | None] = {c.ANN_STATUS: status.to_json()}
    annotations.update(extra or {})
    await patch_job_annotations(deps, facts.namespace, facts.name, annotations)


async def patch_job_annotations(
    deps: Deps, namespace: str, name: str, annotations: Mapping[str, str | None]
) -> None:
    """Patch an opted-in job's annotations and remember the patched job in the cache: the
    recovery loop reads the job from there, and a late watch event of an older version
    (e.g. of the restart's intent write) then finds the job already handled without a GET.
    Only a job the cache holds is updated: a deletion seen meanwhile is not undone."""
    patched = await deps.api.patch_job_annotations(namespace, name, annotations)
    if patched is not None and deps.jobs.get(namespace, name) is not None:
        deps.jobs.upsert(patched)
