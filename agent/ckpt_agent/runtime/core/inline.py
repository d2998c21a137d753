"""Small values with tensors/arrays inline (base64) as tagged JSON: the heartbeat payloads.

:func:`encode_inline` turns a data position or an RNG capture into a
:mod:`~ckpt_agent.format.jsontree` tree whose tensors and arrays carry their
bytes inline; :func:`decode_inline` is its inverse. For small values only:
the result is part of every heartbeat.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from ckpt_agent.errors import JsonTreeError
from ckpt_agent.format import jsontree
from ckpt_agent.format.heartbeat import Heartbeat
from ckpt_agent.format.layout import DTYPE_ITEMSIZE, TENSOR_MAX_DIMS
from ckpt_agent.format.statecheck import scalar_value
from ckpt_agent.records import Json
from ckpt_agent.runtime.core.serialization import dtype_name, rng_from_packed, torch_dtype

__all__ = ["decode_inline", "encode_inline", "heartbeat_state"]


def _leaf(v: object, path: str) -> Json | None:
    del path
    if isinstance(v, torch.Tensor):
        t = v.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            jsontree.TENSOR: {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "b64": base64.b64encode(data).decode("ascii"),
            }
        }
    if isinstance(v, np.ndarray):
        a = np.ascontiguousarray(v)
        return {
            jsontree.NDARRAY: {
                "dtype": str(a.dtype),
                "shape": list(a.shape),
                "b64": base64.b64encode(a.tobytes()).decode("ascii"),
            }
        }
    if isinstance(v, np.generic):
        return {jsontree.NPSCALAR: [str(v.dtype), jsontree.encode(v.item())]}
    return None


def encode_inline(value: object) -> Json:
    """Tagged JSON with tensors/arrays inline (base64): for heartbeats (small values only)."""
    return jsontree.encode(value, _leaf)


def _array(tag: str, payload: Json, path: str) -> object:
    if not isinstance(payload, dict):
        raise JsonTreeError(f"{path}: bad inline array")
    dtype = payload.get("dtype")
    shape = payload.get("shape")
    if (
        dtype not in DTYPE_ITEMSIZE
        or not isinstance(shape, list)
        or len(shape) > TENSOR_MAX_DIMS
        or not all(type(s) is int and s >= 0 for s in shape)
    ):
        raise JsonTreeError(f"{path}: bad inline array dtype/shape")
    try:
        raw = base64.b64decode(str(payload.get("b64", "")), validate=True)
    except ValueError:  # binascii.Error included
        raise JsonTreeError(f"{path}: inline array is not base64") from None
    n = 1
    for s in shape:
        n *= s
    if n * DTYPE_ITEMSIZE[str(dtype)] != len(raw):
        raise JsonTreeError(f"{path}: inline array has the wrong size")
    if tag == jsontree.NDARRAY:
        return np.frombuffer(raw, dtype=np.dtype(str(dtype))).reshape(shape).copy()
    buf = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    return buf.view(torch_dtype(str(dtype))).reshape(shape)


def _resolve(tag: str, payload: Json, path: str) -> object:
    if tag in (jsontree.TENSOR, jsontree.NDARRAY):
        return _array(tag, payload, path)
    if tag == jsontree.NPSCALAR:
        dtype, value = scalar_value(payload, path)
        return np.dtype(dtype).type(value)
    raise JsonTreeError(f"{path}: unexpected {tag} in a heartbeat")


def decode_inline(tree: Json) -> object:
    """Inverse of :func:`encode_inline`."""
    return jsontree.decode(tree, _resolve)


def heartbeat_state(hb: Heartbeat) -> tuple[object, object]:
    """A heartbeat's (data position, RNG states) as live values: the RNG from its packed
    record, or from the tagged JSON of entries written before it."""
    rng = rng_from_packed(hb.rng_packed) if hb.rng_packed is not None else decode_inline(hb.rng)
    return decode_inline(hb.data), rng
