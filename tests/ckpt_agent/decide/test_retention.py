"""Retention: tables of checkpoints in → checkpoints kept/deleted (with reasons)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest
from decide_builders import C, E, P, V, record

from ckpt_agent.decide.retention import GB, classify, effective_class, plan_retention
from ckpt_agent.policy.models import RetentionSpec, Tier
from ckpt_agent.records import AnomalyEvent, CheckpointRecord, CheckpointStatus, RetentionClass


def R(
    name: str,
    score: float = 0.0,
    status: CheckpointStatus = V,
    *,
    size: int = 1,
    created: float | None = None,
    deps: tuple[str, ...] = (),
    anomaly: str | None = None,
    cls: RetentionClass | None = None,
) -> CheckpointRecord:
    """``R("p300")``: the pulse of step 300 (h = heartbeat, p = pulse, f = full)."""
    base = record(name, status, score=score)
    return replace(
        base,
        retention_class=cls,
        size_bytes=size,
        created_at=float(base.step) if created is None else created,
        depends_on=deps,
        anomaly=anomaly,
    )


@dataclass
class Case:
    name: str
    records: list[CheckpointRecord]
    keep: set[str]
    spec: RetentionSpec = field(default_factory=RetentionSpec)
    anomalies: list[AnomalyEvent] = field(default_factory=list)
    now: float | None = None
    reasons: dict[str, str] = field(default_factory=dict)
    """id → substring expected in its keep/delete reason."""


HOUR = 3600.0
IMP, CRIT = 0.6, 0.9

CASES = [
    Case("nothing", [], set()),
    Case(
        "routine pulses: newest only",
        [R("p100"), R("p200"), R("p300")],
        {"p300"},
        reasons={"p300": "newest valid pulse", "p100": "beyond the newest 1"},
    ),
    Case("heartbeat ring", [R(f"h{i}") for i in range(1, 11)], {"h10"}),
    Case(
        "per tier: a routine heartbeat never evicts the routine pulse or full",
        [R("f100"), R("p150"), R("p200"), R("h201"), R("h202")],
        {"f100", "p200", "h202"},
    ),
    Case(
        "important: last 3 per tier",
        [R(f"p{i}00", IMP) for i in range(1, 7)],
        {"p400", "p500", "p600"},
        reasons={"p500": "important pulse #2 of 3", "p100": "important pulse beyond the newest 3"},
    ),
    Case(
        "important and routine counted separately",
        [R("p100", IMP), R("p200", IMP), R("p300", IMP), R("p400", IMP), R("p500"), R("p600")],
        {"p200", "p300", "p400", "p600"},
    ),
    Case(
        "critical kept forever",
        [R("p100", CRIT), R("p200"), R("p300", 0.8), R("p400")],
        {"p100", "p300", "p400"},
        reasons={"p100": "critical", "p300": "critical"},
    ),
    Case(
        "thresholds are inclusive",
        [R("p100", 0.5), R("p200", 0.49), R("p300", 0.8), R("p400", 0.79), R("p500")],
        {"p100", "p300", "p400", "p500"},
    ),
    Case(
        "Orbax #526: best ones never evict the newest, even over budget",
        [R("p100", CRIT, size=GB), R("p200", CRIT, size=GB), R("p300", 0.0, size=GB)],
        {"p100", "p200", "p300"},
        spec=RetentionSpec(max_total_gb=1.0),
        reasons={"p300": "newest valid pulse"},
    ),
    Case(
        "Orbax #526: low-score newest survives important ones and the size budget",
        [R("p100", IMP, size=GB), R("p200", IMP, size=GB), R("p300", 0.1, size=GB)],
        {"p300"},
        spec=RetentionSpec(max_total_gb=1.0),
        reasons={"p100": "budget"},
    ),
    Case(
        "retention_class set at save time wins over the score",
        [
            R("p100", 0.0, cls=RetentionClass.CRITICAL),
            R("p200", CRIT, cls=RetentionClass.ROUTINE),
            R("p300"),
        ],
        {"p100", "p300"},
    ),
    Case(
        "dependencies of kept checkpoints are kept (transitively)",
        [R("f100"), R("p200", deps=("f100",)), R("p300", deps=("p200",)), R("f400")],
        {"f400", "p300", "p200", "f100"},
        reasons={"p200": "dependency of p300", "f100": "dependency of p200"},
    ),
    Case(
        "dependencies of deleted checkpoints are not",
        [R("f100"), R("p200", deps=("f100",)), R("p300"), R("f400")],
        {"f400", "p300"},
    ),
    Case(
        "newest corrupted: the newest valid is protected, the corrupted one goes",
        [R("p300"), R("p400", status=C)],
        {"p300"},
        reasons={"p400": "corrupted", "p300": "newest valid pulse"},
    ),
    Case(
        "a corrupted dependency of a kept checkpoint is not deleted under it",
        [R("f100", status=C), R("p200", deps=("f100",))],
        {"p200", "f100"},
    ),
    Case(
        "pending is never touched",
        [R("p100"), R("p200"), R("p300", status=P)],
        {"p200", "p300"},
        reasons={"p300": "pending"},
    ),
    Case(
        "expired ones are listed for deletion again",
        [R("p100", status=E), R("p200")],
        {"p200"},
        reasons={"p100": "expired"},
    ),
    Case(
        "only corrupted: nothing protected",
        [R("p100", status=C), R("p200", status=C)],
        set(),
    ),
    Case(
        "last known good before an unresolved anomaly is pinned",
        [R(f"p{i}00") for i in range(1, 6)],
        {"p300", "p500"},
        anomalies=[AnomalyEvent(step=350, kind="loss_spike")],
        reasons={"p300": "last known good before loss_spike at step 350"},
    ),
    Case(
        "pin is strictly before the anomaly step",
        [R(f"p{i}00") for i in range(1, 6)],
        {"p200", "p500"},
        anomalies=[AnomalyEvent(step=300, kind="nan")],
    ),
    Case(
        "pin skips checkpoints flagged with an anomaly and heartbeats",
        [R("p100"), R("p200", anomaly="grad_anomaly"), R("h250"), R("p300"), R("h301")],
        {"p100", "p300", "h301"},
        anomalies=[AnomalyEvent(step=260, kind="grad_anomaly")],
    ),
    Case(
        "moved past the anomaly: pin released",
        [R(f"p{i}00") for i in range(1, 6)],
        {"p500"},
        anomalies=[AnomalyEvent(step=350, kind="nan", resolved_step=450)],
    ),
    Case(
        "resolved but no checkpoint past the resolution yet: still pinned",
        [R(f"p{i}00") for i in range(1, 6)],
        {"p300", "p500"},
        anomalies=[AnomalyEvent(step=350, kind="nan", resolved_step=600)],
    ),
    Case(
        "pin survives the size budget",
        [R(f"p{i}00", IMP, size=GB) for i in range(1, 6)],
        {"p200", "p500"},
        spec=RetentionSpec(max_total_gb=1.5),
        anomalies=[AnomalyEvent(step=250, kind="nan")],
    ),
    Case(
        "age budget drops old important ones, never critical or newest",
        [
            R("p100", CRIT, created=0.0),
            R("p200", IMP, created=0.0),
            R("p300", IMP, created=10 * HOUR),
            R("p400", IMP, created=0.0),
            R("f50", 0.0, created=0.0),
        ],
        {"p100", "p300", "p400", "f50"},
        spec=RetentionSpec(max_age_hours=24.0),
        now=30 * HOUR,
        reasons={"p200": "older than 24 h"},
    ),
    Case(
        "age budget: now defaults to the newest created_at",
        [
            R("p100", IMP, created=0.0),
            R("p200", IMP, created=2 * HOUR),
            R("p300", created=3 * HOUR),
        ],
        {"p200", "p300"},
        spec=RetentionSpec(max_age_hours=2.0),
    ),
    Case(
        "size budget: oldest unprotected first",
        [R(f"p{i}00", IMP, size=GB) for i in range(1, 4)] + [R("p400", size=GB)],
        {"p300", "p400"},
        spec=RetentionSpec(max_total_gb=2.0),
        reasons={"p200": "over the 2 GB budget"},
    ),
    Case(
        "size budget skips what a kept checkpoint still needs",
        [
            R("p100", IMP, size=GB),
            R("p200", IMP, size=GB),
            R("p300", IMP, size=1, deps=("p100",)),
            R("p400", size=GB),
        ],
        {"p100", "p300", "p400"},
        spec=RetentionSpec(max_total_gb=2.5),
        reasons={"p100": "dependency of p300", "p200": "budget"},
    ),
    Case(
        "a protected checkpoint's dependencies are protected from the budget",
        [R("f100", IMP, size=GB), R("p200", IMP, size=GB), R("p300", size=GB, deps=("p200",))],
        {"f100", "p200", "p300"},
        spec=RetentionSpec(max_total_gb=1.0),
    ),
    Case(
        "size budget removes a dependent and then its no longer needed base",
        [
            R("f100", IMP, size=GB),
            R("p200", IMP, size=GB, deps=("f100",)),
            R("f300", size=GB),
            R("p400", size=GB),
        ],
        {"f300", "p400"},
        spec=RetentionSpec(max_total_gb=2.0),
    ),
    Case(
        "custom keep counts",
        [R(f"p{i}00", IMP) for i in range(1, 4)] + [R(f"h{i}") for i in range(1, 4)],
        {"p300", "h2", "h3"},
        spec=RetentionSpec(important_keep=1, routine_keep=2),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_retention_table(case: Case) -> None:
    plan = plan_retention(case.records, case.spec, case.anomalies, now=case.now)
    assert set(plan.keep) == case.keep
    assert set(plan.delete) == {r.id for r in case.records} - case.keep
    for rid, fragment in case.reasons.items():
        why = plan.keep.get(rid) or plan.delete[rid]
        assert fragment in why, (rid, why)


def test_over_budget_and_bytes_are_reported() -> None:
    records = [R("p100", CRIT, size=GB), R("p200", size=GB), R("p50", size=7)]
    plan = plan_retention(records, RetentionSpec(max_total_gb=1.0))
    assert plan.over_budget_bytes == GB
    assert plan.bytes_kept == 2 * GB and plan.bytes_freed == 7
    plan = plan_retention(records, RetentionSpec(max_total_gb=5.0))
    assert plan.over_budget_bytes == 0


def test_deletion_order_is_newest_first() -> None:
    records = [R("f100"), R("p200", deps=("f100",)), R("p300", deps=("p200",)), R("f400")]
    records = [*records, R("p500", status=C)]
    spec = RetentionSpec()
    plan = plan_retention([r for r in records if r.id != "p300"] + [R("p300")], spec)
    assert plan.deletion_order == ("p500", "p200", "f100")


def test_pinned_and_protected_are_listed() -> None:
    plan = plan_retention(
        [R("p100"), R("p200"), R("p300", CRIT)], anomalies=[AnomalyEvent(step=150, kind="nan")]
    )
    assert plan.pinned == ("p100",)
    assert plan.protected == ("p100", "p300")


def test_warnings_for_unknown_dependencies_and_duplicates() -> None:
    plan = plan_retention([R("p100", deps=("f1",))])
    assert any("unknown f1" in w for w in plan.warnings)
    assert set(plan.keep) == {"p100"}
    plan = plan_retention([R("p100"), R("p100", 0.9)])
    assert any("duplicate" in w for w in plan.warnings)
    assert "critical" in plan.keep["p100"]  # the later record wins
    plan = plan_retention([R("p100")], anomalies=[AnomalyEvent(step=50, kind="nan")])
    assert any("no valid checkpoint before" in w for w in plan.warnings)


@pytest.mark.parametrize(
    ("score", "expected"),
    [
        (0.0, RetentionClass.ROUTINE),
        (0.49, RetentionClass.ROUTINE),
        (0.5, RetentionClass.IMPORTANT),
        (0.79, RetentionClass.IMPORTANT),
        (0.8, RetentionClass.CRITICAL),
        (1.0, RetentionClass.CRITICAL),
    ],
)
def test_classify(score: float, expected: RetentionClass) -> None:
    assert classify(score, RetentionSpec()) == expected
    assert classify(score) == expected


def test_classify_custom_thresholds() -> None:
    spec = RetentionSpec(critical_score=0.9, important_score=0.9)
    assert classify(0.89, spec) == RetentionClass.ROUTINE
    assert classify(0.9, spec) == RetentionClass.CRITICAL
    assert (
        effective_class(R("p1", 0.95, cls=RetentionClass.ROUTINE), spec) == RetentionClass.ROUTINE
    )


@pytest.mark.parametrize("seed", range(40))
def test_invariants_on_random_catalogs(seed: int) -> None:
    rng = random.Random(seed)
    records: list[CheckpointRecord] = []
    for step in sorted(rng.sample(range(1, 2000), rng.randint(0, 40))):
        tier = rng.choice("hhpf")
        earlier = [r.id for r in records if r.tier != Tier.HEARTBEAT]
        deps = (rng.choice(earlier),) if earlier and tier != "h" and rng.random() < 0.3 else ()
        status = rng.choice([V, V, V, V, C, P, E])
        records.append(
            R(f"{tier}{step}", rng.random(), status, size=rng.randint(1, 5) * GB, deps=deps)
        )
    anomalies = [AnomalyEvent(step=rng.randint(1, 2000), kind="nan") for _ in range(2)]
    spec = RetentionSpec(
        max_total_gb=rng.choice([None, 3.0, 20.0]), max_age_hours=rng.choice([None, 0.2])
    )
    plan = plan_retention(records, spec, anomalies, now=2000.0)
    ids = {r.id for r in records}
    assert set(plan.keep) | set(plan.delete) == ids
    assert not set(plan.keep) & set(plan.delete)
    by_id = {r.id: r for r in records}
    for tier in Tier:
        valid = [r for r in records if r.tier == tier and r.status == V]
        if valid:
            assert max(valid, key=lambda r: r.step).id in plan.keep
    for rid in plan.keep:
        for dep in by_id[rid].depends_on:
            assert dep in plan.keep
    for r in records:
        if r.status == P or (r.status == V and classify(r.score, spec) == RetentionClass.CRITICAL):
            assert r.id in plan.keep
    assert set(plan.pinned) <= set(plan.keep)
    assert sorted(plan.deletion_order, key=lambda i: -by_id[i].step) == list(plan.deletion_order)
