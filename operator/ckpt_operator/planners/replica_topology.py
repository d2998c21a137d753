"""Which ranks hold each rank's replicas, rack- and zone-aware (docs/replicas.md). Pure.

The webhook names a pod's peers at admission, before the pod has a node: the next ``k``
ranks of a ring (:func:`~ckpt_operator.planners.replica_peers.ring`). Once every rank of
the job is scheduled the operator knows where each one runs and chooses again with
:func:`choose_peers`, from each rank's :class:`Placement` (its node and that node's zone
and rack labels), so that a failure that takes a zone or a rack does not take a rank's
replicas with it.

What :func:`choose_peers` guarantees, for a world of ``n`` ranks and ``k`` peers
(``k`` capped at ``n - 1``):

* **Never itself, never twice**: each rank gets exactly ``k`` distinct other ranks.
* **Balanced exactly as the ring**: every rank holds exactly ``k`` replicas, so the memory
  each sidecar needs (``docs/replicas.md``, "The receiver's store and its memory bound")
  is what it is today, whatever the topology.
* **Separated as far as that allows**: each peer is in another zone
  (:data:`ZONE_LABEL`) where one with room is left, else in another rack (the operator's
  ``--replica-rack-label``; none by default: Kubernetes has no standard rack label), else
  on another node, else (every rank on one node) the ring. A label missing on either
  node never counts as "another" zone or rack. The choice starts from the ring over the
  ranks spread across zones, racks and nodes (:func:`spread_order`) and then exchanges
  the targets of two pushes, or moves along a longer cycle, while that raises the lowest
  separation among them (the balance is kept by every such move). It is a local optimum, not a
  proven global one; tested: every layout of up to eight ranks in up to three zones (or
  racks) with ``k`` = 1 or 2 and no zone holding more than half of the ranks gets every
  peer in another zone, and no exchange of two pushes could raise a separation.
* **Deterministic**: the same placements give the same answer (no randomness, no
  dependence on dict or set order).
* **The ring when the labels do not tell nodes apart**: with one rank per node and no
  zone or rack label (or one zone and rack for all), the answer is
  :func:`~ckpt_operator.planners.replica_peers.ring`, peer for peer and in its order.

Ties go to the nearest rank after it in the spread order (each group's members at evenly
spaced positions), so the replicas of a zone go to every other zone's ranks, not all to
the first one. The work is about a second for a thousand ranks in three zones (one
thread); the search for longer cycles is bounded (:data:`CYCLE_BUDGET`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from fractions import Fraction
from typing import Any, Final, TypeVar

__all__ = [
    "ZONE_LABEL",
    "Placement",
    "Separation",
    "choose_peers",
    "separation",
    "spread_order",
]

ZONE_LABEL: Final = "topology.kubernetes.io/zone"
CYCLE_BUDGET: Final = 200_000
"""Candidate moves a search for a cycle of moves tries in all (bounds the work on large worlds; the
answer stays deterministic)."""
"""The well-known zone label (the cloud provider sets it on every node)."""

T = TypeVar("T")


class Separation(IntEnum):
    """What separates a rank from a peer: the larger, the fewer failures take both."""

    SAME_NODE = 0
    NODE = 1
    RACK = 2
    ZONE = 3


@dataclass(frozen=True)
class Placement:
    """Where one rank runs: its node (None: not known) and the node's zone and rack."""

    node: str | None
    zone: str | None = None
    rack: str | None = None

    @classmethod
    def of(cls, node: str | None, labels: Mapping[str, Any], rack_label: str | None) -> Placement:
        """A rank on node ``node`` whose labels are ``labels``; ``rack_label``: the label
        naming its rack (None or empty: racks are not known). Empty values count as none."""

        def value(key: str | None) -> str | None:
            got = labels.get(key) if key else None
            return got if isinstance(got, str) and got else None

        return cls(node or None, value(ZONE_LABEL), value(rack_label))


def separation(a: Placement, b: Placement) -> Separation:
    """How far apart two ranks are; an unknown node, zone or rack is never "another" one
    (two unknown nodes are different nodes, but never different zones or racks)."""
    if a.node is not None and a.node == b.node:
        return Separation.SAME_NODE
    if a.zone is not None and b.zone is not None and a.zone != b.zone:
        return Separation.ZONE
    if a.rack is not None and b.rack is not None and a.rack != b.rack:
        return Separation.RACK
    return Separation.NODE


def _interleave(groups: Sequence[Sequence[T]]) -> list[T]:
    """The groups' members merged, member ``i`` of a group of ``m`` at ``(2i + 1) / 2m``
    (exact fractions), ties in the groups' order."""
    keyed = [
        (Fraction(2 * i + 1, 2 * len(g)), gi, i)
        for gi, g in enumerate(groups)
        for i in range(len(g))
    ]
    return [groups[gi][i] for _, gi, i in sorted(keyed)]


def _grouped(items: Sequence[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """``items`` in groups of equal ``key``, the groups in the order of their first item."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def spread_order(placements: Sequence[Placement]) -> list[int]:
    """The ranks spread across zones, racks within a zone, nodes within a rack (a node's
    ranks in rank order), each level interleaved evenly (see the module doc). With one
    rank per node and no zone or rack told apart: ``0, 1, …, n - 1``."""

    def node_key(r: int) -> Hashable:
        node = placements[r].node
        return ("node", node) if node is not None else ("rank", r)

    def spread(ranks: list[int], levels: list[Callable[[int], Hashable]]) -> list[int]:
        if not levels:
            return ranks
        groups = _grouped(ranks, levels[0])
        return _interleave([spread(g, levels[1:]) for g in groups])

    levels: list[Callable[[int], Hashable]] = [
        lambda r: placements[r].zone,
        lambda r: placements[r].rack,
        node_key,
    ]
    return spread(list(range(len(placements))), levels)


class _Plan:
    """The choice being made: who pushes where (``peers``) and who pushes to whom
    (``pushers``), starting from the ring over the spread order."""

    def __init__(self, placements: Sequence[Placement], k: int) -> None:
        self.place = placements
        self.n = n = len(placements)
        self.order = order = spread_order(placements)
        self.pos = {r: i for i, r in enumerate(order)}
        self.peers = [[order[(self.pos[r] + i) % n] for i in range(1, k + 1)] for r in range(n)]
        self.pushers: list[set[int]] = [set() for _ in range(n)]
        for r, targets in enumerate(self.peers):
            for h in targets:
                self.pushers[h].add(r)
        self.budget = CYCLE_BUDGET
        """Candidate moves left to try (:meth:`_cycle`)."""
        self._zones = self._by(lambda p: p.zone)
        self._racks = self._by(lambda p: p.rack)
        self._nodes = self._by(lambda p: p.node)

    def _by(self, key: Callable[[Placement], str | None]) -> dict[str, list[int]]:
        """The ranks by a known ``key`` of their placement, each list in the spread order."""
        out: dict[str, list[int]] = {}
        for r in self.order:
            value = key(self.place[r])
            if value is not None:
                out.setdefault(value, []).append(r)
        return out

    def sep(self, a: int, b: int) -> int:
        return int(separation(self.place[a], self.place[b]))

    def dist(self, a: int, b: int) -> int:
        """How far ``b`` follows ``a`` in the spread ring (1 … n - 1)."""
        return (self.pos[b] - self.pos[a]) % self.n

    def above(self, r: int, level: int) -> list[int]:
        """The ranks more separated from ``r`` than ``level``, the most separated first,
        then the nearest after ``r`` in the spread ring."""
        me = self.place[r]
        found: set[int] = set()
        if level < Separation.ZONE and me.zone is not None:
            found.update(x for z, xs in self._zones.items() if z != me.zone for x in xs)
        if level < Separation.RACK and me.rack is not None:
            found.update(x for k, xs in self._racks.items() if k != me.rack for x in xs)
        if level < Separation.NODE:
            same = set(self._nodes.get(me.node, ())) if me.node is not None else set()
            found.update(x for x in range(self.n) if x not in same)
        found.discard(r)
        return sorted(found, key=lambda x: (-self.sep(r, x), self.dist(r, x)))

    def best(self) -> list[int]:
        """Per rank, the largest separation any other rank offers it."""
        zoned = sum(map(len, self._zones.values()))
        racked = sum(map(len, self._racks.values()))
        out = []
        for p in self.place:
            if p.zone is not None and zoned > len(self._zones[p.zone]):
                out.append(int(Separation.ZONE))
            elif p.rack is not None and racked > len(self._racks[p.rack]):
                out.append(int(Separation.RACK))
            elif p.node is None or self.n > len(self._nodes[p.node]):
                out.append(int(Separation.NODE))
            else:
                out.append(int(Separation.SAME_NODE))
        return out

    def improve(self) -> None:
        """Exchange the targets of two pushes (``r → h`` and ``q → s`` become ``r → s`` and
        ``q → h``), else move along a longer cycle (:meth:`_cycle`), while that raises the
        lowest of their separations, or keeps it and raises the next. Every rank still
        holds exactly what it held, and the sorted separations of all pushes only grow
        (from the lowest), so this ends."""
        best = self.best()
        changed = True
        while changed:
            changed = False
            for move in (self._exchange, self._cycle):
                for r in self.order:
                    for i in range(len(self.peers[r])):
                        if self.sep(r, self.peers[r][i]) < best[r] and move(r, i):
                            changed = True
                if changed:
                    break

    def _move(self, r: int, old: int, new: int) -> None:
        self.peers[r][self.peers[r].index(old)] = new
        self.pushers[old].discard(r)
        self.pushers[new].add(r)

    def _pushers(self, s: int, *without: int) -> list[int]:
        return sorted(self.pushers[s].difference(without), key=self.pos.__getitem__)

    def _exchange(self, r: int, i: int) -> bool:
        """The first exchange of two pushes that betters ``r``'s ``i``-th (see
        :meth:`improve`): the candidates most separated from ``r`` first, then the
        nearest; their pushers in the spread order."""
        h = self.peers[r][i]
        cur = self.sep(r, h)
        for s in self.above(r, cur):
            if s in self.peers[r]:
                continue
            for q in self._pushers(s, r):
                if q == h or h in self.peers[q]:
                    continue
                before = sorted((cur, self.sep(q, s)))
                after = sorted((self.sep(r, s), self.sep(q, h)))
                if after > before:
                    self._move(r, h, s)
                    self._move(q, s, h)
                    return True
        return False

    def _cycle(self, r: int, i: int) -> bool:
        """A longer cycle of moves, where no exchange of two helps: ``r`` takes ``s``
        instead of its ``i``-th peer ``h``, a pusher of ``s`` takes another rank instead,
        … until one takes ``h``. Every new push is more separated than ``r → h`` and every
        push replaced at least as separated, so the sorted separations grow
        (:meth:`improve`); each rank still holds what it held. The shortest such cycle
        (breadth first), :data:`CYCLE_BUDGET` candidates at most over all calls."""
        h = self.peers[r][i]
        cur = self.sep(r, h)
        came: dict[int, tuple[int, int]] = {}
        """holder → (the rank that moves to it, the holder that rank leaves)."""
        queue: deque[int] = deque()
        for s in self.above(r, cur):
            if s not in self.peers[r]:
                came[s] = (r, h)
                queue.append(s)
        while queue:
            x = queue.popleft()
            for q in self._pushers(x, r):
                if self.sep(q, x) < cur:
                    continue
                for t in self.above(q, cur):
                    self.budget -= 1
                    if self.budget < 0:
                        return False
                    if t in self.peers[q] or (t != h and t in came):
                        continue
                    if t == h:
                        if self._apply(came, [(q, x, h)], x):
                            return True
                        continue
                    came[t] = (q, x)
                    queue.append(t)
        return False

    def _apply(
        self, came: dict[int, tuple[int, int]], moves: list[tuple[int, int, int]], x: int
    ) -> bool:
        """The cycle ending with ``moves`` (mover, from, to) whose first holder is ``x``,
        made when every rank in it moves once."""
        while True:
            mover, left = came[x]
            moves.append((mover, left, x))
            if left == moves[0][2]:  # back at h: mover is r
                break
            x = left
        if len({m for m, _, _ in moves}) != len(moves):
            return False
        for mover, old, new in moves:
            self._move(mover, old, new)
        return True


def choose_peers(placements: Sequence[Placement], k: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's ``k`` peers (``placements[r]``: where rank ``r`` runs), best first; see
    the module doc for what is guaranteed. A world of one (or ``k`` = 0): no peers."""
    if k < 0:
        raise ValueError(f"peers must be >= 0, not {k}")
    n = len(placements)
    k = min(k, n - 1)
    if k <= 0:
        return tuple(() for _ in range(n))
    plan = _Plan(placements, k)
    plan.improve()
    return tuple(tuple(p) for p in plan.peers)
