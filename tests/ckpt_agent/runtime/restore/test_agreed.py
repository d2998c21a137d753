"""Several ranks resume alike: rank 0 chooses, every other rank restores exactly its choice
with rank 0's lineage, or fails loudly with rank 0's error (ranks as threads, Engines over
fakes, scripted restorers)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import runtime_fakes as fk

from ckpt_agent.errors import ResumeError
from ckpt_agent.policy import AgentConfig
from ckpt_agent.records import Lineage
from ckpt_agent.runtime.dist.rank_group import RankGroup
from ckpt_agent.runtime.restore.agreed import agreed_resume_point
from ckpt_agent.runtime.restore.resume_point import ResumePoint, ResumeRequest

ConfigFactory = Callable[..., AgentConfig]

LINEAGE = Lineage(epoch=3, pins=("RECOVER.json:full_step_40",), parent="pulse_step_44")


class ScriptedRestorer:
    """Rank 0 answers ``point`` (or raises ``error``); the others echo what they were told."""

    def __init__(self, point: ResumePoint | None = None, error: Exception | None = None) -> None:
        self.point = point
        self.error = error
        self.weights_from: str | None = (
            "full_step_40" if point and point.action.startswith("rebuild") else None
        )
        self.chosen: list[ResumeRequest | None] = []

    def resume_point(self, chosen: ResumeRequest | None = None) -> ResumePoint:
        self.chosen.append(chosen)
        if self.error is not None:
            raise self.error
        if chosen is not None:
            return ResumePoint(
                step=45,
                checkpoint_id=chosen.checkpoint_id,
                action=chosen.action,
                lineage=chosen.lineage,
            )
        assert self.point is not None
        return self.point


def _run(
    config: AgentConfig, zero: ScriptedRestorer, others: list[ScriptedRestorer]
) -> list[object]:
    world = fk.ThreadWorld(1 + len(others))
    restorers = [zero, *others]
    groups = []
    for r in range(world.n):
        engine, _ = fk.make_engine(config, rank=r, world_size=world.n, distributed=True)
        g = RankGroup(engine, timeout_s=20)
        g.setup(control=world.comm(r), commit=world.comm(r))
        groups.append(g)
    return world.run(lambda r: agreed_resume_point(restorers[r], groups[r]))  # type: ignore[arg-type]


def test_every_rank_restores_rank_0s_choice_with_its_lineage(ck_config: ConfigFactory) -> None:
    point = ResumePoint(
        step=45,
        checkpoint_id="pulse_step_44",
        checkpoint_step=44,
        action="resume",
        lineage=LINEAGE,
    )
    zero, one, two = ScriptedRestorer(point), ScriptedRestorer(), ScriptedRestorer()
    got = _run(ck_config(), zero, [one, two])
    assert got[0] is point
    assert zero.chosen == [None]
    want = ResumeRequest("pulse_step_44", weights_from=None, action="resume", lineage=LINEAGE)
    assert one.chosen == two.chosen == [want]
    assert [p.lineage for p in got] == [LINEAGE] * 3  # type: ignore[attr-defined]


def test_a_heartbeat_rebuild_names_its_weights_source_to_every_rank(
    ck_config: ConfigFactory,
) -> None:
    point = ResumePoint(step=46, checkpoint_id="heartbeat_step_45", action="rebuild_from_heartbeat")
    zero, one = ScriptedRestorer(point), ScriptedRestorer()
    _run(ck_config(), zero, [one])
    assert one.chosen == [
        ResumeRequest("heartbeat_step_45", "full_step_40", "rebuild_from_heartbeat", Lineage())
    ]


def test_a_fresh_start_on_rank_0_is_a_fresh_start_everywhere(ck_config: ConfigFactory) -> None:
    zero, one = ScriptedRestorer(ResumePoint(step=0, reason="no checkpoints")), ScriptedRestorer()
    got = _run(ck_config(), zero, [one])
    assert one.chosen == []  # nothing to load
    assert isinstance(got[1], ResumePoint) and got[1].step == 0 and not got[1].resumed
    assert got[1].reason == "no checkpoints"


def test_when_rank_0_cannot_choose_every_rank_fails_with_its_reason(
    ck_config: ConfigFactory,
) -> None:
    zero, one = ScriptedRestorer(error=ResumeError("none is usable")), ScriptedRestorer()
    got = _run(ck_config(), zero, [one])
    assert isinstance(got[0], ResumeError) and str(got[0]) == "none is usable"
    assert isinstance(got[1], ResumeError)
    assert "rank 0 could not choose a checkpoint: ResumeError: none is usable" in str(got[1])
    assert one.chosen == []


def test_the_choice_survives_its_wire_form() -> None:
    c = ResumeRequest("full_step_9", "full_step_8", "manual", LINEAGE)
    assert ResumeRequest.from_json(c.to_json()) == c
    with pytest.raises(ResumeError):
        ResumeRequest.from_json({"id": ""})
