"""Failures and running time per node pool, to refine a run's MTBF (pure, in memory).

A run's own failures say little about its failure rate until it has had a few;
other runs on the same node pool (the same machine type, zone and provisioning)
say more. :class:`PoolLedger` keeps, per finished job (a failed one, or one that
succeeded), the node-seconds it ran on each pool and its failure (shared among
its pools by node count). :meth:`PoolLedger.evidence` sums what *other* runs
showed on the pool most of a run's nodes belong to, as
:class:`~ckpt_agent.decide.mtbf.PoolEvidence` for
:func:`~ckpt_agent.decide.mtbf.estimate_mtbf`.

A node's pool is the value of the first label of ``--node-pool-label`` it
carries (:data:`DEFAULT_POOL_LABELS`: GKE, EKS, AKS and Karpenter node pools,
then the instance type), learned from the node watch. Everything is bounded
(:data:`MAX_NODES` nodes, :data:`MAX_JOBS` jobs, the oldest dropped first) and in
memory: after an operator restart the pools start empty and fill again.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_agent.decide.mtbf import PoolEvidence
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.config import RecoveryConfig

__all__ = [
    "DEFAULT_POOL_LABELS",
    "MAX_JOBS",
    "MAX_NODES",
    "PoolLedger",
    "PoolShare",
    "node_names",
    "pool_of",
]

DEFAULT_POOL_LABELS = RecoveryConfig().node_pool_labels
"""Node labels that name a node's pool, the first one present wins."""
MAX_NODES = 20_000
"""Nodes whose pool is remembered."""
MAX_JOBS = 4096
"""Finished jobs whose exposure is kept (the pools' evidence is a sliding window)."""


def pool_of(labels: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    """``<label>=<value>`` of the first of ``keys`` the node carries (None: none)."""
    for key in keys:
        value = labels.get(key)
        if isinstance(value, str) and value:
            return f"{key}={value}"
    return None


def node_names(pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """The nodes the pods ran on, one entry per pod (unscheduled pods: none)."""
    out = []
    for pod in pods:
        node = Body(pod).spec.get("nodeName")
        if isinstance(node, str) and node:
            out.append(node)
    return out


@dataclass(frozen=True)
class PoolShare:
    """One job's exposure on one pool."""

    run_id: str
    pool: str
    failures: float
    node_seconds: float


class PoolLedger:
    """Node → pool, and each finished job's exposure per pool (see the module docstring)."""

    def __init__(self, max_nodes: int = MAX_NODES, max_jobs: int = MAX_JOBS) -> None:
        self.max_nodes = max_nodes
        self.max_jobs = max_jobs
        self.nodes: OrderedDict[str, str] = OrderedDict()
        """Node name → pool (kept after the node is deleted: its failures still count)."""
        self.jobs: OrderedDict[str, tuple[PoolShare, ...]] = OrderedDict()
        """Job key → its shares, oldest first."""

    def note_node(self, node: Mapping[str, Any], keys: Sequence[str]) -> None:
        """Learn a node's pool from its labels (a node without one is forgotten)."""
        meta = meta_of(node)
        name = meta.name
        if not isinstance(name, str) or not name:
            return
        pool = pool_of(meta.labels, keys)
        self.nodes.pop(name, None)
        if pool is None:
            return
        self.nodes[name] = pool
        while len(self.nodes) > self.max_nodes:
            self.nodes.popitem(last=False)

    def _pools(self, nodes: Sequence[str]) -> Counter[str]:
        """Distinct nodes per known pool."""
        return Counter(self.nodes[n] for n in set(nodes) if n in self.nodes)

    def record(
        self, key: str, run_id: str, nodes: Sequence[str], seconds: float, *, failed: bool
    ) -> bool:
        """A job (``key``: its uid, and the attempt for a TrainJob) ran ``seconds`` on
        ``nodes`` and failed or not. Recorded once per key (later calls: False), only
        when some node's pool is known and the time is positive."""
        if key in self.jobs or not (math.isfinite(seconds) and seconds > 0):
            return False
        per_pool = self._pools(nodes)
        known = sum(per_pool.values())
        if not known:
            return False
        self.jobs[key] = tuple(
            PoolShare(run_id, pool, k / known if failed else 0.0, k * seconds)
            for pool, k in sorted(per_pool.items())
        )
        while len(self.jobs) > self.max_jobs:
            self.jobs.popitem(last=False)
        return True

    def evidence(self, run_id: str, nodes: Sequence[str]) -> PoolEvidence | None:
        """What other runs showed on the pool of most of ``nodes`` (ties: the first pool
        by name), for a run on ``len(set(nodes))`` nodes; None: no pool known or no
        other run recorded on it."""
        per_pool = self._pools(nodes)
        if not per_pool:
            return None
        pool = min(per_pool, key=lambda p: (-per_pool[p], p))
        shares = [
            s for job in self.jobs.values() for s in job if s.pool == pool and s.run_id != run_id
        ]
        if not shares:
            return None
        return PoolEvidence(
            failures=math.fsum(s.failures for s in shares),
            node_seconds=math.fsum(s.node_seconds for s in shares),
            nodes=len(set(nodes)),
        )
