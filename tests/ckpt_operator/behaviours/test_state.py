"""What the behaviours remember between events: each object's named methods."""

from __future__ import annotations

from ckpt_operator.behaviours.state import AgentAnswers, NodeSignals, RefusedAttempts, ReportedPods


def test_node_signals() -> None:
    s = NodeSignals()
    assert s.last("n") is None and len(s) == 0  # unknown (e.g. after a restart)
    s.remember("n", "")
    assert s.last("n") == ""  # known calm
    s.remember("n", "drain-1")
    assert s.last("n") == "drain-1" and len(s) == 1
    s.forget("n")
    s.forget("n")  # twice is fine
    assert s.last("n") is None and len(s) == 0


def test_refused_attempts_keep_the_newest() -> None:
    r = RefusedAttempts()
    assert r.newest("ns", "tj") == 0
    r.note("ns", "tj", 2)
    r.note("ns", "tj", 1)  # an older attempt's pod changes nothing
    assert r.newest("ns", "tj") == 2 and r.newest("other", "tj") == 0
    r.forget("ns", "tj")
    assert r.newest("ns", "tj") == 0 and len(r) == 0


def test_reported_pods() -> None:
    p = ReportedPods()
    assert not p.reported("u")
    p.mark("u")
    assert p.reported("u") and len(p) == 1
    p.forget("u")
    p.forget("u")
    assert not p.reported("u")


def test_agent_answers_refusals_count_from_the_first_of_the_same_processes() -> None:
    a = AgentAnswers()
    assert a.refused("u", 0, 100.0) == 100.0
    assert a.refused("u", 0, 160.0) == 100.0  # same processes: since the first refusal
    assert a.refused("u", 1, 200.0) == 200.0  # a container restarted: new processes
    a.answered("u", 1, serving=False)  # no verdict: the suspicion starts over
    assert a.refused("u", 1, 300.0) == 300.0
    assert not a.served_before("u", 1)


def test_agent_answers_serving_until_a_container_restarts() -> None:
    a = AgentAnswers()
    a.refused("u", 0, 100.0)
    a.answered("u", 0, serving=True)
    assert a.served_before("u", 0) and not a.served_before("u", 1)
    assert a.refused("u", 0, 200.0) == 200.0  # the earlier refusal was dropped
    a.forget("u")
    assert not a.served_before("u", 0) and len(a) == 0
