"""RankGroup: the per-step agreement, broadcasts and gathers over the agent's groups (ranks
as threads of this process, each with an Engine over fakes; no torch.distributed)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import runtime_fakes as fk

from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.errors import CheckpointError
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.dist.agreement import Agreed
from ckpt_agent.runtime.dist.rank_group import RankGroup

ConfigFactory = Callable[..., AgentConfig]


def _groups(config: AgentConfig, world: fk.ThreadWorld) -> list[RankGroup]:
    groups = []
    for r in range(world.n):
        engine, _ = fk.make_engine(config, rank=r, world_size=world.n, distributed=True)
        g = RankGroup(engine, timeout_s=20)
        g.setup(control=world.comm(r), commit=world.comm(r))
        groups.append(g)
    return groups


def test_every_rank_acts_on_one_decision_and_one_busy_rank_holds_all(
    ck_config: ConfigFactory,
) -> None:
    world = fk.ThreadWorld(3)
    groups = _groups(ck_config(tiers={"pulse": {"baseInterval": 2, "minInterval": 2}}), world)

    def step(rank: int) -> list[Agreed]:
        g = groups[rank]
        return [
            g.decide(s, 1.0 + rank, None, SystemSignals(), busy=(rank == 1 and s == 2),
                     emergency=False, stop=False)
            for s in range(4)
        ]

    results = world.run(step)
    assert not any(isinstance(r, BaseException) for r in results), results
    per_rank = [[a.decision for a in r] for r in results]  # type: ignore[union-attr]
    assert per_rank[0] == per_rank[1] == per_rank[2]
    busy = [[a.any_busy for a in r] for r in results]  # type: ignore[union-attr]
    assert busy == [[False, False, True, False]] * 3
    agreed = results[0][2]  # type: ignore[index]
    assert agreed.busy_ranks == (1,) and agreed.loss == pytest.approx(2.0)
    logged = groups[0].engine
    logged.decisions.flush()
    lines = (logged.work_dir / "decisions.rank0.jsonl").read_text().splitlines()
    events = [e for e in map(json.loads, lines) if e["event"] == "agreement"]
    assert [(e["step"], e["busy_ranks"]) for e in events] == [(2, [1])]


def test_a_stop_on_one_rank_stops_every_rank(ck_config: ConfigFactory) -> None:
    world = fk.ThreadWorld(2)
    groups = _groups(ck_config(), world)
    results = world.run(
        lambda r: groups[r].decide(7, 0.5, 0.1, SystemSignals(), busy=False, emergency=False,
                                   stop=(r == 1))
    )
    assert [(a.stop, a.stop_ranks) for a in results] == [(True, (1,)), (True, (1,))]  # type: ignore[union-attr]


def test_broadcast_and_gather_carry_rank_0s_value_and_everyones(
    ck_config: ConfigFactory,
) -> None:
    world = fk.ThreadWorld(2)
    groups = _groups(ck_config(), world)
    got = world.run(lambda r: (groups[r].broadcast({"token": f"t{r}"}), groups[r].gather(r * 10)))
    assert got == [({"token": "t0"}, [0, 10])] * 2


def test_before_setup_a_broadcast_is_the_value_itself(ck_config: ConfigFactory) -> None:
    engine, _ = fk.make_engine(ck_config(), rank=1, world_size=2, distributed=True)
    g = RankGroup(engine, timeout_s=1)
    assert not g.ready and g.commit_comm is None
    assert g.broadcast("mine") == "mine"


def test_setup_refuses_a_group_that_disagrees_with_the_ranks(ck_config: ConfigFactory) -> None:
    engine, _ = fk.make_engine(ck_config(), rank=1, world_size=2, distributed=True)
    world = fk.ThreadWorld(2)
    with pytest.raises(CheckpointError, match="disagree with torch.distributed"):
        RankGroup(engine, timeout_s=1).setup(control=world.comm(0), commit=world.comm(0))
