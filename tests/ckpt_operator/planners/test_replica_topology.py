"""Rack- and zone-aware replica peers (planners.replica_topology): never itself, every rank
holding exactly k replicas, the ring when the labels tell nothing, and peers in other zones
(else racks, else nodes) wherever the balance allows, checked over every small layout."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence

import pytest

from ckpt_operator.planners.replica_peers import ring
from ckpt_operator.planners.replica_topology import (
    ZONE_LABEL,
    Placement,
    Separation,
    choose_peers,
    separation,
    spread_order,
)

Plan = tuple[tuple[int, ...], ...]


def _zoned(zones: Sequence[object], *, rack: bool = False) -> list[Placement]:
    """One rank per node; ``zones[r]``: rank r's zone (or its rack, ``rack=True``)."""
    if rack:
        return [Placement(f"n{r}", None, f"r{z}") for r, z in enumerate(zones)]
    return [Placement(f"n{r}", f"z{z}") for r, z in enumerate(zones)]


def _check_shape(plan: Plan, n: int, k: int) -> None:
    """Exactly min(k, n-1) distinct other ranks each, and every rank holds as many."""
    want = min(k, n - 1)
    assert len(plan) == n
    held = Counter(h for peers in plan for h in peers)
    for r, peers in enumerate(plan):
        assert len(peers) == want and len(set(peers)) == want and r not in peers, (r, plan)
        assert held[r] == want, (r, plan)


def _exchange_would_help(place: Sequence[Placement], plan: Plan) -> bool:
    """Some two pushes r→h, q→s could swap targets (staying valid) and raise the lower of
    their separations, or keep it and raise the higher."""

    def sep(a: int, b: int) -> int:
        return int(separation(place[a], place[b]))

    edges = [(r, h) for r, peers in enumerate(plan) for h in peers]
    for (r, h), (q, s) in itertools.combinations(edges, 2):
        if r == q or s == r or h == q or s in plan[r] or h in plan[q]:
            continue
        if sorted((sep(r, s), sep(q, h))) > sorted((sep(r, h), sep(q, s))):
            return True
    return False


# --------------------------------------------------------------------------- the ring


@pytest.mark.parametrize("n", range(1, 13))
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_without_labels_it_is_todays_ring(n: int, k: int) -> None:
    unlabelled = [Placement(f"node-{r}") for r in range(n)]
    one_zone = [Placement(f"node-{r}", "a", "rack-1") for r in range(n)]
    expected = tuple(ring(r, n, k) for r in range(n))
    assert choose_peers(unlabelled, k) == expected
    assert choose_peers(one_zone, k) == expected


def test_every_rank_on_one_node_is_the_ring_too() -> None:
    assert choose_peers([Placement("n")] * 5, 2) == tuple(ring(r, 5, 2) for r in range(5))


def test_unknown_nodes_are_told_apart_but_never_by_zone() -> None:
    place = [Placement(None), Placement(None, "a"), Placement(None, "b")]
    assert separation(place[0], place[0]) is Separation.NODE
    assert separation(place[0], place[1]) is Separation.NODE
    assert separation(place[1], place[2]) is Separation.ZONE
    assert choose_peers(place[:1] + place[:1], 1) == ((1,), (0,))


# --------------------------------------------------------------------------- separation


def test_separation_levels() -> None:
    a = Placement("n1", "z1", "r1")
    assert separation(a, Placement("n1", "z1", "r1")) is Separation.SAME_NODE
    assert separation(a, Placement("n2", "z1", "r1")) is Separation.NODE
    assert separation(a, Placement("n2", "z1", "r2")) is Separation.RACK
    assert separation(a, Placement("n2", "z2", "r1")) is Separation.ZONE
    assert separation(a, Placement("n2", None, "r2")) is Separation.RACK  # zone unknown
    assert separation(a, Placement("n2", None, None)) is Separation.NODE


def test_a_placement_from_node_labels() -> None:
    labels = {ZONE_LABEL: "eu-1a", "example.com/rack": "r7", "empty": ""}
    assert Placement.of("n1", labels, "example.com/rack") == Placement("n1", "eu-1a", "r7")
    assert Placement.of("n1", labels, None) == Placement("n1", "eu-1a", None)
    assert Placement.of("n1", labels, "empty") == Placement("n1", "eu-1a", None)
    assert Placement.of("", {}, "") == Placement(None, None, None)


def test_the_spread_order_interleaves_zones_evenly() -> None:
    # six ranks in zone a, two in b: b's ranks fall at a quarter and three quarters
    place = _zoned("aaaaaabb")
    order = spread_order(place)
    assert order == [0, 1, 6, 2, 3, 4, 7, 5]
    assert spread_order(_zoned("abab")) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- zones


def test_two_even_zones_every_peer_in_the_other() -> None:
    place = _zoned("aaaabbbb")
    for k in (1, 2, 3):
        plan = choose_peers(place, k)
        _check_shape(plan, 8, k)
        assert all(place[r].zone != place[h].zone for r in range(8) for h in plan[r]), (k, plan)


def test_a_small_zone_takes_no_more_than_its_share() -> None:
    """Six ranks in zone a, two in b, one peer each: b holds exactly two replicas (both
    from a), so four of a's ranks keep theirs in a; the two of b push to a."""
    place = _zoned("aaaaaabb")
    plan = choose_peers(place, 1)
    _check_shape(plan, 8, 1)
    cross = [(r, h) for r in range(8) for h in plan[r] if place[r].zone != place[h].zone]
    assert len(cross) == 4  # the most there can be: b's two ranks hold one replica each
    assert all(place[h].zone == "za" for r, h in cross if place[r].zone == "zb")


def test_three_zones_of_four_nodes() -> None:
    place = _zoned("abcabcabcabc")
    for k in (1, 2, 3):
        plan = choose_peers(place, k)
        _check_shape(plan, 12, k)
        assert all(
            separation(place[r], place[h]) is Separation.ZONE for r in range(12) for h in plan[r]
        )
        held_from = Counter(place[r].zone for r in range(12) for _ in plan[r])
        assert set(held_from.values()) == {4 * k}


@pytest.mark.parametrize("rack", [False, True], ids=["zones", "racks"])
def test_every_small_layout(rack: bool) -> None:
    """Every layout of 2..8 ranks (one per node) in up to three zones (or racks, no zone
    label), k = 1..3: the shape always holds, no exchange of two pushes could do better,
    and with k <= 2 and no group holding more than half the ranks every peer is in another
    group."""
    level = Separation.RACK if rack else Separation.ZONE
    for n in range(2, 9):
        for groups in itertools.product(range(3), repeat=n):
            if groups[0] != 0:  # the same layouts under other names
                continue
            place = _zoned(groups, rack=rack)
            largest = max(Counter(groups).values())
            for k in (1, 2, 3):
                plan = choose_peers(place, k)
                _check_shape(plan, n, k)
                if n <= 6:
                    assert not _exchange_would_help(place, plan), (groups, k, plan)
                if k <= 2 and 2 * largest <= n and k <= n - largest:
                    seps = {separation(place[r], place[h]) for r in range(n) for h in plan[r]}
                    assert seps == {level}, (groups, k, plan)


# --------------------------------------------------------------------------- racks, nodes


def test_within_a_zone_racks_are_used() -> None:
    """Two zones of unequal size with racks: the peers that cannot leave the zone leave
    the rack."""
    place = [
        Placement("n0", "a", "r1"),
        Placement("n1", "a", "r1"),
        Placement("n2", "a", "r2"),
        Placement("n3", "a", "r2"),
        Placement("n4", "a", "r3"),
        Placement("n5", "b", "r4"),
    ]
    plan = choose_peers(place, 1)
    _check_shape(plan, 6, 1)
    seps = Counter(separation(place[r], place[h]) for r in range(6) for h in plan[r])
    assert seps == {Separation.ZONE: 2, Separation.RACK: 4}, plan


def test_two_ranks_on_a_node_hold_each_others_replicas_only_when_nothing_else_exists() -> None:
    place = [Placement("x"), Placement("x"), Placement("y"), Placement("y")]
    plan = choose_peers(place, 1)
    _check_shape(plan, 4, 1)
    assert all(place[r].node != place[h].node for r in range(4) for h in plan[r]), plan
    plan = choose_peers(place, 3)  # three peers: one of them is on the same node
    _check_shape(plan, 4, 3)


# --------------------------------------------------------------------------- large, stable


def test_large_worlds_keep_the_shape_and_the_same_answer() -> None:
    rng = random.Random(7)
    place = [
        Placement(f"n{r}", f"z{rng.randrange(3)}", f"rack{rng.randrange(16)}") for r in range(300)
    ]
    plan = choose_peers(place, 2)
    _check_shape(plan, 300, 2)
    assert choose_peers(list(place), 2) == plan
    assert all(
        separation(place[r], place[h]) is Separation.ZONE for r in range(300) for h in plan[r]
    )


def test_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError):
        choose_peers([Placement("a")], -1)
    assert choose_peers([], 2) == ()
    assert choose_peers([Placement("a")], 2) == ((),)
