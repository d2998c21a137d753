"""Recovery from the fastest valid source: the newest step every rank covers, never a mix.

Tables for the rules one by one, then property checks over generated candidate sets
(``random.Random(seed)``) against a plain reference: the chosen step is the newest one
every rank covers, every listed source is usable and at that step, the lists are in read
order, the answer does not depend on the order the candidates arrive in.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ckpt_agent.decide.recovery_sources import (
    SourceChoice,
    choose_source,
    placement_preference,
    walk_sources,
)
from ckpt_agent.decide.source_candidates import (
    MEMORY_KINDS,
    SourceCandidate,
    SourceCosts,
    SourceKind,
    SourceVerdict,
)
from ckpt_agent.errors import RetryableError

GB = 10**9


def mem(rank: int, step: int, node: str, **kw: object) -> SourceCandidate:
    return SourceCandidate("local_memory", rank, step, node, **kw)  # type: ignore[arg-type]


def rep(rank: int, step: int, node: str, **kw: object) -> SourceCandidate:
    return SourceCandidate("peer_replica", rank, step, node, **kw)  # type: ignore[arg-type]


def sto(rank: int, step: int, **kw: object) -> SourceCandidate:
    kw.setdefault("verdict", "verified")
    return SourceCandidate("storage", rank, step, f"pulse_step_{step}", **kw)  # type: ignore[arg-type]


def storage_ckpt(
    step: int, world: int, *, sharded: bool, nbytes: int = GB
) -> list[SourceCandidate]:
    """A committed checkpoint as the format writes it: DDP state in rank 0's part only."""
    return [
        sto(r, step, nbytes=nbytes if sharded or r == 0 else 0, has_state=sharded or r == 0)
        for r in range(world)
    ]


def chosen(choice: SourceChoice) -> list[tuple[int, str, str]]:
    """(rank, kind, location) of each rank's chosen state source."""
    return [(r.rank, r.kind, r.state[0].location) for r in choice.ranks]


# --- tables: the rules one by one -------------------------------------------------------


def test_every_rank_in_its_own_memory_beats_an_older_checkpoint() -> None:
    cands = [mem(0, 10, "a", nbytes=GB), mem(1, 10, "b", has_state=False)]
    got = choose_source(
        [*cands, *storage_ckpt(8, 2, sharded=False)], 2, sharded=False, rank_nodes={0: "a", 1: "b"}
    )
    assert got.step == 10 and got.steps_lost == 0 and not got.use_ladder
    assert chosen(got) == [(0, "local_memory", "a"), (1, "local_memory", "a")]
    assert [r.path for r in got.ranks] == ["local_memory", "peer_replica"]
    assert got.ranks[1].items[0] == cands[1]  # rank 1's RNG and data position: its own
    assert "step 10 (epoch 0) on every rank" in got.reason and "0 step(s) lost" in got.reason


def test_node_lost_the_peers_replica_serves_it() -> None:
    """Node b is gone with rank 1's memory; node a holds a replica of rank 1's snapshot."""
    cands = [
        mem(0, 10, "a", nbytes=GB),
        mem(1, 10, "b", nbytes=GB),
        rep(1, 10, "a", nbytes=GB, verdict="verified"),
        *storage_ckpt(8, 2, sharded=True),
    ]
    got = choose_source(cands, 2, sharded=True, nodes_alive={"a", "c"})
    assert got.step == 10
    assert chosen(got) == [(0, "local_memory", "a"), (1, "peer_replica", "a")]
    assert [c.kind for c in got.ranks[1].state] == ["peer_replica"]  # its memory on b: gone
    assert any("node b is gone" in why for _, why in got.skipped)
    assert "peer replica a (remote)" in got.reason


def test_ddp_a_rank_without_its_own_items_is_not_covered() -> None:
    """DDP: rank 0's replicated state serves rank 1's weights, never its RNG."""
    cands = [mem(0, 10, "a", nbytes=GB), *storage_ckpt(8, 2, sharded=False)]
    got = choose_source(cands, 2, sharded=False)
    assert got.step == 8 and got.steps_lost == 2
    assert got.uncovered == ("step 10: rank 1 lacks its RNG and data position",)
    assert {r.kind for r in got.ranks} == {"storage"}


def test_ddp_a_heartbeat_supplies_a_ranks_items() -> None:
    heartbeat = sto(1, 10, has_state=False)
    cands = [mem(0, 10, "a", nbytes=GB), heartbeat, *storage_ckpt(8, 2, sharded=False)]
    got = choose_source(cands, 2, sharded=False)
    assert got.step == 10
    assert got.ranks[1].state[0].rank == 0 and got.ranks[1].items == (heartbeat,)


def test_sharded_never_mixes_steps() -> None:
    """Rank 1's shard of step 10 is missing: both go back to step 8, never 10 and 8."""
    cands = [mem(0, 10, "a"), mem(0, 8, "a"), mem(1, 8, "b"), *storage_ckpt(6, 2, sharded=True)]
    got = choose_source(cands, 2, sharded=True)
    assert got.step == 8 and {c.step for r in got.ranks for c in (*r.state, *r.items)} == {8}
    assert got.uncovered == ("step 10: rank 1 lacks its shard and its RNG and data position",)


def test_sharded_a_shard_serves_only_its_rank() -> None:
    got = choose_source([mem(0, 10, "a"), mem(1, 10, "b", has_state=False)], 2, sharded=True)
    assert got.use_ladder and "rank 1 lacks its shard" in got.reason
    assert got.steps_lost is None


def test_corrupted_is_skipped_and_named_the_next_source_is_used() -> None:
    bad = mem(0, 10, "a", verdict="corrupted")
    cands = [bad, rep(0, 10, "b"), mem(1, 10, "b")]
    got = choose_source(cands, 2, sharded=True)
    assert got.step == 10 and bad not in got.ranks[0].state
    assert (bad, "corrupted (failed verification)") in got.skipped
    assert "skipped rank 0 local_memory step 10 on node a: corrupted" in got.reason


def test_a_corrupted_newest_step_counts_for_the_steps_lost() -> None:
    cands = [mem(0, 12, "a", verdict="corrupted"), mem(0, 10, "a")]
    got = choose_source(cands, 1, sharded=False)
    assert (got.step, got.reached, got.steps_lost) == (10, 12, 2)
    assert choose_source(cands, 1, sharded=False, reached=15).steps_lost == 5


@pytest.mark.parametrize(
    ("reader", "first"),
    [
        (None, ["local_memory", "peer_replica", "storage"]),
        ("a", ["local_memory", "peer_replica", "storage"]),  # the memory is on the reader
        ("b", ["peer_replica", "local_memory", "storage"]),  # the replica is on the reader
        ("c", ["local_memory", "peer_replica", "storage"]),  # both remote: kind breaks the tie
    ],
)
def test_at_equal_step_memory_then_replica_then_storage_where_read(
    reader: str | None, first: list[str]
) -> None:
    cands = [mem(0, 10, "a", nbytes=GB), rep(0, 10, "b", nbytes=GB), sto(0, 10, nbytes=GB)]
    got = choose_source(cands, 1, sharded=False, rank_nodes={} if reader is None else {0: reader})
    assert [c.kind for c in got.ranks[0].state] == first


def test_costs_are_a_parameter_a_slow_shm_loses_to_the_network() -> None:
    costs = SourceCosts(gbps={"local_memory": 0.1, "peer_replica": 5.0, "storage": 1.0})
    cands = [mem(0, 10, "a", nbytes=GB), rep(0, 10, "b", nbytes=GB)]
    got = choose_source(cands, 1, sharded=False, costs=costs)
    assert [c.kind for c in got.ranks[0].state] == ["peer_replica", "local_memory"]


def test_memory_newer_than_storage_only_when_every_rank_is_covered() -> None:
    cands = [mem(0, 12, "a"), mem(1, 12, "b"), mem(2, 11, "c"), *storage_ckpt(10, 3, sharded=True)]
    got = choose_source(cands, 3, sharded=True)
    assert got.step == 10 and {r.kind for r in got.ranks} == {"storage"}
    assert got.uncovered == (
        "step 12: rank 2 lacks its shard and its RNG and data position",
        "step 11: rank 0 lacks its shard and its RNG and data position; rank 1 lacks its "
        "shard and its RNG and data position",
    )


def test_storage_newer_than_memory_wins() -> None:
    got = choose_source([mem(0, 8, "a"), *storage_ckpt(10, 1, sharded=False)], 1, sharded=False)
    assert got.step == 10 and got.ranks[0].kind == "storage"
    assert [c.step for c in got.ranks[0].state] == [10]


def test_only_the_newest_lineage_competes() -> None:
    """A pin opened epoch 1 at step 50: the abandoned branch's step 100 is never used."""
    stale = mem(0, 100, "a", epoch=0)
    got = choose_source([stale, mem(0, 60, "a", epoch=1)], 1, sharded=False)
    assert (got.step, got.epoch, got.reached) == (60, 1, 60)
    assert any(c == stale and "older resume lineage" in why for c, why in got.skipped)


def test_ranks_outside_the_world_are_skipped() -> None:
    got = choose_source([mem(0, 10, "a"), mem(3, 10, "b")], 2, sharded=False)
    assert got.use_ladder and "rank 3 is outside the world of 2" in got.reason
    assert "rank 1 lacks" in got.reason


def test_nothing_at_all_means_the_ladder() -> None:
    got = choose_source([], 4, sharded=False)
    assert (
        got.use_ladder and got.ranks == () and got.reason == "no source: the storage ladder decides"
    )
    assert placement_preference(got, ["a"]) == []
    assert walk_sources(got, lambda c: True).use_ladder


def test_max_sources_bounds_each_list() -> None:
    cands = [rep(0, 10, f"n{i}") for i in range(50)]
    assert len(choose_source(cands, 1, sharded=False).ranks[0].state) == 32
    got = choose_source(cands, 1, sharded=False, max_sources=3, rank_nodes={0: "n7"})
    assert [c.location for c in got.ranks[0].state] == ["n7", "n0", "n1"]


def test_the_same_answer_whatever_the_order_of_the_candidates() -> None:
    cands = [
        mem(0, 10, "a"),
        rep(0, 10, "b"),
        rep(1, 10, "a"),
        mem(1, 10, "b", verdict="verified"),
        *storage_ckpt(8, 2, sharded=False),
    ]
    want = choose_source(cands, 2, sharded=False, rank_nodes={0: "a", 1: "c"})
    for seed in range(20):
        shuffled = random.Random(seed).sample(cands, len(cands))
        assert choose_source(shuffled, 2, sharded=False, rank_nodes={0: "a", 1: "c"}) == want


def test_the_reason_stays_short_for_many_ranks() -> None:
    cands = [mem(0, 10, "a", nbytes=GB)] + [mem(r, 10, "a", has_state=False) for r in range(20)]
    got = choose_source(cands, 20, sharded=False, rank_nodes=dict.fromkeys(range(20), "a"))
    assert got.reason.startswith(
        "step 10 (epoch 0) on every rank: rank 0,1,2,3,4,5,6,7 +12 from local memory a (local);"
    )


def test_event_fields_are_bounded_and_say_where_from() -> None:
    cands = [mem(r, 10, f"n{r}") for r in range(40)]
    got = choose_source(cands, 40, sharded=True).event_fields()
    assert got["ranks_by_source"] == {"local_memory": 40} and got["steps_lost"] == 0
    assert len(got["nodes"]) == 16 and got["step"] == 10


def test_arguments_that_cannot_be() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        choose_source([], 0, sharded=False)
    with pytest.raises(ValueError, match="at least one source"):
        choose_source([], 1, sharded=False, max_sources=0)


# --- placement --------------------------------------------------------------------------


def test_placement_prefers_where_the_chosen_data_is_by_bytes() -> None:
    cands = [mem(0, 10, "a", nbytes=4 * GB), mem(1, 10, "a", nbytes=4 * GB)]
    cands += [rep(2, 10, "b", nbytes=2 * GB), mem(3, 10, "c", nbytes=GB)]
    got = choose_source(cands, 4, sharded=True)
    assert placement_preference(got, ["a", "b", "c"]) == [("a", 100), ("b", 25), ("c", 13)]
    assert placement_preference(got, ["b"]) == [("b", 100)]  # a and c are gone
    assert placement_preference(got, []) == []


def test_placement_is_empty_for_storage() -> None:
    got = choose_source(storage_ckpt(8, 2, sharded=False), 2, sharded=False)
    assert placement_preference(got, ["a", "pulse_step_8"]) == []


# --- the walk ---------------------------------------------------------------------------


def ddp_choice() -> SourceChoice:
    cands = [
        mem(0, 10, "a", nbytes=GB),
        rep(0, 10, "b", nbytes=GB),
        mem(1, 10, "b", has_state=False),
        sto(1, 10, has_state=False),
    ]
    return choose_source(cands, 2, sharded=False, rank_nodes={0: "a", 1: "b"})


def test_walk_takes_the_first_source_that_verifies_and_asks_once_each() -> None:
    choice = ddp_choice()
    asked: list[SourceCandidate] = []

    def verify(c: SourceCandidate) -> bool:
        asked.append(c)
        return not (c.kind == "local_memory" and c.location == "a")

    got = walk_sources(choice, verify)
    assert not got.use_ladder
    assert [(load.rank, load.state.kind, load.items.kind) for load in got.loads] == [
        (0, "peer_replica", "peer_replica"),
        (1, "peer_replica", "local_memory"),
    ]
    assert len(asked) == len(set(asked)) == 3
    assert [(c.location, why) for c, why in got.rejected] == [
        ("a", "rank 0 local_memory step 10 on node a failed verification")
    ]
    assert "2 rank(s) verified, 1 source(s) failed verification" in got.reason


def test_each_ranks_read_time_counts_its_items_only_when_read_elsewhere() -> None:
    """Rank 0 reads state and items from one local snapshot; rank 1 reads rank 0's state
    from the replica in its node's memory and its items from its own snapshot."""
    choice = ddp_choice()
    assert [round(r.seconds, 6) for r in choice.ranks] == [0.051, 0.052]
    assert "est. 0.05 s to read" in choice.reason


def test_walk_only_the_ranks_asked_for() -> None:
    got = walk_sources(ddp_choice(), lambda c: True, ranks=[1])
    assert [load.rank for load in got.loads] == [1]


def test_walk_every_source_failing_means_the_ladder() -> None:
    got = walk_sources(ddp_choice(), lambda c: c.has_state)
    assert got.use_ladder and [load.rank for load in got.loads] == [0]
    assert got.reason == (
        "rank 1: no source of its RNG and data position at step 10 verified (2 tried): "
        "the storage ladder decides"
    )


def test_walk_an_exception_is_a_failure_a_retryable_one_propagates() -> None:
    def broken(c: SourceCandidate) -> bool:
        raise OSError("bad read")

    got = walk_sources(ddp_choice(), broken)
    assert got.use_ladder
    assert got.rejected[0][1] == (
        "rank 0 local_memory step 10 on node a verification raised OSError: bad read"
    )

    def outage(c: SourceCandidate) -> bool:
        raise RetryableError("peer busy")

    with pytest.raises(RetryableError):
        walk_sources(ddp_choice(), outage)


# --- properties over generated candidate sets -------------------------------------------

STEPS = (4, 6, 8, 10)
ALL_KINDS: list[SourceKind] = ["local_memory", "peer_replica", "storage"]
MEMORY: list[SourceKind] = ["local_memory", "peer_replica"]
VERDICTS: list[SourceVerdict] = ["verified", "unverified", "unverified", "corrupted"]


def generate(rng: random.Random) -> tuple[list[SourceCandidate], int, dict[str, object]]:
    world = rng.randint(1, 4)
    sharded = rng.random() < 0.5
    nodes = [f"n{i}" for i in range(rng.randint(1, 4))]
    cands: list[SourceCandidate] = []
    for step in rng.sample(STEPS, rng.randint(0, 3)):  # snapshots of most ranks at a step
        epoch = rng.choice([0, 0, 0, 1])
        for r in range(world):
            for _ in range(rng.choice([0, 1, 1, 1, 2])):
                cands.append(
                    SourceCandidate(
                        rng.choice(MEMORY),
                        r,
                        step,
                        rng.choice(nodes),
                        rng.choice(VERDICTS),
                        rng.choice([GB, 4 * GB]),
                        sharded or r == 0 or rng.random() < 0.3,
                        True,
                        epoch,
                    )
                )
    for _ in range(rng.randint(0, 12)):  # and anything
        kind = rng.choice(ALL_KINDS)
        step = rng.choice(STEPS)
        state, items = rng.choice([(True, True), (True, True), (True, False), (False, True)])
        cands.append(
            SourceCandidate(
                kind,
                rng.randrange(world + (rng.random() < 0.1)),
                step,
                rng.choice(nodes) if kind in MEMORY_KINDS else f"ckpt_{step}",
                rng.choice(VERDICTS),
                rng.choice([0, 10**6, GB, 4 * GB]),
                state,
                items,
                rng.choice([0, 0, 0, 0, 1]),
            )
        )
    if rng.random() < 0.4:  # a whole committed checkpoint
        cands += storage_ckpt(rng.choice(STEPS), world, sharded=sharded)
    kw: dict[str, object] = {"sharded": sharded}
    if rng.random() < 0.7:
        kw["rank_nodes"] = {r: rng.choice(nodes) for r in range(world) if rng.random() < 0.8}
    if rng.random() < 0.5:
        kw["nodes_alive"] = [n for n in nodes if rng.random() < 0.7]
    if rng.random() < 0.3:
        kw["max_sources"] = rng.randint(1, 3)
    return cands, world, kw


def usable(c: SourceCandidate, world: int, kw: dict[str, object]) -> bool:
    alive = kw.get("nodes_alive")
    gone = alive is not None and c.kind in MEMORY_KINDS and c.location not in alive  # type: ignore[operator]
    return c.verdict != "corrupted" and c.rank < world and not gone


def serves(c: SourceCandidate, rank: int, sharded: bool) -> tuple[bool, bool]:
    """(supplies rank's state, supplies rank's items)."""
    return c.has_state and (c.rank == rank or not sharded), c.has_rank_items and c.rank == rank


def reference(cands: Sequence[SourceCandidate], world: int, kw: dict[str, object]) -> int:
    """The newest step every rank covers, the plain way (-1: none)."""
    ok = [c for c in cands if usable(c, world, kw)]
    epoch = max((c.epoch for c in ok), default=0)
    ok = [c for c in ok if c.epoch == epoch]
    sharded = bool(kw["sharded"])

    def covered(step: int) -> bool:
        at = [c for c in ok if c.step == step]
        return all(
            any(serves(c, r, sharded)[0] for c in at) and any(serves(c, r, sharded)[1] for c in at)
            for r in range(world)
        )

    return max((s for s in STEPS if covered(s)), default=-1)


def cases(n: int) -> list[tuple[int, list[SourceCandidate], int, dict[str, object]]]:
    return [(seed, *generate(random.Random(seed))) for seed in range(n)]


def check_lists(
    choice: SourceChoice, cands: list[SourceCandidate], world: int, kw: dict[str, object]
) -> None:
    costs, sharded = SourceCosts(), bool(kw["sharded"])
    limit = int(kw.get("max_sources", 32))  # type: ignore[call-overload]
    assert [r.rank for r in choice.ranks] == list(range(world))
    for r in choice.ranks:
        for part, options, which in (("state", r.state, 0), ("items", r.items, 1)):
            assert options, "a chosen step covers every rank"
            for c in options:
                assert c.step == choice.step and c.epoch == choice.epoch  # never a mix
                assert usable(c, world, kw) and c.verdict != "corrupted"
                assert serves(c, r.rank, sharded)[which]
            keys = [costs.order(c, r.reader, part) for c in options]  # type: ignore[arg-type]
            assert keys == sorted(keys), "fallbacks ordered by cost"
            want = sorted(
                (
                    c
                    for c in set(cands)
                    if c.step == choice.step
                    and c.epoch == choice.epoch
                    and usable(c, world, kw)
                    and serves(c, r.rank, sharded)[which]
                ),
                key=lambda c: costs.order(c, r.reader, part),  # type: ignore[arg-type]
            )
            assert list(options) == want[:limit], "every usable source, fastest first, cut"


@pytest.mark.parametrize(("seed", "cands", "world", "kw"), cases(300))
def test_property_the_newest_fully_covered_step_with_ordered_sources(
    seed: int, cands: list[SourceCandidate], world: int, kw: dict[str, object]
) -> None:
    choice = choose_source(cands, world, **kw)  # type: ignore[arg-type]
    assert choice.step == reference(cands, world, kw)
    for c in cands:
        if c.verdict == "corrupted" and c.rank < world:
            assert any(s == c and "corrupted" in why for s, why in choice.skipped)
    if choice.use_ladder:
        assert choice.ranks == () and "the storage ladder decides" in choice.reason
        return
    assert choice.steps_lost is not None and choice.steps_lost >= 0
    check_lists(choice, cands, world, kw)
    shuffled = random.Random(seed).sample(cands, len(cands))
    assert choose_source(shuffled, world, **kw) == choice  # type: ignore[arg-type]


@pytest.mark.parametrize(("seed", "cands", "world", "kw"), cases(300))
def test_property_placement_is_a_preference_where_the_chosen_memory_is(
    seed: int, cands: list[SourceCandidate], world: int, kw: dict[str, object]
) -> None:
    choice = choose_source(cands, world, **kw)  # type: ignore[arg-type]
    nodes = [f"n{i}" for i in range(4)]
    got = placement_preference(choice, nodes)
    where = {r.state[0].location for r in choice.ranks if r.kind in MEMORY_KINDS}
    assert {n for n, _ in got} == where
    assert all(1 <= w <= 100 for _, w in got) and (not got or got[0][1] == 100)
    if all(r.kind == "storage" for r in choice.ranks):
        assert got == []


@pytest.mark.parametrize(("seed", "cands", "world", "kw"), cases(200))
def test_property_the_walk_loads_the_first_verifying_source_of_each_rank(
    seed: int, cands: list[SourceCandidate], world: int, kw: dict[str, object]
) -> None:
    choice = choose_source(cands, world, **kw)  # type: ignore[arg-type]
    bad = {c for c in cands if random.Random(f"{seed}{c}").random() < 0.3}

    def verify(c: SourceCandidate) -> bool:
        return c not in bad

    got = walk_sources(choice, verify)
    assert {c for c, _ in got.rejected} <= bad
    first = [
        (
            next((c for c in r.state if c not in bad), None),
            next((c for c in r.items if c not in bad), None),
        )
        for r in choice.ranks
    ]
    if choice.use_ladder or any(None in pair for pair in first):
        assert got.use_ladder
    else:
        assert [(load.state, load.items) for load in got.loads] == first


def test_a_large_world_is_covered_and_ordered_per_node() -> None:
    """512 DDP ranks on 64 nodes, each node's memory and a replica on the next node."""
    world, per = 512, 8
    cands: list[SourceCandidate] = []
    for r in range(world):
        node, peer = f"n{r // per}", f"n{(r // per + 1) % (world // per)}"
        cands += [mem(r, 20, node, nbytes=GB), rep(r, 20, peer, nbytes=GB)]
    nodes = {r: f"n{r // per}" for r in range(world)}
    got = choose_source(cands, world, sharded=False, rank_nodes=nodes, max_sources=4)
    assert got.step == 20 and len(got.ranks) == world
    for sources in got.ranks:
        assert [c.location for c in sources.state] == [nodes[sources.rank]] * 4  # in shm there
        assert sources.path == "local_memory"
