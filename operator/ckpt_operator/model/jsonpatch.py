"""RFC 6902 JSON Patch: the type the builders return and a small applier.

Admission webhooks answer with a JSON Patch. The builders return plain
``list[JSONPatchOp]`` so they stay pure and testable; :func:`apply_patch`
applies such a list to a copy of an object (tests use it to check idempotency:
the patched object must yield no further ops), and :func:`apply_patch_in_place`
is what the kopf handler hands to ``patch.fns``.

Only ``add``, ``replace``, ``remove`` and ``test`` are implemented: the
builders use nothing else.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "JSONPatchError",
    "JSONPatchOp",
    "add",
    "apply_patch",
    "apply_patch_in_place",
    "escape",
    "pointer",
]


class JSONPatchOp(TypedDict):
    """One RFC 6902 operation."""

    op: Literal["add", "replace", "remove", "test"]
    path: str
    value: NotRequired[Any]


class JSONPatchError(ValueError):
    """The patch does not apply to the document."""


def escape(token: str) -> str:
    """Escape one JSON Pointer reference token (``~`` → ``~0``, ``/`` → ``~1``)."""
    return token.replace("~", "~0").replace("/", "~1")


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def pointer(*tokens: str | int) -> str:
    """A JSON Pointer from unescaped tokens: ``pointer("metadata", "annotations", "a/b")``."""
    return "".join("/" + escape(str(t)) for t in tokens)


def add(path: str, value: Any) -> JSONPatchOp:
    return {"op": "add", "path": path, "value": value}


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    if not path.startswith("/"):
        raise JSONPatchError(f"not a JSON pointer: {path!r}")
    tokens = [_unescape(t) for t in path[1:].split("/")]
    node = doc
    for tok in tokens[:-1]:
        if isinstance(node, dict):
            if tok not in node:
                raise JSONPatchError(f"{path}: missing member {tok!r}")
            node = node[tok]
        elif isinstance(node, list):
            try:
                node = node[int(tok)]
            except (ValueError, IndexError):
                raise JSONPatchError(f"{path}: bad index {tok!r}") from None
        else:
            raise JSONPatchError(f"{path}: cannot descend into a scalar")
    return node, tokens[-1]


def _apply_one(doc: Any, op: JSONPatchOp) -> None:
    parent, last = _parent(doc, op["path"])
    kind = op["op"]
    if isinstance(parent, dict):
        if kind == "add":
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "replace":
            if last not in parent:
                raise JSONPatchError(f"{op['path']}: replace of a missing member")
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            if last not in parent:
                raise JSONPatchError(f"{op['path']}: remove of a missing member")
            del parent[last]
        elif parent.get(last) != op.get("value"):
            raise JSONPatchError(f"{op['path']}: test failed")
        return
    if isinstance(parent, list):
        if kind == "add" and last == "-":
            parent.append(copy.deepcopy(op["value"]))
            return
        try:
            idx = int(last)
        except ValueError:
            raise JSONPatchError(f"{op['path']}: bad index {last!r}") from None
        if kind == "add":
            if not 0 <= idx <= len(parent):
                raise JSONPatchError(f"{op['path']}: index out of range")
            parent.insert(idx, copy.deepcopy(op["value"]))
            return
        if not 0 <= idx < len(parent):
            raise JSONPatchError(f"{op['path']}: index out of range")
        if kind == "replace":
            parent[idx] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[idx]
        elif parent[idx] != op.get("value"):
            raise JSONPatchError(f"{op['path']}: test failed")
        return
    raise JSONPatchError(f"{op['path']}: parent is a scalar")


def apply_patch_in_place(doc: dict[str, Any], ops: Sequence[JSONPatchOp]) -> None:
    """Apply ``ops`` to ``doc`` (mutates it). Raises :class:`JSONPatchError`."""
    for op in ops:
        _apply_one(doc, op)


def apply_patch(doc: dict[str, Any], ops: Sequence[JSONPatchOp]) -> dict[str, Any]:
    """A patched deep copy of ``doc``."""
    out = copy.deepcopy(doc)
    apply_patch_in_place(out, ops)
    return out
