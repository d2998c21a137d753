"""Recovery source candidates: what cannot be is refused; read time by where it is read."""

from __future__ import annotations

import pytest

from ckpt_agent.decide.source_candidates import (
    DEFAULT_LATENCY_S,
    DEFAULT_READ_GBPS,
    KINDS,
    SourceCandidate,
    SourceCosts,
)

GB = 10**9


def rep(rank: int, step: int, node: str, **kw: object) -> SourceCandidate:
    return SourceCandidate("peer_replica", rank, step, node, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kind": "tape"}, "the kind is one of"),
        ({"verdict": "fine"}, "the verdict one of"),
        ({"rank": -1}, "never negative"),
        ({"nbytes": -5}, "never negative"),
        ({"location": ""}, "name its node or checkpoint"),
        ({"has_state": False, "has_rank_items": False}, "neither state nor rank items"),
    ],
)
def test_candidates_refuse_what_cannot_be(kw: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"kind": "local_memory", "rank": 0, "step": 1, "location": "a"}
    with pytest.raises(ValueError, match=message):
        SourceCandidate(**{**fields, **kw})  # type: ignore[arg-type]


def test_json_round_trip_and_refusals() -> None:
    c = rep(3, 12, "node-7", verdict="verified", nbytes=5, has_rank_items=False, epoch=2)
    assert SourceCandidate.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="a list of 9 fields"):
        SourceCandidate.from_json({"kind": "storage"})
    with pytest.raises(ValueError, match="booleans"):
        SourceCandidate.from_json(["storage", 0, 1, "x", "verified", 0, 1, 1, 0])


def test_costs_refuse_a_bandwidth_or_latency_that_cannot_be() -> None:
    with pytest.raises(ValueError, match="bandwidth > 0"):
        SourceCosts(gbps={"local_memory": 1.0, "peer_replica": 0.0, "storage": 1.0})
    with pytest.raises(ValueError, match="latency >= 0"):
        SourceCosts(latency_s={"local_memory": 0.0, "peer_replica": 0.0})


def test_defaults_shm_over_network_over_storage() -> None:
    assert [DEFAULT_READ_GBPS[k] for k in KINDS] == sorted(DEFAULT_READ_GBPS.values(), reverse=True)
    assert [DEFAULT_LATENCY_S[k] for k in KINDS] == sorted(DEFAULT_LATENCY_S.values())
    with pytest.raises(TypeError):
        DEFAULT_READ_GBPS["storage"] = 100.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("kind", "location", "reader", "path", "seconds"),
    [
        ("local_memory", "a", "a", "local_memory", 0.001 + 0.2),
        ("local_memory", "a", "b", "peer_replica", 0.01 + 0.8),  # another node's memory
        ("local_memory", "a", None, "local_memory", 0.001 + 0.2),
        ("peer_replica", "b", "b", "local_memory", 0.001 + 0.2),  # the replica is here
        ("peer_replica", "b", "a", "peer_replica", 0.01 + 0.8),
        ("peer_replica", "b", None, "peer_replica", 0.01 + 0.8),
        ("storage", "full_step_1", "full_step_1", "storage", 0.05 + 4.0),
        ("storage", "full_step_1", None, "storage", 0.05 + 4.0),
    ],
)
def test_read_time_by_where_it_is_read(
    kind: str, location: str, reader: str | None, path: str, seconds: float
) -> None:
    c = SourceCandidate(kind, 0, 1, location, nbytes=4 * GB)  # type: ignore[arg-type]
    costs = SourceCosts()
    assert costs.path(c, reader) == path
    assert costs.read_seconds(c, reader) == pytest.approx(seconds)
    assert costs.read_seconds(c, reader, "items") == pytest.approx(DEFAULT_LATENCY_S[path])


def test_order_fastest_then_kind_then_verified() -> None:
    costs = SourceCosts()
    a = SourceCandidate("peer_replica", 0, 1, "a", "unverified")
    b = SourceCandidate("peer_replica", 0, 1, "a", "verified")
    c = SourceCandidate("local_memory", 0, 1, "c", "unverified")
    assert sorted([a, b, c], key=lambda x: costs.order(x, "z", "state")) == [c, b, a]
    assert sorted([a, b, c], key=lambda x: costs.order(x, "a", "state")) == [b, a, c]
