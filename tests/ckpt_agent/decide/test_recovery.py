"""Recovery ladder: a plan for every failure combination, and walking it."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pytest
from decide_builders import C, E, P, V, record

from ckpt_agent import tuning
from ckpt_agent.decide.recovery import PlanStep, RecoveryPlan, is_poisoned, plan_recovery, walk
from ckpt_agent.errors import ForceRequiredError, RetryableStorageError
from ckpt_agent.policy.models import RecoverySpec, Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus


def R(
    name: str,
    status: CheckpointStatus = V,
    *,
    prev: str | None = None,
    lightweight: bool = False,
    approximate: bool = False,
    score: float = 0.0,
) -> CheckpointRecord:
    """``R("p300", prev="p200")``: pulse of step 300 whose prev-hash points at p200."""
    return replace(
        record(name, status, score=score),
        manifest_hash=f"sha-{name}",
        prev_hash=None if prev is None else f"sha-{prev}",
        lightweight=lightweight,
        approximate=approximate,
    )


def chain(*names: str, status: dict[str, CheckpointStatus] | None = None) -> list[CheckpointRecord]:
    """Weights checkpoints linked by prev-hash in the given (oldest first) order."""
    status = status or {}
    return [R(n, status.get(n, V), prev=names[i - 1] if i else None) for i, n in enumerate(names)]


Row = tuple[str, str, str | None]  # (action, checkpoint id, weights_from)


@dataclass
class Case:
    name: str
    records: list[CheckpointRecord]
    steps: Sequence[Row]
    spec: RecoverySpec = field(default_factory=RecoverySpec)
    poisoned: tuple[str, ...] = ()
    manual_step: int | None = None
    force: bool = False
    needs_manual: bool = False
    blocked: tuple[str, ...] = ()
    """Ids of steps that need force."""
    skipped: dict[str, str] = field(default_factory=dict)
    """id → substring of the skip reason."""
    reasons: dict[int, str] = field(default_factory=dict)
    """step index → substring of its reason."""
    max_candidates: int | None = None


RB = "rebuild_from_heartbeat"
CASES = [
    Case("nothing at all", [], []),
    Case(
        "healthy: newest, its chain, then heartbeat rebuilds",
        [*chain("p100", "p200", "f300"), R("h301")],
        [
            ("resume", "f300", None),
            ("resume", "p200", None),
            ("resume", "p100", None),
            (RB, "h301", "f300"),
            (RB, "h301", "p200"),
            (RB, "h301", "p100"),
        ],
        reasons={0: "newest valid full", 1: "chain link 1/5 back from f300", 3: "RNG exact"},
    ),
    Case(
        "newest corrupted",
        [*chain("p100", "p200", "p300", status={"p300": C}), R("h301")],
        [
            ("resume", "p200", None),
            ("resume", "p100", None),
            (RB, "h301", "p200"),
            (RB, "h301", "p100"),
        ],
        skipped={"p300": "corrupted"},
    ),
    Case(
        "chain walk stops after max_chain_links; the ones newer than the newest full first",
        chain("f10", *(f"p{i}00" for i in range(1, 9))),
        [("resume", f"p{i}00", None) for i in range(8, 0, -1)] + [("resume", "f10", None)],
        reasons={
            5: "chain link 5/5",
            6: "beyond the chain walk: newer than the newest full checkpoint (step 10)",
            8: "newest valid full checkpoint (step 10), beyond the chain walk",
        },
    ),
    Case(
        "issue #28: the newest's chain points further back: the next newest first",
        [R("p5"), R("p10", prev="p5"), R("p12", prev="p5")],
        [("resume", "p12", None), ("resume", "p10", None), ("resume", "p5", None)],
        reasons={1: "not on the chain of p12", 2: "chain link 1/5 back from p12"},
    ),
    Case(
        "the newest's chain skips several: all of them, newest first, before its link",
        [R("p5"), *chain("p6", "p7", "p8"), R("p9", prev="p5"), R("h9")],
        [
            ("resume", "p9", None),
            ("resume", "p8", None),
            ("resume", "p7", None),
            ("resume", "p6", None),
            ("resume", "p5", None),
            (RB, "h9", "p9"),
            (RB, "h9", "p8"),
            (RB, "h9", "p7"),
            (RB, "h9", "p6"),
            (RB, "h9", "p5"),
        ],
        reasons={3: "not on the chain of p9", 4: "chain link 1/5"},
    ),
    Case(
        "an off-chain full newer than the chain's end keeps its place",
        [R("p50"), R("f100"), R("p200", prev="p50")],
        [("resume", "p200", None), ("resume", "f100", None), ("resume", "p50", None)],
        reasons={1: "newest valid full checkpoint (step 100), not on the chain of p200"},
    ),
    Case(
        "a chain that ends at once: everything newer than the newest full, then the full",
        [R("f50"), R("p100"), R("p200"), R("p300", prev="p250")],
        [
            ("resume", "p300", None),
            ("resume", "p200", None),
            ("resume", "p100", None),
            ("resume", "f50", None),
        ],
        skipped={"<hash sha-p250>": "not in the catalog"},
        reasons={1: "beyond the chain walk", 3: "beyond the chain walk"},
    ),
    Case(
        "a forged chain that loops ends",
        [R("p200", prev="p300"), R("p300", prev="p200")],
        [("resume", "p300", None), ("resume", "p200", None)],
        reasons={1: "chain link 1/5"},
    ),
    Case(
        "a forged chain that points forward: still newest first",
        [R("p100", prev="p200"), R("p200"), R("p300", prev="p100")],
        [("resume", "p300", None), ("resume", "p200", None), ("resume", "p100", None)],
        reasons={1: "chain link 2/5", 2: "chain link 1/5"},
    ),
    Case(
        "unusable checkpoints the chain skips are not offered",
        [R("p5"), R("p10", C), R("p11", P), R("p12", prev="p5")],
        [("resume", "p12", None), ("resume", "p5", None)],
        skipped={"p10": "corrupted", "p11": "pending"},
    ),
    Case(
        "the walk's bound leaves the oldest steps out and says so",
        [*chain("p100", "p200", "p300", "p400"), R("h401")],
        [("resume", "p400", None), ("resume", "p300", None), ("resume", "p200", None)],
        spec=RecoverySpec(max_chain_links=5),
        max_candidates=3,
    ),
    Case(
        "chain limit from the policy",
        chain("p100", "p200", "p300"),
        [("resume", "p300", None), ("resume", "p200", None)],
        spec=RecoverySpec(max_chain_links=1),
    ),
    Case(
        "chain limit 0: only the newest",
        chain("p100", "p200", "p300"),
        [("resume", "p300", None)],
        spec=RecoverySpec(max_chain_links=0),
    ),
    Case(
        "chain passes over unusable links and counts them",
        chain("p100", "p200", "p300", "p400", status={"p300": C, "p200": E}),
        [("resume", "p400", None), ("resume", "p100", None)],
        skipped={"p300": "chain link 1", "p200": "expired"},
        reasons={1: "chain link 3/5"},
    ),
    Case(
        "chain broken by a missing manifest",
        [R("p100"), R("p300", prev="p200")],
        [("resume", "p300", None)],
        skipped={"<hash sha-p200>": "not in the catalog"},
    ),
    Case(
        "poisoned newest is skipped",
        [*chain("p100", "p200", "p300"), R("h300")],
        [
            ("resume", "p200", None),
            ("resume", "p100", None),
            (RB, "h300", "p200"),
            (RB, "h300", "p100"),
        ],
        poisoned=("p300",),
        skipped={"p300": "poisoned"},
    ),
    Case(
        "poisoned heartbeat: the next newest heartbeat rebuilds",
        [R("p100"), R("h150"), R("h160")],
        [("resume", "p100", None), (RB, "h150", "p100")],
        poisoned=("h160",),
    ),
    Case(
        "pending and expired are never offered",
        [R("p100"), R("p200", E), R("p300", P), R("h301", P)],
        [("resume", "p100", None)],
        skipped={"p200": "expired", "p300": "pending", "h301": "pending"},
    ),
    Case(
        "only a full beyond a dead chain",
        [R("f50"), *chain("p100", "p200", status={"p100": C})],
        [("resume", "p200", None), ("resume", "f50", None)],
    ),
    Case(
        "only heartbeats: rebuild without stored weights needs force",
        [R("h1"), R("h2")],
        [(RB, "h2", None)],
        needs_manual=True,
        blocked=("h2",),
        reasons={0: "in-memory snapshot"},
    ),
    Case(
        "only heartbeats, forced",
        [R("h1"), R("h2")],
        [(RB, "h2", None)],
        force=True,
    ),
    Case(
        "heartbeat rebuild disabled",
        [R("h1"), R("h2")],
        [],
        spec=RecoverySpec(allow_heartbeat_rebuild=False),
        needs_manual=True,
        skipped={"h2": "disabled"},
    ),
    Case(
        "everything corrupted or poisoned",
        [R("p100", C), R("f200", C), R("h201")],
        [],
        poisoned=("h201",),
        needs_manual=True,
    ),
    Case(
        "lightweight pulses are weight sources, not resume points",
        [R("p100"), R("p200", lightweight=True), R("h201")],
        [("resume", "p100", None), (RB, "h201", "p200"), (RB, "h201", "p100")],
        reasons={1: "lightweight"},
    ),
    Case(
        "only a lightweight pulse and a heartbeat",
        [R("p200", lightweight=True), R("h250")],
        [(RB, "h250", "p200")],
    ),
    Case(
        "heartbeat older than every weights checkpoint: nothing to rebuild with",
        [R("h50"), R("p100")],
        [("resume", "p100", None), (RB, "h50", None)],
        blocked=("h50",),
    ),
    Case(
        "approximate checkpoints are offered and say so",
        [R("p100", approximate=True)],
        [("resume", "p100", None)],
        reasons={0: "approximate"},
    ),
    Case(
        "same step in two tiers: the full is the head, the pulse next, then the chain",
        [R("p300", prev="p200"), R("f300", prev="p200"), R("p200")],
        [("resume", "f300", None), ("resume", "p300", None), ("resume", "p200", None)],
        reasons={1: "not on the chain of f300", 2: "chain link 1/5"},
    ),
    # rung 4: manual
    Case(
        "manual without force: a blocked step that says so",
        [R("p100", score=0.1), R("p200")],
        [("manual", "p100", None)],
        manual_step=100,
        needs_manual=True,
        blocked=("p100",),
        reasons={0: "needs force"},
    ),
    Case(
        "manual with force, even low-score and poisoned",
        [R("p100", score=0.1), R("p200")],
        [("manual", "p100", None)],
        manual_step=100,
        force=True,
        poisoned=("p100",),
        reasons={0: "overriding: poisoned"},
    ),
    Case(
        "manual with force: full, then pulse, then heartbeat rebuild",
        [R("p100"), R("h300"), R("p300"), R("f300"), R("p400")],
        [("manual", "f300", None), ("manual", "p300", None), ("manual", "h300", "f300")],
        manual_step=300,
        force=True,
    ),
    Case(
        "manual with force on a pending checkpoint",
        [R("p300", P)],
        [("manual", "p300", None)],
        manual_step=300,
        force=True,
        reasons={0: "overriding: pending"},
    ),
    Case(
        "manual step that does not exist",
        [R("p100")],
        [],
        manual_step=300,
        force=True,
        needs_manual=True,
    ),
    Case(
        "manual step that is corrupted, even forced",
        [R("p300", C)],
        [],
        manual_step=300,
        force=True,
        needs_manual=True,
        skipped={"p300": "corrupted"},
    ),
]


def rows(plan: RecoveryPlan) -> list[Row]:
    return [(s.action, s.checkpoint_id, s.weights_from) for s in plan.steps]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ladder_table(case: Case) -> None:
    plan = plan_recovery(
        case.records,
        case.spec,
        poisoned=case.poisoned,
        manual_step=case.manual_step,
        force=case.force,
        max_candidates=case.max_candidates,
    )
    assert rows(plan) == case.steps
    assert plan.needs_manual is case.needs_manual, plan.reason
    assert tuple(s.checkpoint_id for s in plan.steps if s.requires_force) == case.blocked
    assert plan.reason
    for s in plan.steps:
        assert s.reason, s
        assert s.rung in (1, 2, 3, 4)
        assert (s.rung == 4) is (s.action == "manual")
    for cid, fragment in case.skipped.items():
        assert fragment in plan.skipped[cid], (cid, plan.skipped)
    for i, fragment in case.reasons.items():
        assert fragment in plan.steps[i].reason, (i, plan.steps[i].reason)
    unusable = {r.id for r in case.records if r.status != V or r.id in case.poisoned} - set(
        case.skipped
    )
    if case.manual_step is None:
        assert not unusable & {s.checkpoint_id for s in plan.steps}
        assert not unusable & {s.weights_from for s in plan.steps}


def test_first_and_require_first() -> None:
    plan = plan_recovery([R("h1")])
    assert plan.first() is None
    with pytest.raises(ForceRequiredError, match="needs force"):
        plan.require_first()
    with pytest.raises(LookupError, match="fresh start"):
        plan_recovery([]).require_first()
    plan = plan_recovery([R("p1")])
    assert plan.require_first() == plan.first() == plan.steps[0]
    assert plan_recovery([]).empty


def verifier(bad: set[str], calls: list[str] | None = None) -> Callable[[str], bool]:
    def verify(cid: str) -> bool:
        if calls is not None:
            calls.append(cid)
        if cid == "boom":
            raise OSError("disk on fire")
        return cid not in bad

    return verify


@pytest.mark.parametrize(
    ("bad", "accepted", "rejected"),
    [
        (set(), ("resume", "f300", None), []),
        ({"f300"}, ("resume", "p200", None), ["f300"]),
        ({"f300", "p200"}, ("resume", "p100", None), ["f300", "p200"]),
        # weights sources that fail are skipped inside the rebuild rung
        ({"f300", "p200", "p100"}, None, ["f300", "p200", "p100", "h301", "h301", "h301"]),
        ({"f300", "p200", "p100"} - {"p100"}, ("resume", "p100", None), ["f300", "p200"]),
    ],
)
def test_walk_table(bad: set[str], accepted: Row | None, rejected: list[str]) -> None:
    plan = plan_recovery([*chain("p100", "p200", "f300"), R("h301")])
    calls: list[str] = []
    step, rej = walk(plan, verifier(bad, calls))
    got = None if step is None else (step.action, step.checkpoint_id, step.weights_from)
    assert got == accepted
    assert [s.checkpoint_id for s, _ in rej] == rejected
    assert all("failed verification" in why for _, why in rej)
    assert len(calls) == len(set(calls)), "verify is called once per id"


def test_walk_rebuild_falls_to_an_older_weights_source() -> None:
    plan = plan_recovery([*chain("p100", "p200", "p300"), R("h301")])
    step, rej = walk(plan, verifier({"p300", "p200"}))
    assert step is not None and (step.checkpoint_id, step.weights_from) == ("p100", None)
    plan = plan_recovery([R("p100"), R("p200", lightweight=True), R("h201")])
    step, rej = walk(plan, verifier({"p100"}))
    assert step is not None and (step.action, step.weights_from) == (
        "rebuild_from_heartbeat",
        "p200",
    )
    assert rej[0][1] == "p100 failed verification"


def test_walk_never_tries_blocked_steps_and_reports_exceptions() -> None:
    calls: list[str] = []
    plan = plan_recovery([R("h1")])
    step, rej = walk(plan, verifier(set(), calls))
    assert step is None and rej[0][1] == "needs force" and calls == []
    plan = RecoveryPlan(
        steps=(
            PlanStep("resume", "boom", None, "newest"),
            PlanStep("resume", "p1", None, "chain"),
        )
    )
    step, rej = walk(plan, verifier(set()))
    assert step is not None and step.checkpoint_id == "p1"
    assert "raised OSError: disk on fire" in rej[0][1]


def test_walk_lets_a_storage_outage_through_instead_of_skipping_the_checkpoint() -> None:
    """A transient storage error says nothing about the checkpoint: walking past it to an
    older one would rewind the job (and poison a good checkpoint)."""
    plan = plan_recovery([*chain("p100", "p200")])

    def flaky(cid: str) -> bool:
        raise RetryableStorageError("injected: connection reset")

    with pytest.raises(RetryableStorageError):
        walk(plan, flaky)


@pytest.mark.parametrize(
    ("resumed", "reached", "poisoned"),
    [(100, None, True), (100, 100, True), (100, 99, True), (100, 101, False)],
)
def test_is_poisoned(resumed: int, reached: int | None, poisoned: bool) -> None:
    assert is_poisoned(resumed, reached) is poisoned


def test_plan_steps_carry_step_and_tier() -> None:
    plan = plan_recovery([R("p100"), R("h150")])
    assert [(s.step, s.tier, s.rung) for s in plan.steps] == [
        (100, Tier.PULSE, 1),
        (150, Tier.HEARTBEAT, 3),
    ]


def _random_run(rng: random.Random) -> list[CheckpointRecord]:
    """Up to 7 checkpoints of random tiers, statuses and chains (forged ones included:
    pointing anywhere, or at a hash nobody has), and maybe a heartbeat newer than all."""
    n = rng.randint(1, 7)
    names = [f"{rng.choice('pf')}{10 * (i + 1)}" for i in range(n)]
    out = []
    for name in names:
        prev = rng.choice([None, "nowhere", *names])
        out.append(
            R(
                name,
                rng.choice([V, V, V, C, P, E]),
                prev=None if prev == name else prev,
                lightweight=rng.random() < 0.15,
            )
        )
    if rng.random() < 0.5:
        out.append(R(f"h{10 * n + 5}"))
    return out


@pytest.mark.parametrize("seed", range(400))
def test_a_walk_never_goes_back_past_a_usable_checkpoint_it_did_not_try(seed: int) -> None:
    """Issue #28, for any run and any verdicts: the checkpoint a walk accepts has every
    usable complete checkpoint newer than it verified first (so a resume never retires one
    it did not try), and the walk verifies at most the plan's bound."""
    rng = random.Random(seed)
    records = _random_run(rng)
    bound = rng.choice([None, 1, 2, 3])
    plan = plan_recovery(
        records, RecoverySpec(max_chain_links=rng.randint(0, 3)), max_candidates=bound
    )
    ids = [r.id for r in records]
    bad = {i for i in ids if rng.random() < 0.5}
    calls: list[str] = []
    step, _ = walk(plan, verifier(bad, calls))
    assert len(set(calls)) <= plan.limit == (bound or tuning.MAX_RESUME_CANDIDATES)
    usable = [r for r in records if r.status == V and r.has_weights and not r.lightweight]
    if step is not None:
        newer = {r.id for r in usable if (r.step, r.tier == Tier.FULL) > (step.step, True)}
        assert newer <= set(calls), (plan.steps, calls)


def test_the_bound_counts_checkpoints_not_steps() -> None:
    """Rebuild steps that reuse checkpoints already counted cost nothing; the first step
    that would verify one more than the bound ends the plan, and the summary says so."""
    records = [*chain("p100", "p200"), R("h201")]
    plan = plan_recovery(records, max_candidates=3)
    assert rows(plan) == [
        ("resume", "p200", None),
        ("resume", "p100", None),
        (RB, "h201", "p200"),
        (RB, "h201", "p100"),
    ]
    assert not plan.cut and plan.limit == 3
    plan = plan_recovery(records, max_candidates=2)
    assert rows(plan) == [("resume", "p200", None), ("resume", "p100", None)]
    assert [s.checkpoint_id for s in plan.cut] == ["h201", "h201"]
    assert "2 older step(s) left out" in plan.reason
    assert "MAX_RESUME_CANDIDATES" in plan.reason
    # a blocked step verifies nothing: never cut
    plan = plan_recovery([R("h1")], max_candidates=1)
    assert [s.requires_force for s in plan.steps] == [True] and not plan.cut


def test_the_default_bound_is_the_tuning_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    records = chain(*(f"p{i}" for i in range(1, 10)))
    monkeypatch.setattr(tuning, "MAX_RESUME_CANDIDATES", 4)
    plan = plan_recovery(records)
    assert [s.checkpoint_id for s in plan.steps] == ["p9", "p8", "p7", "p6"]
    assert plan.limit == 4 and [s.checkpoint_id for s in plan.cut] == ["p5", "p4"]
