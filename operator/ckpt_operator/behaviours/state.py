"""What the behaviours remember between events, in memory (lost on a restart by design:
each is a shortcut the next event or list would rebuild), each behind named methods.

Every object has one writer module (named in its docstring) and the pod/node watch
(:mod:`ckpt_operator.app.handlers`) that forgets an entry when the object is deleted; all
run on the operator's event loop, so none needs a lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "AgentAnswers",
    "NodeLabels",
    "NodeSignals",
    "PeerMaps",
    "RefusedAttempts",
    "ReportedPods",
]


class NodeSignals:
    """Node name → the last disruption request id signalled to its pods, ``""`` for a node
    known calm (:mod:`.disruption` writes it; a deleted node is forgotten). Saves listing a
    node's pods on every node event."""

    __slots__ = ("_by_node",)

    def __init__(self) -> None:
        self._by_node: dict[str, str] = {}

    def last(self, node: str) -> str | None:
        """The last signal of ``node`` (``""``: calm; None: unknown, e.g. after a restart)."""
        return self._by_node.get(node)

    def remember(self, node: str, signal: str) -> None:
        self._by_node[node] = signal

    def forget(self, node: str) -> None:
        self._by_node.pop(node, None)

    def __len__(self) -> int:
        return len(self._by_node)


class RefusedAttempts:
    """(namespace, TrainJob) → the newest JobSet restart attempt a pod refused by the webhook
    carried (:mod:`.admission` notes it, :mod:`.attempts` reads it, a deleted TrainJob is
    forgotten): JobSet labels a pod with the attempt it is at, so the attempt is due even
    while the JobSet watch is silent (kopf serves JobSets only once it discovered their
    CRD)."""

    __slots__ = ("_newest",)

    def __init__(self) -> None:
        self._newest: dict[tuple[str, str], int] = {}

    def note(self, namespace: str, trainjob: str, attempt: int) -> None:
        """A refused pod of ``attempt`` (an older attempt than one noted changes nothing)."""
        key = (namespace, trainjob)
        self._newest[key] = max(self._newest.get(key, 0), attempt)

    def newest(self, namespace: str, trainjob: str) -> int:
        """The newest attempt a refused pod carried (0: none)."""
        return self._newest.get((namespace, trainjob), 0)

    def forget(self, namespace: str, trainjob: str) -> None:
        self._newest.pop((namespace, trainjob), None)

    def __len__(self) -> int:
        return len(self._newest)


class _Uids:
    """A set of object uids, marked once and forgotten when the object is deleted."""

    __slots__ = ("_uids",)

    def __init__(self) -> None:
        self._uids: set[str] = set()

    def has(self, uid: str) -> bool:
        return uid in self._uids

    def mark(self, uid: str) -> None:
        self._uids.add(uid)

    def forget(self, uid: str) -> None:
        self._uids.discard(uid)

    def __len__(self) -> int:
        return len(self._uids)


class ReportedPods(_Uids):
    """Uids of unprotected pods already reported (:func:`.admission.report_unprotected`;
    once per pod; a deleted pod is forgotten)."""

    __slots__ = ()
    reported = _Uids.has


class AgentAnswers:
    """What each pod's agent metrics port answered the agent check's probes
    (:mod:`.agentcheck` writes it; a deleted pod is forgotten), keyed by pod uid and valid
    for its containers' restart count (the same processes):

    * serving: it answered; not probed again until a container restarts;
    * refused since: every probe of the same processes since then was refused; a refusal
      proves absence only once it has lasted a report deadline, and any other answer
      starts the suspicion over.
    """

    __slots__ = ("_refused", "_serving")

    def __init__(self) -> None:
        self._serving: dict[str, int] = {}
        self._refused: dict[str, tuple[int, float]] = {}

    def served_before(self, uid: str, restarts: int) -> bool:
        """The same processes (``restarts``) answered a probe before."""
        return self._serving.get(uid) == restarts

    def refused(self, uid: str, restarts: int, now: float) -> float:
        """A refusal at ``now``; returns since when the same processes have refused."""
        first = self._refused.get(uid)
        since = first[1] if first is not None and first[0] == restarts else now
        self._refused[uid] = (restarts, since)
        return since

    def answered(self, uid: str, restarts: int, *, serving: bool) -> None:
        """Any answer but a refusal (``serving``: the agent answered; else no verdict)."""
        self._refused.pop(uid, None)
        if serving:
            self._serving[uid] = restarts

    def forget(self, uid: str) -> None:
        self._serving.pop(uid, None)
        self._refused.pop(uid, None)

    def __len__(self) -> int:
        return len(self._serving.keys() | self._refused.keys())


class NodeLabels:
    """Node name → the labels the replica peer choice reads (its zone and rack labels only),
    from the node watch (:mod:`ckpt_operator.app.handlers` writes and forgets;
    :mod:`.replica_maps` reads; a miss is one API read there). Bounded: the oldest node
    noted is dropped past ``max_nodes``."""

    __slots__ = ("_by_node", "max_nodes")

    def __init__(self, max_nodes: int = 20_000) -> None:
        self._by_node: OrderedDict[str, dict[str, str]] = OrderedDict()
        self.max_nodes = max_nodes

    def note(self, name: str, labels: Mapping[str, Any], keys: Iterable[str]) -> None:
        """Remember ``keys`` of ``labels`` for node ``name`` (the newest note wins)."""
        kept = {k: v for k in keys if k and isinstance(v := labels.get(k), str)}
        self._by_node.pop(name, None)
        self._by_node[name] = kept
        while len(self._by_node) > self.max_nodes:
            self._by_node.popitem(last=False)

    def get(self, name: str) -> dict[str, str] | None:
        """The labels noted for ``name`` (None: not noted)."""
        got = self._by_node.get(name)
        return dict(got) if got is not None else None

    def forget(self, name: str) -> None:
        self._by_node.pop(name, None)

    def __len__(self) -> int:
        return len(self._by_node)


class PeerMaps(_Uids):
    """Uids of the jobs whose replica peer map exists (:mod:`.replica_maps` marks it once
    made or found made; a deleted job is forgotten): the map is never changed, so their pod
    events need no work."""

    __slots__ = ()
    done = _Uids.has
