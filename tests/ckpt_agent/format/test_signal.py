"""The save-now signal protocol shared by the operator and the agent."""

from __future__ import annotations

import pytest

from ckpt_agent.format.signal import MAX_CHARS, compose_signal, parse_signal


@pytest.mark.parametrize(
    ("content", "kind", "first"),
    [
        ("request-42", "save", "request-42"),
        ("  please save now\n", "save", "please"),  # free text is a plain save-now
        ("NodeCordoned-ab warning node n1 is cordoned", "warning", "NodeCordoned-ab"),
        ("NodeCordoned-ab clear node n1: the warning went", "clear", "NodeCordoned-ab"),
        ("NodeCordoned-ab warning", "warning", "NodeCordoned-ab"),
        ("warning NodeCordoned-ab", "save", "warning"),  # the kind is the second word
    ],
)
def test_parse(content: str, kind: str, first: str) -> None:
    sig = parse_signal(content)
    assert sig is not None and sig.kind == kind and sig.request == first


def test_empty_is_no_request() -> None:
    assert parse_signal("") is None and parse_signal(" \n") is None


def test_compose_round_trips_and_fits() -> None:
    assert compose_signal("EvictionByEvictionAPI-ab") == "EvictionByEvictionAPI-ab"
    line = compose_signal("NodeNotReady-ab", "warning", "node n1\nis NotReady " + "x" * 500)
    assert "\n" not in line and len(line) == MAX_CHARS
    sig = parse_signal(line)
    assert sig is not None and sig.kind == "warning" and sig.message.startswith("node n1 is")
