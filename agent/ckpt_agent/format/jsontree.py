"""Exact, pickle-free JSON encoding of state-dict trees.

Torch-free. State dicts hold more than JSON can say (integer keys, tuples,
``inf``/``nan``, bytes, tensors). This module encodes such trees into plain
JSON with a few tags and decodes them back exactly:

=================== ====================================================
``{"__tuple__": [...]}``             a tuple
``{"__dict__": [[k, v], ...]}``      a dict with non-string (or tag-like) keys
``{"__float__": "nan"|"inf"|"-inf"}`` non-finite floats (strict JSON)
``{"__bytes__": "<base64>"}``         bytes
``{"__tensor__": "<name>"}``          a tensor stored beside the tree (hooks)
``{"__ndarray__": "<name>"}``         a numpy array stored beside the tree
``{"__npscalar__": [dtype, value]}``  a numpy scalar
``{"__dtype__": "float32"}``          a torch dtype
=================== ====================================================

Leaves that are not JSON types go through the caller's ``leaf`` hook (the
torch side turns tensors into ``__tensor__`` references); anything else is a
:class:`TypeError` naming the path. Decoding only ever builds JSON values,
tuples, dicts, bytes and floats, and hands the extension tags to the caller's
``resolve`` hook: nothing in a file can make it run code.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from ckpt_agent.errors import JsonTreeError
from ckpt_agent.format.layout import JSON_MAX_INT_DIGITS
from ckpt_agent.records import Json

__all__ = ["EXTENSION_TAGS", "TAGS", "Leaf", "Resolve", "decode", "encode", "walk_refs"]


TUPLE: Final = "__tuple__"
DICT: Final = "__dict__"
FLOAT: Final = "__float__"
BYTES: Final = "__bytes__"
TENSOR: Final = "__tensor__"
NDARRAY: Final = "__ndarray__"
NPSCALAR: Final = "__npscalar__"
DTYPE: Final = "__dtype__"

#: Tags handled by the caller's hooks (the others are decoded here).
EXTENSION_TAGS: Final = frozenset({TENSOR, NDARRAY, NPSCALAR, DTYPE})
TAGS: Final = frozenset({TUPLE, DICT, FLOAT, BYTES}) | EXTENSION_TAGS

#: ``leaf(value, path) -> json`` for non-JSON leaves; returns None to refuse.
Leaf = Callable[[object, str], Json | None]
#: ``resolve(tag, payload, path) -> value`` for extension tags.
Resolve = Callable[[str, Json, str], object]

MAX_DEPTH: Final = 64


def _join(path: str, key: object) -> str:
    return f"{path}/{key}" if path else str(key)


def encode(value: object, leaf: Leaf | None = None, path: str = "") -> Json:
    """Encode ``value`` as tagged JSON (see the module docstring)."""
    return _enc(value, leaf, path, 0)


def _enc(value: object, leaf: Leaf | None, path: str, depth: int) -> Json:
    if depth > MAX_DEPTH:
        raise JsonTreeError(f"{path or '<root>'}: nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | str):
        return value
    if type(value) is int:
        if not -_INT_LIMIT < value < _INT_LIMIT:
            raise JsonTreeError(
                f"{path or '<root>'}: an integer of more than {JSON_MAX_INT_DIGITS} digits "
                "(readers refuse it; store it as a string or bytes)"
            )
        return value
    if type(value) is float:
        if math.isfinite(value):
            return value
        return {FLOAT: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if type(value) is list:
        if _plain(value):
            return list(value)
        return [_enc(v, leaf, _join(path, i), depth + 1) for i, v in enumerate(value)]
    if type(value) is tuple:
        if _plain(value):
            return {TUPLE: list(value)}
        return {TUPLE: [_enc(v, leaf, _join(path, i), depth + 1) for i, v in enumerate(value)]}
    if type(value) is bytes:
        return {BYTES: base64.b64encode(value).decode("ascii")}
    if isinstance(value, dict) and type(value).__module__ in ("builtins", "collections"):
        if depth < MAX_DEPTH and not (len(value) == 1 and next(iter(value)) in TAGS):
            # str keys (the common case, e.g. a heartbeat's data position at every step):
            # exact JSON scalars as _enc returns them, without the call and its path;
            # at the first other key, the tagged form below (same values, same errors)
            enc: dict[str, Json] = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    break
                t = type(v)
                if (
                    t in _SCALARS
                    or (t is int and -_INT_LIMIT < v < _INT_LIMIT)
                    or (t is float and math.isfinite(v))
                ):
                    enc[k] = v
                else:
                    enc[k] = _enc(v, leaf, _join(path, k), depth + 1)
            else:
                return enc
        plain = all(isinstance(k, str) for k in value) and not (
            len(value) == 1 and next(iter(value)) in TAGS
        )
        if plain:  # only nested too deep: the values' own _enc says so
            return {k: _enc(v, leaf, _join(path, k), depth + 1) for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if isinstance(k, str | int | float | bool | tuple) or k is None:
                pairs.append(
                    [_enc(k, None, path, depth + 1), _enc(v, leaf, _join(path, k), depth + 1)]
                )
            else:
                raise JsonTreeError(
                    f"{path or '<root>'}: unsupported dict key type {type(k).__name__}"
                )
        return {DICT: pairs}
    if leaf is not None:
        out = leaf(value, path)
        if out is not None:
            return out
    # int/float subclasses (IntEnum, numpy float64) lose their type: say so instead.
    raise JsonTreeError(
        f"{path or '<root>'}: cannot checkpoint a "
        f"{type(value).__module__}.{type(value).__qualname__} "
        "without pickle; state must be tensors, numpy arrays and JSON values "
        "(None/bool/int/float/str/bytes/list/tuple/dict)"
    )


_SCALARS = (str, bool, type(None))
_INT_LIMIT: Final = 10**JSON_MAX_INT_DIGITS


def _plain(items: Iterable[object]) -> bool:
    """All elements are exact JSON scalars (the fast path for RNG states, index lists)."""
    for v in items:
        t = type(v)
        if t in _SCALARS:
            continue
        if t is int and -_INT_LIMIT < v < _INT_LIMIT:
            continue
        if t is float and math.isfinite(v):  # type: ignore[arg-type]
            continue
        return False
    return True


def decode(tree: Json, resolve: Resolve | None = None, path: str = "") -> object:
    """Decode a tagged tree; extension tags go to ``resolve`` (error if None)."""
    return _dec(tree, resolve, path, 0)


def _dec(tree: Json, resolve: Resolve | None, path: str, depth: int) -> object:
    if depth > MAX_DEPTH:
        raise JsonTreeError(f"{path or '<root>'}: nested deeper than {MAX_DEPTH} levels")
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, list):
        if _plain(tree):
            return list(tree)
        return [_dec(v, resolve, _join(path, i), depth + 1) for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        raise JsonTreeError(f"{path or '<root>'}: not a JSON value: {type(tree).__name__}")
    if len(tree) == 1:
        ((tag, payload),) = tree.items()
        if tag in TAGS:
            return _dec_tag(tag, payload, resolve, path, depth)
    return {k: _dec(v, resolve, _join(path, k), depth + 1) for k, v in tree.items()}


def _dec_tag(tag: str, payload: Json, resolve: Resolve | None, path: str, depth: int) -> object:
    where = path or "<root>"
    if tag == TUPLE:
        if not isinstance(payload, list):
            raise JsonTreeError(f"{where}: {TUPLE} needs a list")
        return tuple(_dec(v, resolve, _join(path, i), depth + 1) for i, v in enumerate(payload))
    if tag == DICT:
        if not isinstance(payload, list):
            raise JsonTreeError(f"{where}: {DICT} needs a list of pairs")
        out: dict[object, object] = {}
        for pair in payload:
            if not isinstance(pair, list) or len(pair) != 2:
                raise JsonTreeError(f"{where}: {DICT} entries are [key, value] pairs")
            key = _dec(pair[0], None, path, depth + 1)
            if isinstance(key, list | dict):
                raise JsonTreeError(f"{where}: unhashable dict key")
            out[key] = _dec(pair[1], resolve, _join(path, key), depth + 1)
        return out
    if tag == FLOAT:
        if payload == "nan":
            return math.nan
        if payload == "inf":
            return math.inf
        if payload == "-inf":
            return -math.inf
        raise JsonTreeError(f"{where}: bad {FLOAT} value {payload!r}")
    if tag == BYTES:
        if not isinstance(payload, str):
            raise JsonTreeError(f"{where}: {BYTES} needs a base64 string")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise JsonTreeError(f"{where}: bad base64 in {BYTES}") from None
    if resolve is None:
        raise JsonTreeError(f"{where}: {tag} reference but no resolver")
    return resolve(tag, payload, path)


def walk_refs(tree: Json, tag: str = TENSOR) -> list[str]:
    """All string payloads of ``tag`` in ``tree`` (e.g. every tensor name), in order."""
    out: list[str] = []
    stack: list[Json] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            if len(node) == 1 and tag in node and isinstance(node[tag], str):
                out.append(node[tag])
            else:
                stack.extend(reversed(list(node.values())))
    return out


def as_mapping(value: object, what: str) -> Mapping[str, object]:
    """``value`` if it is a str-keyed dict, else :class:`JsonTreeError`."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise JsonTreeError(f"{what}: expected an object")
    return value
