"""The memory tier, peer replicas and JIT in the simulator (#31): by hand, and invariants."""

from __future__ import annotations

import math

import pytest

from ckpt_agent.decide.fault_traces import (
    NODE,
    ONE,
    PROCESS,
    RACK,
    WIDE,
    Fault,
    FaultTrace,
    llama3_trace,
)
from ckpt_agent.decide.sim_memory import (
    GIB,
    JIT,
    LOCAL,
    PEER,
    START,
    STORAGE,
    Plan,
    TierCosts,
    percentile,
    replay_tiers,
)
from ckpt_agent.decide.simulate import Costs, replay_fixed
from ckpt_agent.decide.traces import Trace

# replication of one snapshot to one peer takes 1 s; reading the state back: 1 s per GB/s
ONE_S = TierCosts(state_gib=1e9 / GIB, replica_gbps=1.0)
MEM = Plan("mem", storage_every=1000, local_memory=True, memory_every=5, replicas=1)
# 2 s steps, memory snapshots every 5 steps stalling 0.2 s: step 5 ends at 10 s, usable at
# 10.2, replicated at 11.2; step 10 ends at 20.2, usable at 20.4, replicated at 21.4;
# step 15 ends at 30.4, usable at 30.6


def fault(t: float, kind: str = NODE, scope: str = ONE, q: float = 0.0, draw: float = 0.5) -> Fault:
    return Fault(t, "test", kind, scope, q, draw)


def one(plan: Plan, f: Fault, costs: TierCosts = ONE_S, horizon: float = 60.0):  # type: ignore[no-untyped-def]
    res = replay_tiers(FaultTrace("t", horizon, (f,)), plan, costs)
    assert len(res.recoveries) == 1
    return res.recoveries[0]


def test_a_node_loss_with_its_peer_alive_resumes_from_the_replica() -> None:
    rec = one(MEM, fault(21.0))  # the step-10 replica is still streaming (until 21.4)
    assert (rec.source, rec.step, rec.back) == (PEER, 10, 5)
    assert rec.lost_s == pytest.approx(0.6 + 5 * 2.0)
    assert rec.replica_lag == 5
    later = one(MEM, fault(22.0))  # now it has arrived
    assert (later.source, later.back, later.replica_lag) == (PEER, 10, 0)
    assert later.lost_s == pytest.approx(1.6)
    assert later.recovery_s == pytest.approx(ONE_S.restart + 1.0 / ONE_S.peer_read_gbps)


def test_a_node_loss_whose_peer_is_lost_falls_back_to_storage() -> None:
    rec = one(MEM, fault(22.0, q=1.0))
    assert (rec.source, rec.back) == (START, 0)  # no storage save yet: from the start
    assert rec.lost_s == pytest.approx(1.6 + 10 * 2.0)
    with_storage = Plan("m", storage_every=4, local_memory=True, memory_every=3, replicas=1)
    # step 3 ends 6.0 -> snapshot 6.2; step 4 (storage) ends 8.2 -> 10.2, durable 15.2;
    # step 7 ends 16.2 -> 16.4; step 8 (storage) ends 18.4 -> 20.4, durable 25.4
    rec = one(with_storage, fault(24.0, q=1.0))
    assert (rec.source, rec.back, rec.step) == (STORAGE, 4, 9)
    assert rec.lost_s == pytest.approx(1.6 + 5 * 2.0)
    assert rec.recovery_s == pytest.approx(30.0 + 1.0 / ONE_S.storage_read_gbps)
    peer = one(with_storage, fault(24.0, q=0.0))
    assert (peer.source, peer.back) == (PEER, 8)


def test_k_replicas_survive_unless_every_peer_is_lost() -> None:
    f = fault(22.0, q=0.5, draw=0.3)
    assert f.peers_lost(1) and not f.peers_lost(2)
    assert f.peers_lost(0)  # no replica at all
    assert not fault(22.0, kind=PROCESS, q=1.0, draw=0.0).peers_lost(1)
    two = Plan("m2", 1000, None, True, 5, replicas=2)
    costs = TierCosts(state_gib=0.5e9 / GIB, replica_gbps=1.0)  # 0.5 s per peer, 1 s for 2
    assert costs.replicate_s(2) == pytest.approx(1.0)
    assert one(two, f, costs).source == PEER
    assert one(Plan("m1", 1000, None, True, 5, replicas=1), f, costs).source == START


def test_a_process_crash_resumes_from_the_node_memory() -> None:
    rec = one(MEM, fault(21.0, kind=PROCESS))
    assert (rec.source, rec.back) == (LOCAL, 10)  # newer than the replica (5)
    assert rec.lost_s == pytest.approx(0.6)
    assert rec.recovery_s == pytest.approx(30.0 + 1.0 / ONE_S.local_read_gbps)
    # a failure inside the snapshot's stall: that snapshot is not usable
    rec = one(MEM, fault(20.3, kind=PROCESS))
    assert (rec.source, rec.back) == (LOCAL, 5)


def test_today_process_crash_from_memory_node_loss_from_storage() -> None:
    today = Plan("today", storage_every=5, local_memory=True)
    # step 5 ends 10, stall to 12, durable at 17; step 10 would end at 22
    rec = one(today, fault(21.0, kind=PROCESS))
    assert (rec.source, rec.back, rec.step) == (LOCAL, 5, 9)  # ties storage: the faster
    assert rec.lost_s == pytest.approx(1.0 + 4 * 2.0)
    assert one(today, fault(21.0)).source == STORAGE
    # before the save is durable: the node loss starts over, the process crash does not
    assert one(today, fault(15.0)).source == START
    assert (
        one(today, fault(15.0, kind=PROCESS)).source,
        one(today, fault(15.0, kind=PROCESS)).back,
    ) == (LOCAL, 5)
    storage_only = Plan("fixed", storage_every=5)
    assert one(storage_only, fault(21.0, kind=PROCESS)).source == STORAGE
    assert one(storage_only, fault(15.0, kind=PROCESS)).source == START


@pytest.mark.parametrize("kind", [PROCESS, NODE])
def test_jit_loses_at_most_the_partial_step_where_replicas_survive(kind: str) -> None:
    jit = Plan("jit", 1000, None, True, 5, 1, jit=True)
    rec = one(jit, fault(21.9, kind=kind))
    assert (rec.source, rec.back, rec.step) == (JIT, 10, 10)
    assert rec.lost_s == pytest.approx(1.5) and rec.lost_s < ONE_S.step_time
    assert rec.recovery_s == pytest.approx(30.0 + ONE_S.memory_stall + 1.0 / ONE_S.peer_read_gbps)
    # every rank failed (wide) or a rack with it: no survivors to save from
    assert one(jit, fault(21.9, kind=kind, scope=WIDE)).source != JIT
    assert one(jit, fault(21.9, kind=kind, scope=RACK)).source != JIT
    # without node memory there is no JIT path either
    assert one(Plan("s", 5, jit=True), fault(21.9, kind=kind)).source != JIT


def test_jit_bounds_every_eligible_failure_of_a_long_trace_to_one_step() -> None:
    trace = llama3_trace(days=10, seed=3, peer_loss=0.2, same_rack=0.5)
    res = replay_tiers(trace, Plan("jit", 500, 1000, True, 30, 1, jit=True), TierCosts())
    eligible = [r for r in res.recoveries if r.fault.jit_possible]
    assert eligible and all(r.source == JIT for r in eligible)
    assert all(r.lost_s <= TierCosts().step_time for r in eligible)
    assert all(r.source != JIT for r in res.recoveries if not r.fault.jit_possible)


def test_replica_lag_when_replication_is_slower_than_the_snapshots() -> None:
    # 12 s per replica: step 5's (usable 10.2) arrives at 22.2; step 10's waits and
    # starts then (arrives 34.2); step 15's (30.6) waits behind it, arrives 46.2
    slow = TierCosts(state_gib=12e9 / GIB, replica_gbps=1.0)
    rec = one(MEM, fault(34.0), slow, horizon=80.0)
    assert (rec.source, rec.back, rec.step, rec.replica_lag) == (PEER, 5, 16, 11)
    assert one(MEM, fault(34.5), slow, horizon=80.0).back == 10
    assert one(MEM, fault(46.5), slow, horizon=80.0).back == 15
    rec = one(MEM, fault(21.0), slow)
    assert (rec.source, rec.replica_lag) == (START, 10)  # nothing replicated yet


def test_a_newer_snapshot_replaces_the_one_waiting_to_replicate() -> None:
    # 25 s per replica: step 5's (10.2) arrives at 35.2; step 10's (20.4) waits and is
    # replaced by step 15's (30.6), which starts at 35.2 and arrives at 60.2
    slow = TierCosts(state_gib=25e9 / GIB, replica_gbps=1.0)
    assert one(MEM, fault(60.0), slow, horizon=90.0).back == 5
    rec = one(MEM, fault(60.9), slow, horizon=90.0)
    assert (rec.source, rec.back, rec.step) == (PEER, 15, 29)


def test_streams_in_flight_are_lost_with_the_failure() -> None:
    trace = FaultTrace("t", 80.0, (fault(21.0, kind=PROCESS), fault(60.0, q=0.0)))
    slow = TierCosts(state_gib=30e9 / GIB, replica_gbps=1.0)  # 30 s: never finishes before
    res = replay_tiers(trace, MEM, slow)
    assert [r.source for r in res.recoveries] == [LOCAL, START]


def test_wall_time_is_progress_stalls_lost_work_and_recoveries() -> None:
    trace = llama3_trace(days=5, seed=1, peer_loss=0.3, same_rack=0.5)
    plans = [
        Plan("fixed", 100),
        Plan("today", 197, 1000, True),
        Plan("mem", 500, 1000, True, 7, 1),
        Plan("mem2", 500, 1000, True, 3, 2),
        Plan("jit", 500, 1000, True, 7, 1, jit=True),
    ]
    for plan in plans:
        res = replay_tiers(trace, plan, TierCosts())
        parts = res.final_step * 2.0 + res.stall_s + res.lost_s + res.recovery_s
        assert res.elapsed_s == pytest.approx(parts, rel=1e-9)
        assert res.goodput == pytest.approx(res.final_step * 2.0 / res.elapsed_s)
        assert len(res.recoveries) == len(trace.faults)
        assert all(r.back <= r.step and r.lost_s >= 0 for r in res.recoveries)
        assert sum(res.by_source().values()) == len(trace.faults)


def test_storage_tiers_match_the_policy_simulators_fixed_replay() -> None:
    """Node losses, nothing in memory and nothing to read: the same lost work as
    :func:`replay_fixed` (which the policy simulator checks against the real tiers)."""
    times = (333.0, 2_000.5, 2_010.0, 7_777.7, 12_345.6)
    costs = TierCosts(state_gib=0.0)
    for every, full in ((50, None), (97, 1000), (300, 1000)):
        mine = replay_tiers(
            FaultTrace("t", 20_000.0, tuple(fault(t) for t in times)), Plan("f", every, full), costs
        )
        theirs = replay_fixed(Trace("t", 20_000.0, times), every, Costs(), full_every=full)
        assert mine.lost_s == pytest.approx(theirs.lost_s)
        assert mine.saves == theirs.saves
        assert mine.stall_s == pytest.approx(theirs.stall_s)


def test_the_memory_tier_alone_keeps_its_own_stall_and_the_storage_cadence() -> None:
    res = replay_tiers(FaultTrace("t", 2_000.0, ()), Plan("m", 100, None, True, 10), TierCosts())
    # 100-step storage saves, 9 memory snapshots between each two
    assert res.saves == pytest.approx(res.snapshots / 9, abs=1)
    assert res.stall_s == pytest.approx(res.saves * 2.0 + res.snapshots * 0.2)


def test_costs_and_plans() -> None:
    c = TierCosts(state_gib=2.0, replica_gbps=4.0)
    assert c.replicate_s(3) == pytest.approx(3 * 2 * GIB / 4e9)
    assert c.recovery_s(START) == c.restart
    assert c.recovery_s(STORAGE) > c.recovery_s(PEER) > c.recovery_s(LOCAL) > c.restart
    for bad in (
        dict(storage_every=0),
        dict(storage_every=5, memory_every=0),
        dict(storage_every=5, replicas=-1),
    ):
        with pytest.raises(ValueError, match="bad"):
            Plan("bad", **bad)  # type: ignore[arg-type]
    assert not Plan("x", 5).in_memory and Plan("x", 5, memory_every=3).in_memory


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 99.0) == 99.0
    assert percentile(values, 100.0) == 100.0
    assert percentile([3.0, 1.0], 50.0) == 1.0
    assert math.isnan(percentile([], 99.0))


def test_a_failure_during_a_recovery_loses_no_further_work() -> None:
    trace = FaultTrace("t", 120.0, (fault(22.0), fault(23.0, kind=PROCESS)))
    first, second = replay_tiers(trace, MEM, ONE_S).recoveries
    assert (first.source, first.back) == (PEER, 10)
    # the node's memory went with it; the replica of step 10 is still there
    assert (second.source, second.step, second.back, second.lost_s) == (PEER, 10, 10, 0.0)
