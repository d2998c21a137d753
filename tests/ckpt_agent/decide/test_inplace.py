"""The in-place restart's choice: the same save on every rank, or storage for every rank."""

from __future__ import annotations

import itertools

import pytest

from ckpt_agent.decide.inplace import (
    InplaceChoice,
    ShmOffer,
    StepMark,
    all_usable,
    choose_inplace,
)


def offer(
    step: int, token: str | None = None, seq: int = 1, ws: int = 2, epoch: int = 0
) -> ShmOffer:
    return ShmOffer(step, token or f"t{step}", seq, ws, epoch)


def choose(
    offers: list[list[ShmOffer]], storage: int = -1, ws: int = 2, **kw: object
) -> InplaceChoice:
    return choose_inplace(offers, storage_step=storage, world_size=ws, **kw)  # type: ignore[arg-type]


def test_every_rank_holds_the_newest_save_it_is_chosen_with_each_ranks_seq() -> None:
    got = choose([[offer(5, seq=1), offer(10, seq=2)], [offer(5, seq=7), offer(10, seq=8)]], 10)
    assert (got.token, got.step, got.seqs) == ("t10", 10, (2, 8))


def test_a_save_missing_on_one_rank_falls_back_to_an_older_common_one() -> None:
    got = choose([[offer(5), offer(10)], [offer(5)]], storage=5)
    assert (got.token, got.step) == ("t5", 5)


def test_older_than_storage_means_storage() -> None:
    got = choose([[offer(5), offer(10)], [offer(5)]], storage=10)
    assert got.token is None and "newer checkpoint (step 10)" in got.reason


def test_a_rank_without_snapshots_sends_every_rank_to_storage() -> None:
    got = choose([[offer(10)], []], storage=-1)
    assert got.token is None and "ranks [1]" in got.reason


def test_same_step_other_save_is_never_mixed() -> None:
    """Two saves of step 10 (a retry after a deferred or failed attempt): only the token
    held by every rank counts, never rank 0's part of one and rank 1's of the other."""
    got = choose([[offer(10, "a")], [offer(10, "b")]])
    assert got.token is None
    got = choose([[offer(10, "a"), offer(10, "b", seq=2)], [offer(10, "a", seq=3)]])
    assert (got.token, got.seqs) == ("a", (1, 3))


def test_one_token_with_different_steps_or_lineages_is_skipped() -> None:
    assert choose([[offer(10, "x")], [offer(11, "x")]]).token is None
    assert choose([[offer(10, "x")], [offer(10, "x", epoch=1)]]).token is None
    got = choose([[offer(5), offer(10, "x")], [offer(5), offer(11, "x")]])
    assert got.token == "t5"


def test_another_world_size_goes_to_storage() -> None:
    assert choose([[offer(10, ws=4)], [offer(10, ws=4)]]).token is None
    got = choose([[offer(10, ws=1)]], ws=1)
    assert got.token == "t10" and got.seqs == (1,)


def test_not_allowed_or_missing_ranks() -> None:
    got = choose([[offer(10)], [offer(10)]], allowed=False, why_not="CKPT_RESUME_FROM")
    assert got.token is None and got.reason == "CKPT_RESUME_FROM"
    assert choose([[offer(10)]], ws=2).token is None
    assert choose([], ws=0).token is None


@pytest.mark.parametrize("world", [1, 2, 3])
def test_exhaustive_small_worlds_agree_and_never_mix(world: int) -> None:
    """Every combination of which ranks hold which of three saves (steps 1..3, one token
    each) and every storage step: the choice is the newest save every rank holds when it is
    at least as new as storage, else storage; and it never depends on the rank order."""
    saves = [1, 2, 3]
    subsets = [
        [s for s, keep in zip(saves, mask, strict=True) if keep]
        for mask in itertools.product([False, True], repeat=len(saves))
    ]
    for held in itertools.product(subsets, repeat=world):
        for storage in (-1, 1, 2, 3, 4):
            offers = [
                [offer(s, seq=s + 10 * r, ws=world) for s in steps] for r, steps in enumerate(held)
            ]
            got = choose(offers, storage, ws=world)
            common = set.intersection(*(set(h) for h in held))
            newest = max(common, default=None)
            if newest is None or newest < storage:
                assert got.token is None
            else:
                assert (got.token, got.step) == (f"t{newest}", newest)
                assert got.seqs == tuple(newest + 10 * r for r in range(world))
            shuffled = choose([list(reversed(o)) for o in offers], storage, ws=world)
            assert (shuffled.token, shuffled.step) == (got.token, got.step)


def test_offers_round_trip_json() -> None:
    o = offer(7, "tok", seq=3, ws=2, epoch=1)
    assert ShmOffer.from_json(o.to_json()) == o
    with pytest.raises(ValueError):
        ShmOffer.from_json([1, 2])


def test_all_usable() -> None:
    assert all_usable([{"ok": True}, {"ok": True}]) == (True, "")
    ok, why = all_usable([{"ok": True}, {"ok": False, "why": "bytes differ"}])
    assert not ok and why == "rank 1: bytes differ"


# --------------------------------------------------------------------------- JIT saves


def jit(step: int, seq: int = 9, ws: int = 4, epoch: int = 0) -> ShmOffer:
    return ShmOffer(step, f"{step}-jit-{epoch}", seq, ws, epoch, jit=True)


def test_a_jit_save_by_the_survivors_covers_the_dead_rank_through_its_step_mark() -> None:
    older = [offer(10, seq=1, ws=4) for _ in range(4)]
    offers = [[older[0], jit(13)], [older[1]], [older[2], jit(13)], [older[3], jit(13)]]
    marks = [StepMark(13, 0), StepMark(13, 0), StepMark(13, 0), StepMark(13, 0)]
    got = choose(offers, storage=10, ws=4, marks=marks)
    assert (got.token, got.step, got.source, got.from_heartbeat) == ("13-jit-0", 13, 0, (1,))
    assert got.seqs == (9, -1, 9, 9) and "just-in-time" in got.reason


def test_the_replicated_state_comes_from_the_first_survivor_when_rank_0_died() -> None:
    offers = [[], [jit(13)], [jit(13)], [jit(13)]]
    got = choose(offers, ws=4, marks=[StepMark(13, 0)] * 4)
    assert (got.source, got.from_heartbeat) == (1, (0,))


@pytest.mark.parametrize(
    "mark",
    [None, StepMark(12, 0), StepMark(14, 0), StepMark(13, 1)],
    ids=["no mark", "a step behind", "a step ahead", "another lineage"],
)
def test_a_dead_rank_whose_mark_is_not_that_step_sends_the_choice_to_the_common_save(
    mark: StepMark | None,
) -> None:
    older = [offer(10, seq=1, ws=4) for _ in range(4)]
    offers = [[older[0], jit(13)], [older[1]], [older[2], jit(13)], [older[3], jit(13)]]
    marks = [StepMark(13, 0), mark, StepMark(13, 0), StepMark(13, 0)]
    got = choose(offers, storage=10, ws=4, marks=marks)
    assert (got.token, got.step, got.from_heartbeat) == ("t10", 10, ())


def test_a_save_that_is_not_jit_is_never_completed_by_step_marks() -> None:
    offers = [[offer(13, ws=2)], []]
    got = choose(offers, ws=2, marks=[StepMark(13, 0), StepMark(13, 0)])
    assert got.token is None


def test_without_marks_a_jit_save_some_ranks_lack_is_not_usable() -> None:
    offers = [[jit(13, ws=2)], []]
    assert choose(offers, ws=2).token is None
    assert choose(offers, ws=2, marks=[StepMark(13, 0)]).token is None  # wrong length


def test_a_jit_save_older_than_storage_means_storage() -> None:
    offers = [[jit(13, ws=2)], []]
    got = choose(offers, storage=20, ws=2, marks=[StepMark(13, 0)] * 2)
    assert got.token is None and "newer checkpoint (step 20)" in got.reason


def test_survivors_disagreeing_on_the_jit_step_are_never_mixed() -> None:
    a = ShmOffer(13, "13-jit-0", 9, 2, 0, jit=True)
    b = ShmOffer(14, "13-jit-0", 9, 2, 0, jit=True)
    got = choose([[a], [b]], ws=2, marks=[StepMark(13, 0), StepMark(14, 0)])
    assert got.token is None


def test_a_jit_save_held_by_every_rank_is_an_ordinary_choice() -> None:
    got = choose([[jit(13, ws=2)], [jit(13, ws=2)]], ws=2)
    assert (got.token, got.source, got.from_heartbeat, got.seqs) == ("13-jit-0", 0, (), (9, 9))


def test_offers_and_marks_round_trip_through_json_and_old_offers_still_read() -> None:
    o = jit(13)
    assert ShmOffer.from_json(o.to_json()) == o
    assert ShmOffer.from_json([5, "t5", 1, 2, 0]) == offer(5)
    assert StepMark.from_json(StepMark(3, 1).to_json()) == StepMark(3, 1)
    assert StepMark.from_json(None) is None
