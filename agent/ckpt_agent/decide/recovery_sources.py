"""Recovery from the fastest valid source: memory, a peer's replica or storage (pure, #31).

A rank's state may be in its node's shared memory (``local_memory``), in a peer node's
replica of some rank's snapshot (``peer_replica``) or in a committed checkpoint
(``storage``): :class:`~ckpt_agent.decide.source_candidates.SourceCandidate`.
:func:`choose_source` picks from every rank's candidates the one resume point all ranks
agree on (each rank, and the operator, runs it on the same gathered inputs):

* the newest step at which **every rank is covered**, never a mix of steps; only the
  newest lineage epoch present competes (an older one is a branch a pin abandoned);
* a rank is covered when a candidate supplies its **state** and one of its own supplies
  its **per-rank items** (RNG, data position: its snapshot or a heartbeat). Replicated state
  (DDP: weights and optimizer the same on every rank) may come from any rank's
  snapshot, sharded state (FSDP) only from that rank's shard;
* corrupted candidates, memory on a node that is gone and ranks outside the world are
  skipped and named; unverified ones are verified while loading (:func:`walk_sources`);
* per rank the sources at that step are ordered by estimated read time
  (:class:`~ckpt_agent.decide.source_candidates.SourceCosts`), ties to memory, then a
  replica, then storage, at most ``max_sources`` of them: the first is the choice, the
  rest its fallbacks, then the storage ladder (:mod:`ckpt_agent.decide.recovery`).

Memory is fast only where it lives: on the rank's node it is read at ``local_memory``
speed, from another node at ``peer_replica`` speed (node unknown: each kind at its
own). :func:`placement_preference` names the nodes holding the chosen data, for a
preferred (never required) node affinity of the restarted pods.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass
from itertools import islice

from ckpt_agent import tuning
from ckpt_agent.decide.recovery import Verdicts
from ckpt_agent.decide.source_candidates import (
    MEMORY_KINDS,
    Part,
    SourceCandidate,
    SourceCosts,
    SourceKind,
)
from ckpt_agent.records import Json

__all__ = [
    "RankSources",
    "SourceChoice",
    "SourceLoad",
    "SourceWalk",
    "choose_source",
    "placement_preference",
    "walk_sources",
]


@dataclass(frozen=True)
class RankSources:
    """One rank's sources at the chosen step, fastest first (the first is the choice)."""

    rank: int
    reader: str | None
    """The node the rank runs on (None: not known)."""
    state: tuple[SourceCandidate, ...]
    items: tuple[SourceCandidate, ...]
    seconds: float
    """Estimated read time of the chosen state source (and its items, when elsewhere)."""

    @property
    def kind(self) -> SourceKind:
        """Where the chosen state comes from."""
        return self.state[0].kind

    @property
    def path(self) -> SourceKind:
        """How it is read (memory on another node: ``peer_replica``, over the network)."""
        return SourceCosts.path(self.state[0], self.reader)


@dataclass(frozen=True)
class SourceChoice:
    """The resume point every rank agrees on (``step`` -1: none, use the storage ladder)."""

    step: int
    epoch: int
    ranks: tuple[RankSources, ...]
    reached: int
    """The newest step any rank reached (-1: unknown)."""
    reason: str
    skipped: tuple[tuple[SourceCandidate, str], ...] = ()
    uncovered: tuple[str, ...] = ()
    """Why each newer step was not chosen (newest first)."""

    @property
    def use_ladder(self) -> bool:
        return self.step < 0

    @property
    def steps_lost(self) -> int | None:
        """Steps between the newest step reached and the choice (None: the ladder decides)."""
        return None if self.use_ladder or self.reached < 0 else max(0, self.reached - self.step)

    def event_fields(self) -> dict[str, Json]:
        """What the Event and the report's line say (bounded for any world size)."""
        kinds: dict[str, int] = {}
        for r in self.ranks:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        return {
            "step": self.step,
            "epoch": self.epoch,
            "steps_lost": self.steps_lost,
            "ranks_by_source": kinds,
            "nodes": sorted({r.state[0].location for r in self.ranks if r.kind != "storage"})[:16],
            "skipped": len(self.skipped),
            "reason": self.reason,
        }


def _key(c: SourceCandidate) -> tuple[int, int]:
    return (c.epoch, c.step)


def _exclusion(
    c: SourceCandidate, world_size: int, alive: frozenset[str] | None, epoch: int
) -> str | None:
    if c.verdict == "corrupted":
        return "corrupted (failed verification)"
    if c.rank >= world_size:
        return f"rank {c.rank} is outside the world of {world_size}"
    if alive is not None and c.kind in MEMORY_KINDS and c.location not in alive:
        return f"node {c.location} is gone"
    if c.epoch < epoch:
        return f"older resume lineage (epoch {c.epoch} < {epoch}): the storage ladder decides"
    return None


def _ordered(
    pool: Iterable[SourceCandidate], reader: str | None, costs: SourceCosts, part: Part, limit: int
) -> tuple[SourceCandidate, ...]:
    return tuple(heapq.nsmallest(limit, pool, key=lambda c: costs.order(c, reader, part)))


class _SharedState:
    """The replicated state's sources in order for each reader node, computed once per
    node: the ones in that node's memory merged into one order of all the others (read
    from anywhere else they cost the same), so a large world stays linear."""

    def __init__(self, pool: list[SourceCandidate], costs: SourceCosts, limit: int) -> None:
        self.pool, self.costs, self.limit = pool, costs, limit
        # "" is no node (a location is never empty): every memory source is read remotely
        self.remote = sorted(pool, key=lambda c: costs.order(c, "", "state"))
        self.on: dict[str, list[SourceCandidate]] = {}
        for c in pool:
            if c.kind in MEMORY_KINDS:
                self.on.setdefault(c.location, []).append(c)
        self.done: dict[str | None, tuple[SourceCandidate, ...]] = {}

    def __call__(self, reader: str | None) -> tuple[SourceCandidate, ...]:
        if reader not in self.done:
            if reader is None:
                self.done[reader] = _ordered(self.pool, None, self.costs, "state", self.limit)
            else:
                local = self.on.get(reader, [])
                rest = (
                    c for c in self.remote if c.kind not in MEMORY_KINDS or c.location != reader
                )
                merged = heapq.merge(
                    _ordered(local, reader, self.costs, "state", self.limit),
                    rest,
                    key=lambda c: self.costs.order(c, reader, "state"),
                )
                self.done[reader] = tuple(islice(merged, self.limit))
        return self.done[reader]


def _cover(
    at: Sequence[SourceCandidate],
    world_size: int,
    sharded: bool,
    rank_nodes: Mapping[int, str],
    costs: SourceCosts,
    limit: int,
) -> tuple[list[RankSources], list[str]]:
    """Every rank's ordered sources at one step, or what the uncovered ranks lack."""
    shards: dict[int, list[SourceCandidate]] = {}
    items: dict[int, list[SourceCandidate]] = {}
    for c in at:
        if c.has_state:
            shards.setdefault(c.rank, []).append(c)
        if c.has_rank_items:
            items.setdefault(c.rank, []).append(c)
    shared = [c for c in at if c.has_state]
    missing: list[str] = []
    for r in range(world_size):
        served = r in shards if sharded else bool(shared)
        lacks = [] if served else ["its shard" if sharded else "the state"]
        lacks += [] if r in items else ["its RNG and data position"]
        if lacks:
            missing.append(f"rank {r} lacks {' and '.join(lacks)}")
    if missing:
        return [], missing
    state_for = _SharedState(shared, costs, limit)
    covered: list[RankSources] = []
    for r in range(world_size):
        reader = rank_nodes.get(r)
        state = _ordered(shards[r], reader, costs, "state", limit) if sharded else state_for(reader)
        own = _ordered(items[r], reader, costs, "items", limit)
        seconds = costs.read_seconds(state[0], reader)
        if own[0] != state[0]:
            seconds += costs.read_seconds(own[0], reader, "items")
        covered.append(RankSources(r, reader, state, own, seconds))
    return covered, []


def _capped(parts: Sequence[str], limit: int) -> str:
    return "; ".join(parts[:limit]) + (f"; {len(parts) - limit} more" if len(parts) > limit else "")


def _summary(ranks: Sequence[RankSources]) -> str:
    groups: dict[str, list[str]] = {}
    for r in ranks:
        c = r.state[0]
        what = f"{c.kind.replace('_', ' ')} {c.location}"
        if c.kind != "storage":
            what += " (local)" if r.path == "local_memory" else " (remote)"
        groups.setdefault(what, []).append(str(r.rank))
    listed = [
        f"rank {','.join(rs[:8])}{f' +{len(rs) - 8}' if len(rs) > 8 else ''} from {what}"
        for what, rs in groups.items()
    ]
    return _capped(listed, 4)


def choose_source(
    candidates: Iterable[SourceCandidate],
    world_size: int,
    *,
    sharded: bool,
    rank_nodes: Mapping[int, str] | None = None,
    nodes_alive: Collection[str] | None = None,
    reached: int | None = None,
    costs: SourceCosts | None = None,
    max_sources: int | None = None,
) -> SourceChoice:
    """The newest step every rank can resume from, each rank's sources fastest first.

    ``rank_nodes``: the node each rank runs on (None or missing: not placed yet).
    ``nodes_alive``: the nodes that still exist (None: unknown, every one counts).
    ``reached``: the newest step any rank completed (default: the newest candidate's of
    the chosen lineage, corrupted ones included). ``max_sources``: the most sources
    listed per rank and part (default :data:`~ckpt_agent.tuning.MAX_RESUME_CANDIDATES`:
    forged or countless candidates never make a start verify without end).
    See the module docstring for the rules.
    """
    if world_size < 1:
        raise ValueError(f"world size {world_size}: a job has at least one rank")
    limit = tuning.MAX_RESUME_CANDIDATES if max_sources is None else max_sources
    if limit < 1:
        raise ValueError(f"max_sources {limit}: at least one source per rank is listed")
    costs = costs if costs is not None else SourceCosts()
    nodes = dict(rank_nodes or {})
    alive = None if nodes_alive is None else frozenset(nodes_alive)
    every = sorted(set(candidates), key=lambda c: (_key(c), astuple(c)), reverse=True)
    epoch = max((c.epoch for c in every if not _exclusion(c, world_size, alive, 0)), default=0)
    if reached is None:
        reached = max((c.step for c in every if c.epoch >= epoch), default=-1)
    skipped: list[tuple[SourceCandidate, str]] = []
    at: dict[tuple[int, int], list[SourceCandidate]] = {}
    for c in every:  # newest first
        if (why := _exclusion(c, world_size, alive, epoch)) is None:
            at.setdefault(_key(c), []).append(c)
        else:
            skipped.append((c, why))
    named = "".join(f"; skipped {c.label}: {why}" for c, why in skipped[:3])
    named += f"; {len(skipped) - 3} more skipped" if len(skipped) > 3 else ""
    uncovered: list[str] = []
    for (ep, step), found in at.items():
        ranks, missing = _cover(found, world_size, sharded, nodes, costs, limit)
        if missing:
            uncovered.append(f"step {step}: " + _capped(missing, 2))
            continue
        reason = (
            f"step {step} (epoch {ep}) on every rank: {_summary(ranks)}; "
            f"est. {max(r.seconds for r in ranks):.2f} s to read; "
            f"{max(0, reached - step)} step(s) lost"
            + (f" (newer {uncovered[0]})" if uncovered else "")
            + named
        )
        return SourceChoice(
            step, ep, tuple(ranks), reached, reason, tuple(skipped), tuple(uncovered)
        )
    what = f"no step is covered on every rank ({uncovered[0]})" if uncovered else "no source"
    reason = f"{what}: the storage ladder decides{named}"
    return SourceChoice(-1, epoch, (), reached, reason, tuple(skipped), tuple(uncovered))


def placement_preference(
    choice: SourceChoice, nodes_alive: Collection[str]
) -> list[tuple[str, int]]:
    """Nodes to prefer for the restarted pods, weighted 1-100, heaviest first: where the
    chosen memory snapshots and replicas live (by the state bytes read there).

    For a ``preferredDuringSchedulingIgnoredDuringExecution`` term: a preference only,
    never a requirement. Empty when every rank reads from storage or the nodes are gone.
    """
    alive = frozenset(nodes_alive)
    load: dict[str, int] = {}
    for r in choice.ranks:
        c = r.state[0]
        if c.kind in MEMORY_KINDS and c.location in alive:
            load[c.location] = load.get(c.location, 0) + c.nbytes + 1
    if not load:
        return []
    weights = {n: max(1, round(100 * b / max(load.values()))) for n, b in load.items()}
    return sorted(weights.items(), key=lambda p: (-p[1], p[0]))


@dataclass(frozen=True)
class SourceLoad:
    """The sources one rank loads, each verified."""

    rank: int
    state: SourceCandidate
    items: SourceCandidate


@dataclass(frozen=True)
class SourceWalk:
    """What :func:`walk_sources` found (``use_ladder``: a rank has no verified source)."""

    loads: tuple[SourceLoad, ...]
    rejected: tuple[tuple[SourceCandidate, str], ...]
    use_ladder: bool
    reason: str


def walk_sources(
    choice: SourceChoice,
    verify: Callable[[SourceCandidate], bool],
    ranks: Collection[int] | None = None,
) -> SourceWalk:
    """Per rank (``ranks``: those this caller loads, default all), the first state source
    and the first rank-items source that verify, in the choice's order.

    ``verify`` is asked at most once per candidate; an exception counts as a failure,
    except a :class:`~ckpt_agent.errors.RetryableError`, which propagates (as in
    :func:`ckpt_agent.decide.recovery.walk`). When any rank runs out, ``use_ladder``: every
    rank must then resume from storage (the callers agree on it, never a mix), or choose
    again with the rejected candidates marked ``corrupted`` (an older step may be covered).
    """
    if choice.use_ladder:
        return SourceWalk((), (), True, choice.reason)
    wanted = None if ranks is None else frozenset(ranks)
    mine = [r for r in choice.ranks if wanted is None or r.rank in wanted]
    every = dict.fromkeys(c for r in mine for c in (*r.state, *r.items))
    ids = {f"<source {i}>": c for i, c in enumerate(every)}
    key = {c: k for k, c in ids.items()}
    check = Verdicts(lambda k: verify(ids[k]))
    loads: list[SourceLoad] = []
    rejected: dict[SourceCandidate, str] = {}
    for r in mine:
        found: list[SourceCandidate] = []
        for part, options in (("state", r.state), ("RNG and data position", r.items)):
            for c in options:
                ok, why = check(key[c])
                if ok:
                    found.append(c)
                    break
                rejected[c] = why.replace(key[c], c.label)
            else:
                reason = (
                    f"rank {r.rank}: no source of its {part} at step {choice.step} verified "
                    f"({len(options)} tried): the storage ladder decides"
                )
                return SourceWalk(tuple(loads), tuple(rejected.items()), True, reason)
        loads.append(SourceLoad(r.rank, *found))
    failed = f", {len(rejected)} source(s) failed verification" if rejected else ""
    reason = f"step {choice.step}: {len(loads)} rank(s) verified{failed}"
    return SourceWalk(tuple(loads), tuple(rejected.items()), False, reason)
