"""Which peers a training pod's sidecar pushes its replicas to (docs/replicas.md). Pure.

Rank ``r`` of a world of ``n`` pushes to the next ``k`` ranks of a ring, ``r+1, …, r+k``
(mod ``n``, ``k`` capped at ``n - 1``), named by their stable DNS names with the replica
port: every rank holds the replicas of the ``k`` ranks before it, and a lost node's
snapshots survive on the next ``k`` nodes. A world of one has no peer: replication is off
for that job, and the plan says why.

Where the ranks and their names come from, per job kind (:mod:`ckpt_operator.kinds`):

* **PyTorchJob** (training-operator v1): pods ``<job>-master-<i>`` and ``<job>-worker-<i>``
  (labels ``training.kubeflow.org/replica-type`` and ``replica-index``), each behind the
  headless Service of the same name that the training-operator creates, so
  ``<job>-worker-<i>.<namespace>.svc``; ranks are the masters first, then the workers (as
  the training-operator numbers ``RANK``); the world is the sum of
  ``spec.pytorchReplicaSpecs.{Master,Worker}.replicas`` (1 when unset);
* **TrainJob** (Trainer v2 on JobSet): one replicated Job of the runtime (``node``) whose
  Indexed Job pods have the hostname ``<jobset>-<replicated job>-<job index>-<completion
  index>`` under the JobSet's headless Service (the pod's ``spec.subdomain``, by default the
  JobSet's name, which is the TrainJob's): ``<hostname>.<subdomain>.<namespace>.svc``; the
  rank is the completion index (``batch.kubernetes.io/job-completion-index``); the world is
  ``spec.trainer.numNodes``, else the trainer's ``PET_NNODES``. A replicated Job with more
  than one Job (``job-index`` ≠ 0) is not a layout the operator knows: off.

These are the peers a pod starts with, chosen before it has a node. Once every pod of the
job is scheduled the operator chooses again from the nodes' zones and racks
(:mod:`ckpt_operator.planners.replica_topology`, published by
:mod:`ckpt_operator.behaviours.replica_maps`), and the sidecar follows that choice. One
training pod per node is assumed (two ranks on one node would hold each other's replicas
in that node's memory while the ring is used).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.kinds.trainjob import TRAINJOB
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jobs import REPLICA_SPECS

__all__ = [
    "LABEL_COMPLETION_INDEX",
    "LABEL_JOBSET_JOB_INDEX",
    "LABEL_JOBSET_REPLICATED_JOB",
    "Layout",
    "ReplicaPeers",
    "layout",
    "replica_peers",
    "ring",
]

LABEL_JOBSET_REPLICATED_JOB: Final = "jobset.sigs.k8s.io/replicatedjob-name"
LABEL_JOBSET_JOB_INDEX: Final = "jobset.sigs.k8s.io/job-index"
LABEL_COMPLETION_INDEX: Final = "batch.kubernetes.io/job-completion-index"
#: The trainer's node count, as Trainer v2's torch plugin sets it on the ``node`` container.
ENV_PET_NNODES: Final = "PET_NNODES"
_PYTORCH_TYPES: Final = ("Master", "Worker")


@dataclass(frozen=True)
class ReplicaPeers:
    """One pod's replication: its rank, the world, the peers' ``host:port`` (empty: off)."""

    rank: int | None
    world: int | None
    peers: tuple[str, ...] = ()
    off: str | None = None
    """Why this pod does not replicate (None: it does)."""

    @property
    def on(self) -> bool:
        return self.off is None


@dataclass(frozen=True)
class Layout:
    """A pod's rank among the job's replicating pods and every rank's stable host name
    (``hosts[r]``); ``rank`` None: not known, ``why`` says why."""

    rank: int | None
    hosts: tuple[str, ...]
    why: str | None = None

    @classmethod
    def unknown(cls, why: str) -> Layout:
        return cls(None, (), why)


def ring(rank: int, world: int, peers: int) -> tuple[int, ...]:
    """The ranks ``rank`` pushes to: the next ``peers`` ones mod ``world`` (at most
    ``world - 1``; never itself)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if peers < 0:
        raise ValueError(f"peers must be >= 0, not {peers}")
    return tuple((rank + i) % world for i in range(1, min(peers, world - 1) + 1))


def _count(value: object) -> int | None:
    """A non-negative count from a job field (an int, or digits); None: not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _host(name: str, namespace: str) -> str:
    return f"{name}.{namespace}.svc"


def _pytorchjob(pod: Mapping[str, Any], job: Mapping[str, Any], namespace: str) -> Layout:
    specs = Body(job).spec.get(REPLICA_SPECS) or {}
    if not isinstance(specs, Mapping) or not specs:
        return Layout.unknown(f"the PyTorchJob has no spec.{REPLICA_SPECS}")
    other = sorted(str(t) for t in specs if t not in _PYTORCH_TYPES)
    if other:
        return Layout.unknown(f"replica type(s) {', '.join(other)} (only Master and Worker)")
    job_name = str(meta_of(job).name or "")
    hosts: list[str] = []
    first: dict[str, tuple[int, int]] = {}  # replica type label → (first rank, replicas)
    for rtype in _PYTORCH_TYPES:
        if rtype not in specs:
            continue
        rspec = specs[rtype]
        replicas = _count(rspec.get("replicas", 1)) if isinstance(rspec, Mapping) else None
        if replicas is None:
            return Layout.unknown(f"{rtype}.replicas is not a count")
        first[rtype.lower()] = (len(hosts), replicas)
        hosts += [_host(f"{job_name}-{rtype.lower()}-{i}", namespace) for i in range(replicas)]
    labels = meta_of(pod).labels
    rtype_label = str(labels.get(c.LABEL_TO_REPLICA_TYPE) or "").lower()
    index = _count(labels.get(c.LABEL_TO_REPLICA_INDEX))
    if rtype_label not in first or index is None:
        return Layout.unknown(
            f"the pod's {c.LABEL_TO_REPLICA_TYPE} and {c.LABEL_TO_REPLICA_INDEX} labels do not "
            "name a replica of the job"
        )
    start, replicas = first[rtype_label]
    if index >= replicas:
        return Layout.unknown(f"{rtype_label}-{index} is beyond the job's {replicas} replicas")
    return Layout(start + index, tuple(hosts))


def _nnodes(pod: Mapping[str, Any]) -> int | None:
    for ctr in Body(pod).spec.get("containers") or ():
        for env in ctr.get("env") or () if isinstance(ctr, Mapping) else ():
            if isinstance(env, Mapping) and env.get("name") == ENV_PET_NNODES:
                return _count(env.get("value"))
    return None


def _trainjob(pod: Mapping[str, Any], job: Mapping[str, Any], namespace: str) -> Layout:
    meta = meta_of(pod)
    labels = meta.labels
    jobset = str(labels.get(c.LABEL_JOBSET_NAME) or meta_of(job).name or "")
    rjob = str(labels.get(LABEL_JOBSET_REPLICATED_JOB) or "")
    job_index = _count(labels.get(LABEL_JOBSET_JOB_INDEX, "0"))
    raw_rank = labels.get(LABEL_COMPLETION_INDEX) or meta.annotations.get(LABEL_COMPLETION_INDEX)
    rank = _count(raw_rank)
    if not jobset or not rjob or rank is None:
        return Layout.unknown(
            f"the pod has no {LABEL_JOBSET_REPLICATED_JOB} or {LABEL_COMPLETION_INDEX} "
            "(not an Indexed Job pod of a JobSet)"
        )
    if job_index != 0:
        return Layout.unknown(
            f"replicated Job {rjob} has more than one Job ({LABEL_JOBSET_JOB_INDEX} "
            f"{labels.get(LABEL_JOBSET_JOB_INDEX)!r})"
        )
    trainer = Body(job).spec.get("trainer")
    world = _count(trainer.get("numNodes")) if isinstance(trainer, Mapping) else None
    world = world if world is not None else _nnodes(pod)
    if world is None or world < 1:
        return Layout.unknown(f"no node count (spec.trainer.numNodes or {ENV_PET_NNODES})")
    subdomain = str(Body(pod).spec.get("subdomain") or jobset)
    hosts = tuple(f"{jobset}-{rjob}-0-{i}.{subdomain}.{namespace}.svc" for i in range(world))
    if rank >= world:
        return Layout.unknown(f"completion index {rank} is beyond the {world} nodes")
    return Layout(rank, hosts)


def layout(kind: JobKind, job: Mapping[str, Any], pod: Mapping[str, Any], namespace: str) -> Layout:
    """``pod``'s rank in ``job`` and the hosts of every rank (see the module doc)."""
    return (_trainjob if kind is TRAINJOB else _pytorchjob)(pod, job, namespace)


def replica_peers(
    kind: JobKind,
    job: Mapping[str, Any],
    pod: Mapping[str, Any],
    *,
    peers: int,
    port: int,
    namespace: str | None = None,
) -> ReplicaPeers:
    """The peers of ``pod`` (a pod of ``job``, as admitted) for ``peers`` replicas on
    ``port`` (see the module doc); ``off`` says why there are none."""
    ns = namespace or str(meta_of(job).namespace or meta_of(pod).namespace or "")
    if not ns:
        return ReplicaPeers(None, None, off="the job's namespace is not known")
    where = layout(kind, job, pod, ns)
    if where.rank is None:
        return ReplicaPeers(None, None, off=f"the pod's rank is not known: {where.why}")
    world = len(where.hosts)
    if world < 2:
        return ReplicaPeers(
            where.rank, world, off="a world of one node has no peer to replicate to"
        )
    chosen = ring(where.rank, world, peers)
    return ReplicaPeers(where.rank, world, tuple(f"{where.hosts[r]}:{port}" for r in chosen))
