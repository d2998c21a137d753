from __future__ import annotations

import pytest

from ckpt_operator.model.jsonpatch import JSONPatchError, apply_patch, pointer


def test_pointer_escaping() -> None:
    assert (
        pointer("metadata", "annotations", "ckpt.dev/x~y") == "/metadata/annotations/ckpt.dev~1x~0y"
    )


def test_apply_ops() -> None:
    doc = {"a": {"b/c": 1}, "l": [1, 2]}
    out = apply_patch(
        doc,
        [
            {"op": "add", "path": "/l/-", "value": 3},
            {"op": "add", "path": "/l/0", "value": 0},
            {"op": "replace", "path": "/a/b~1c", "value": 2},
            {"op": "add", "path": "/n", "value": {"x": [1]}},
            {"op": "test", "path": "/a/b~1c", "value": 2},
            {"op": "remove", "path": "/l/1"},
        ],
    )
    assert out == {"a": {"b/c": 2}, "l": [0, 2, 3], "n": {"x": [1]}}
    assert doc == {"a": {"b/c": 1}, "l": [1, 2]}


@pytest.mark.parametrize(
    "op",
    [
        {"op": "replace", "path": "/missing", "value": 1},
        {"op": "remove", "path": "/l/5"},
        {"op": "add", "path": "/x/y", "value": 1},
        {"op": "test", "path": "/l/0", "value": 9},
        {"op": "add", "path": "nope", "value": 1},
    ],
)
def test_bad_ops_raise(op: dict[str, object]) -> None:
    with pytest.raises(JSONPatchError):
        apply_patch({"l": [1]}, [op])  # type: ignore[list-item]
