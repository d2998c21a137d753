"""The resume-lineage rule: a pin is applied once, then its lineage continues (table tests)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from decide_builders import C, E, P, V, record

from ckpt_agent.decide.lineage import (
    Pin,
    choose,
    current_lineage,
    env_pin,
    pending_to_verify,
    pins_in_force,
    request_pin,
    superseded,
    untried,
)
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Lineage

A = env_pin("f20")  # the operator's CKPT_RESUME_FROM of J-r1
B = env_pin("p69")  # ... of J-r2
R = request_pin("f10", b'{"checkpoint_id": "f10", "requested_at": 1}')  # a manual rewind
R2 = request_pin("f10", b'{"checkpoint_id": "f10", "requested_at": 2}')  # the same, later

ORIGINAL = Lineage()
L_A = Lineage(epoch=1, pins=(A.key,), parent="f20")
L_B = Lineage(epoch=2, pins=(B.key,), parent="p69")
L_R = Lineage(epoch=2, pins=(R.key, A.key), parent="f10")


def rec(name: str, status: CheckpointStatus = V, lineage: Lineage = ORIGINAL) -> CheckpointRecord:
    """A committed record (with a manifest hash) of the given lineage."""
    return replace(record(name, status), lineage=lineage, manifest_hash=f"{name}-hash")


def original(*names: str) -> list[CheckpointRecord]:
    return [rec(n) for n in names]


def lineage_a(*names: str, status: CheckpointStatus = V) -> list[CheckpointRecord]:
    return [rec(n, status, replace(L_A, parent="f20" if n == "p30" else "p30")) for n in names]


RUN_J = original("f10", "f20", "p50", "p70", "f100")  # the first job, before any restart
AFTER_A = [*original("f10", "f20"), *[rec(n, E) for n in ("p50", "p70", "f100")]]


@dataclass(frozen=True)
class Case:
    records: list[CheckpointRecord]
    pins: tuple[Pin, ...]
    apply: str | None
    """The pin key applied (None: ladder)."""
    lineage: Lineage | None
    candidates: set[str] | None = None
    spent: tuple[str, ...] = ()


CASES = {
    # no pin: the ladder, the resumed checkpoint's lineage continues
    "fresh start": Case([], (), None, None),
    "no pin, checkpoints": Case(RUN_J, (), None, None),
    # J-r1's first start: the pin is applied, a new lineage opens
    "pin applied": Case(RUN_J, (A,), A.key, Lineage(1, (A.key,))),
    "pin applied, with a heartbeat": Case([*RUN_J, rec("h101")], (A,), A.key, Lineage(1, (A.key,))),
    # J-r1 made progress, then its container restarted in place: continue, never rewind
    "in-place restart after progress": Case(
        [*AFTER_A, *lineage_a("p30", "p40", "p69"), rec("h70")],
        (A,),
        None,
        Lineage(1, (A.key,)),
        {"f20", "p30", "p40", "p69", "h70"},
        (A.key,),
    ),
    "in-place restart: progress is a lightweight pulse only": Case(
        [*AFTER_A, replace(lineage_a("p25")[0], lightweight=True)],
        (A,),
        None,
        Lineage(1, (A.key,)),
        {"f20", "p25"},
        (A.key,),
    ),
    # crashed before the first commit of the lineage (or it is not validated): apply again
    "pin, crash before the first commit": Case(AFTER_A, (A,), A.key, Lineage(1, (A.key,))),
    "pin, the lineage's only commit is pending": Case(
        [*AFTER_A, *lineage_a("p30", status=P)], (A,), A.key, Lineage(2, (A.key,))
    ),
    "pin, the lineage's commits are all corrupted": Case(
        [*AFTER_A, *lineage_a("p30", "p40", status=C)], (A,), A.key, Lineage(2, (A.key,))
    ),
    # the pin itself is corrupted (or gone): irrelevant once spent
    "corrupted pin, lineage has progress": Case(
        [rec("f10"), rec("f20", C), *lineage_a("p30", "p40")],
        (A,),
        None,
        Lineage(1, (A.key,)),
        {"f20", "p30", "p40"},
        (A.key,),
    ),
    "deleted pin, lineage has progress": Case(
        [rec("f10"), *lineage_a("p30", "p40")],
        (A,),
        None,
        Lineage(1, (A.key,)),
        {"p30", "p40"},
        (A.key,),
    ),
    "corrupted pin, no progress: applied (and fails loudly)": Case(
        [rec("f10"), rec("f20", C)], (A,), A.key, Lineage(1, (A.key,))
    ),
    # a manual rewind while the operator's pin is in force: applied once, honouring both
    "manual rewind under a spent operator pin": Case(
        [*AFTER_A, *lineage_a("p30", "p69")],
        (R, A),
        R.key,
        Lineage(2, (R.key, A.key)),
        None,
        (A.key,),
    ),
    "manual rewind, then progress: both pins spent": Case(
        [
            rec("f10"),
            *[rec(n, E, L_A) for n in ("p30", "p69")],
            rec("p15", V, L_R),
            rec("p25", V, replace(L_R, parent="p15")),
        ],
        (A,),
        None,
        Lineage(2, (R.key, A.key)),
        {"p15", "p25"},
        (A.key,),
    ),
    "manual rewind, request not deleted yet: spent": Case(
        [rec("f10"), rec("p15", V, L_R)],
        (R, A),
        None,
        Lineage(2, (R.key, A.key)),
        {"f10", "p15"},
        (R.key, A.key),
    ),
    "manual rewind, crash before its first commit: applied again": Case(
        [rec("f10"), rec("f20", E), *[rec(n, E, L_A) for n in ("p30", "p69")]],
        (R, A),
        R.key,
        Lineage(2, (R.key, A.key)),
        None,
        (A.key,),
    ),
    "manual rewind consumed, crash before its first commit: the operator's pin stays spent": Case(
        [rec("f10"), rec("f20", E), *[rec(n, E, L_A) for n in ("p30", "p69")]],
        (A,),
        None,
        None,
        None,
        (A.key,),
    ),
    "a second manual rewind to the same checkpoint: a new request, applied": Case(
        [rec("f10"), rec("p15", V, L_R)],
        (R2, A),
        R2.key,
        Lineage(3, (R2.key, A.key)),
        None,
        (A.key,),
    ),
    "request and operator pin both new: the request first": Case(
        RUN_J, (R, A), R.key, Lineage(1, (R.key, A.key))
    ),
    # J-r1 -> J-r2 with different pins
    "J-r2: a new pin after J-r1's lineage": Case(
        [*AFTER_A, *lineage_a("p30", "p69")], (B,), B.key, Lineage(2, (B.key,))
    ),
    "J-r2 restarted in place after progress": Case(
        [*AFTER_A, *lineage_a("p30", "p69"), rec("p80", V, L_B), rec("p90", V, L_B)],
        (B,),
        None,
        Lineage(2, (B.key,)),
        {"p69", "p80", "p90"},
        (B.key,),
    ),
    "J-r3 pinned to J-r1's pin again: applied (J-r2's lineage does not honour it)": Case(
        [*AFTER_A, *lineage_a("p30", "p69"), rec("p80", V, L_B)],
        (A,),
        A.key,
        Lineage(3, (A.key,)),
    ),
    # the new epoch is above every epoch in storage, expired and corrupted ones included
    "epoch above retired lineages": Case(
        [rec("f10"), rec("p30", E, Lineage(5, ("x",)))], (A,), A.key, Lineage(6, (A.key,))
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_choose(case: Case) -> None:
    got = choose(case.records, case.pins)
    assert (got.apply.key if got.apply else None) == case.apply, got.reason
    assert got.lineage == case.lineage, got.reason
    assert got.candidates == (None if case.candidates is None else frozenset(case.candidates))
    assert tuple(p.key for p in got.spent) == case.spent
    assert got.reason


def test_pin_keys() -> None:
    assert env_pin("f20") == A and A.key == "CKPT_RESUME_FROM:f20" and A.source == "resume_from"
    assert R.key.startswith("RECOVER.json:") and R.source == "manual" and R.key != R2.key
    hb = request_pin("h30", b"{}", "p20")
    assert (hb.checkpoint_id, hb.weights_from) == ("h30", "p20")


def test_pins_in_force_request_first() -> None:
    assert pins_in_force(None, None) == [] and pins_in_force(None, "") == []
    assert pins_in_force(None, "f20") == [A]
    req = {"checkpoint_id": "h30", "weights_from": "p20", "requested_at": 1.5}
    got = pins_in_force(req, "f20")
    assert [p.source for p in got] == ["manual", "resume_from"] and got[1] == A
    assert (got[0].checkpoint_id, got[0].weights_from) == ("h30", "p20")
    same = pins_in_force(dict(reversed(list(req.items()))), None)[0]  # key order: same request
    assert same.key == got[0].key
    assert pins_in_force({**req, "requested_at": 2.5}, None)[0].key != got[0].key
    assert (
        pins_in_force({"checkpoint_id": "f10", "weights_from": None}, None)[0].weights_from is None
    )


def test_current_lineage_is_the_newest_valid_weights_checkpoints() -> None:
    assert current_lineage([]) is None
    assert current_lineage([rec("h40"), rec("p30", P, L_A)]) is None
    newest = [rec("f10"), rec("p30", V, L_A), rec("p40", C, L_B), rec("h50", V, L_B)]
    assert current_lineage(newest) == L_A
    assert current_lineage([rec("p30", V, L_B), rec("f30", V, L_A)]) == L_A  # full after pulse


def ids(records: list[CheckpointRecord]) -> list[str]:
    return [r.id for r in records]


def test_pending_to_verify() -> None:
    records = [
        rec("f10"),
        rec("p20", V, L_A),
        rec("p15", P, L_A),  # older than the newest valid: not needed
        rec("p30", P, L_A),
        rec("p40", P, L_A),
        rec("h45", P),
        rec("p50", P),  # another lineage
    ]
    assert ids(pending_to_verify(records, (A,), 4)) == ["p40", "p30"]
    assert ids(pending_to_verify(records, (A,), 1)) == ["p40"]
    assert ids(pending_to_verify(records, (), 4)) == ["p50", "p40", "p30"]
    assert ids(pending_to_verify(records, (B,), 4)) == []


def test_superseded_is_what_lies_past_the_resume_point() -> None:
    records = [
        rec("f10"),
        rec("p20"),
        rec("p30"),
        rec("p31", C),
        rec("p32", E),
        rec("h40"),
        replace(rec("p41"), manifest_hash=""),  # a COMMIT that could not be read
        rec("p50", P),
    ]
    assert [r.id for r in superseded(records, 20)] == ["p30", "p50"]
    assert superseded(records, 50) == []


def test_superseded_spares_what_it_is_told_to() -> None:
    records = [rec("f10"), rec("p20"), rec("p30"), rec("p40", P)]
    assert [r.id for r in superseded(records, 10, spare={"p20", "p40"})] == ["p30"]
    assert [r.id for r in superseded(records, 10, spare={"f10"})] == ["p20", "p30", "p40"]


@pytest.mark.parametrize(
    ("resumed", "tried", "expected"),
    [
        # issue #28: 12 tried and rejected, 5 resumed: 10 was never tried, it stays (and
        # the pending 11, never verified)
        (5, {"p12", "p5"}, {"p10", "p11"}),
        # the ladder tried 10 and 11 too: nothing to spare
        (5, {"p12", "p11", "p10", "p5"}, set()),
        # resumed the newest: nothing is past it
        (12, {"p12"}, set()),
        # a pending checkpoint the start did not verify is not judged either
        (1, {"p5", "p10", "p12"}, {"p11"}),
    ],
)
def test_untried_is_what_a_ladder_resume_must_not_retire(
    resumed: int, tried: set[str], expected: set[str]
) -> None:
    records = [
        rec("p1"),
        rec("p5"),
        rec("p10"),
        rec("p11", P),
        rec("p12"),
        rec("p13", C),  # already judged: corrupted
        rec("p14", E),  # already retired
        replace(rec("p15"), lightweight=True),  # ranked below an exact resume by rule
        rec("h16"),  # heartbeats are never retired
    ]
    assert untried(records, resumed, tried) == expected
    spared = {r.id for r in records if r.id in expected}
    gone = {r.id for r in superseded(records, resumed, spare=spared)}
    assert not gone & expected
    assert gone == {r.id for r in superseded(records, resumed)} - expected
