"""Heartbeat payloads: tensors, arrays and numpy scalars inline in tagged JSON."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from ckpt_agent.errors import JsonTreeError
from ckpt_agent.format import jsontree
from ckpt_agent.runtime.core.inline import decode_inline, encode_inline


def test_round_trip_of_a_data_position_and_rng_like_state() -> None:
    value: dict[str, Any] = {
        "epoch": 3,
        "ids": torch.arange(5, dtype=torch.int64),
        "empty": torch.empty(0, dtype=torch.float32),
        "bf16": torch.ones(2, 2, dtype=torch.bfloat16),
        "arr": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "scalar": np.float64(0.25),
        "nested": [1, "x", None],
    }
    tree = encode_inline(value)
    back = decode_inline(json.loads(json.dumps(tree, allow_nan=False)))
    assert isinstance(back, dict)
    assert back["epoch"] == 3 and back["nested"] == [1, "x", None]
    assert torch.equal(back["ids"], value["ids"]) and back["empty"].numel() == 0
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], value["bf16"])
    assert np.array_equal(back["arr"], value["arr"]) and back["arr"].dtype == np.uint32
    assert back["scalar"] == np.float64(0.25) and isinstance(back["scalar"], np.float64)


def test_a_payload_of_the_wrong_size_is_refused() -> None:
    tree = encode_inline({"t": torch.arange(4, dtype=torch.int32)})
    tree["t"][jsontree.TENSOR]["shape"] = [5]
    with pytest.raises(JsonTreeError, match="wrong size"):
        decode_inline(tree)


def test_a_dicts_scalars_encode_as_the_walk_encodes_them() -> None:
    """Scalars in a dict skip the recursive walk (every heartbeat encodes a data position,
    #27): what comes out, what is tagged and what is refused are unchanged."""
    value: dict[str, Any] = {
        "a": 1,
        "b": 1.5,
        "c": "x",
        "d": None,
        "e": True,
        "f": float("nan"),
        "g": [1, 2],
        "h": {"i": float("-inf"), "j": {"k": 0}},
        "t": (1,),
        "n": np.int64(3),
    }
    assert encode_inline(value) == {
        "a": 1,
        "b": 1.5,
        "c": "x",
        "d": None,
        "e": True,
        "f": {jsontree.FLOAT: "nan"},
        "g": [1, 2],
        "h": {"i": {jsontree.FLOAT: "-inf"}, "j": {"k": 0}},
        "t": {jsontree.TUPLE: [1]},
        "n": encode_inline(np.int64(3)),
    }
    with pytest.raises(JsonTreeError, match="a/big: an integer of more than"):
        encode_inline({"a": {"big": 10**400}})
    with pytest.raises(JsonTreeError, match="a: an integer of more than"):
        encode_inline({"a": 10**400, 3: 1})  # the error of the first value, keys mixed
    # keys other than str, wherever they come, and a tag as the only key: the tagged form
    assert encode_inline({"b": 2, 1: "a"}) == {jsontree.DICT: [["b", 2], [1, "a"]]}
    assert encode_inline({1: "a", "b": 2}) == {jsontree.DICT: [[1, "a"], ["b", 2]]}
    assert encode_inline({jsontree.TUPLE: [1]}) == {jsontree.DICT: [[jsontree.TUPLE, [1]]]}
    assert encode_inline({jsontree.TUPLE: [1], "x": 1}) == {jsontree.TUPLE: [1], "x": 1}

    def chain(n: int) -> dict[str, Any]:
        v: dict[str, Any] = {"x": 1}
        for _ in range(n):
            v = {"k": v}
        return v

    encode_inline(chain(jsontree.MAX_DEPTH - 1))
    with pytest.raises(JsonTreeError, match="nested deeper than"):
        encode_inline(chain(jsontree.MAX_DEPTH))
