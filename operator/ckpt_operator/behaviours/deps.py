"""What every behaviour needs (:class:`Deps`) and the job status write they share."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_operator.adapters.agentprobe import probe_agent
from ckpt_operator.adapters.caches import ObjectCache, PodIndex
from ckpt_operator.adapters.events import EventSink
from ckpt_operator.adapters.kube import KubeApi, NotFoundError
from ckpt_operator.adapters.metrics import Metrics
from ckpt_operator.adapters.sources import SourceFactory
from ckpt_operator.behaviours.state import (
    AgentAnswers,
    NodeLabels,
    NodeSignals,
    PeerMaps,
    RefusedAttempts,
    ReportedPods,
)
from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.kinds.registry import KINDS, kind_of
from ckpt_operator.kinds.trainjob import TRAINJOB
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.model.config import OperatorConfig
from ckpt_operator.model.jobs import JobStatusAnnotation, format_time
from ckpt_operator.planners.agent_presence import ProbeResult
from ckpt_operator.planners.pools import PoolLedger

__all__ = [
    "AgentProbe",
    "Deps",
    "Obj",
    "annotate_job",
    "cached_job",
    "cached_policy",
    "kind_kw",
    "list_all_jobs",
    "patch_job_annotations",
    "set_job_status",
]

Obj = dict[str, Any]
AgentProbe = Callable[[str, int, float], Awaitable[ProbeResult]]
"""(pod IP, port, timeout) → what the pod's agent metrics port says."""


@dataclass
class Deps:
    """Everything the operator's functions need (kopf passes it around in ``memo``)."""

    api: KubeApi
    events: EventSink
    metrics: Metrics
    sources: SourceFactory
    config: OperatorConfig = field(default_factory=OperatorConfig)
    clock: Callable[[], float] = time.time
    node_signals: NodeSignals = field(default_factory=NodeSignals)
    """Node → the last disruption request id signalled (avoids re-listing pods)."""
    policies: ObjectCache = field(default_factory=ObjectCache)
    """CheckpointPolicies as the watch delivered them."""
    jobs: ObjectCache = field(default_factory=ObjectCache)
    """Opted-in PyTorchJobs as the watch delivered them."""
    pods: PodIndex = field(default_factory=PodIndex)
    """The training-operator's pods by job."""
    trainjobs: ObjectCache = field(default_factory=ObjectCache)
    """Opted-in TrainJobs as the watch delivered them."""
    trainjob_pods: PodIndex = field(default_factory=lambda: PodIndex(c.LABEL_JOBSET_NAME))
    """Opted-in TrainJobs' pods by TrainJob (JobSet) name."""
    jobsets: ObjectCache = field(default_factory=ObjectCache)
    """JobSets of TrainJobs (their ``status.restarts``: the current restart attempt)."""
    attempts_seen: RefusedAttempts = field(default_factory=RefusedAttempts)
    """The newest JobSet restart attempt of each TrainJob that a pod refused by the webhook
    carried (the attempt is due even while the JobSet watch is silent)."""
    pools: PoolLedger = field(default_factory=PoolLedger)
    """Nodes' pools and finished jobs' running time and failures per pool (MTBF)."""
    reported_pods: ReportedPods = field(default_factory=ReportedPods)
    """Unprotected pods already reported (dropped when the pod is deleted)."""
    fenced_pods: ReportedPods = field(default_factory=ReportedPods)
    """Pods whose writer was fenced, already reported (``WriterFenced``; dropped when the
    pod is deleted)."""
    probe: AgentProbe = probe_agent
    """Probes a pod's agent metrics port (ip, port, timeout): the agent check's live signal
    when the storage is out of the operator's reach."""
    agent_answers: AgentAnswers = field(default_factory=AgentAnswers)
    """What each pod's agent port answered the probes: serving (not probed again until a
    container restarts) or refused since when (dropped when the pod is deleted)."""
    node_labels: NodeLabels = field(default_factory=NodeLabels)
    """Nodes' zone and rack labels (the replica peer choice), from the node watch."""
    peer_maps: PeerMaps = field(default_factory=PeerMaps)
    """Jobs whose replica peer map exists (never changed once made)."""
    admission_api: KubeApi | None = None
    """The API client the webhook falls back to on a cache miss (its own worker threads,
    so admission never waits behind reconciliation); None: ``api``."""

    def job_cache(self, kind: JobKind) -> ObjectCache:
        """The watch cache of opted-in jobs of ``kind``."""
        return self.trainjobs if kind is TRAINJOB else self.jobs

    def pod_index(self, kind: JobKind) -> PodIndex:
        """The pod index of ``kind``'s jobs."""
        return self.trainjob_pods if kind is TRAINJOB else self.pods


def kind_kw(kind: JobKind) -> dict[str, JobKind]:
    """The ``kind`` keyword of a :class:`~ckpt_operator.adapters.kube.KubeApi` job call: none for a
    PyTorchJob (the default), so clients written for PyTorchJobs alone keep working."""
    return {} if kind is PYTORCHJOB else {"kind": kind}


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
    deps: Deps,
    namespace: str,
    name: str,
    *,
    admission: bool = False,
    kind: JobKind = PYTORCHJOB,
) -> Obj | None:
    """The opted-in job from the watch cache; on a miss one API read (not remembered: only
    opted-in jobs are cached, and their watch delivers them)."""
    job = deps.job_cache(kind).get(namespace, name)
    if job is None:
        api = deps.admission_api if admission and deps.admission_api is not None else deps.api
        job = await api.get_job(namespace, name, **kind_kw(kind))
    return job


async def list_all_jobs(deps: Deps, namespace: str) -> list[Obj]:
    """The namespace's jobs of every kind (a kind whose CRD is not installed: none)."""
    jobs: list[Obj] = []
    for kind in KINDS:
        try:
            jobs += await deps.api.list_jobs(namespace, **kind_kw(kind))
        except NotFoundError:
            if kind is PYTORCHJOB:
                raise
    return jobs


async def set_job_status(
    deps: Deps,
    job: Mapping[str, Any],
    state: str,
    reason: str,
    message: str,
    extra: Mapping[str, str | None] | None = None,
) -> None:
    """Write the job's status annotation (``state``, ``reason``, ``message``) and ``extra``."""
    status = JobStatusAnnotation(state, reason, message, format_time(deps.clock(), precise=True))
    annotations: dict[str, str | None] = {c.ANN_STATUS: status.to_json()}
    annotations.update(extra or {})
    await annotate_job(deps, job, annotations)


async def annotate_job(
    deps: Deps, job: Mapping[str, Any], annotations: Mapping[str, str | None]
) -> None:
    """:func:`patch_job_annotations` of ``job`` (its namespace, name and kind)."""
    meta = meta_of(job)
    await patch_job_annotations(
        deps, str(meta.namespace), str(meta.name), annotations, kind_of(job)
    )


async def patch_job_annotations(
    deps: Deps,
    namespace: str,
    name: str,
    annotations: Mapping[str, str | None],
    kind: JobKind = PYTORCHJOB,
) -> None:
    """Patch an opted-in job's annotations and remember the patched job in the cache: the
    recovery loop reads the job from there, and a late watch event of an older version
    (e.g. of the restart's intent write) then finds the job already handled without a GET.
    Only a job the cache holds is updated: a deletion seen meanwhile is not undone."""
    patched = await deps.api.patch_job_annotations(namespace, name, annotations, **kind_kw(kind))
    cache = deps.job_cache(kind)
    if patched is not None and cache.get(namespace, name) is not None:
        cache.upsert(patched)
