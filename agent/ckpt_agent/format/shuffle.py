"""numpy byte shuffle for :mod:`ckpt_agent.format.codec` (agent side; ~1-2 GB/s).

Kept out of :mod:`ckpt_agent.format.codec` so that the torch/numpy-free modules the
operator imports never import numpy.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Final

import numpy as np

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer as Buffer

from ckpt_agent.errors import CodecError

__all__ = ["NUMPY_SHUFFLER", "NumpyShuffler"]


class NumpyShuffler:
    """Byte shuffle through a strided numpy copy; reuses one scratch buffer per thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _scratch(self, n: int) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1 << 20), dtype=np.uint8)
            self._local.buf = buf
        return buf[:n]

    def shuffle(self, data: memoryview, itemsize: int) -> Buffer:
        n = len(data)
        body = n - n % itemsize
        src = np.frombuffer(data, dtype=np.uint8)
        out = self._scratch(n)
        np.copyto(out[:body].reshape(itemsize, -1), src[:body].reshape(-1, itemsize).T)
        if body != n:
            out[body:] = src[body:]
        return out.data

    def unshuffle(self, data: Buffer, itemsize: int, out: memoryview) -> None:
        src = np.frombuffer(memoryview(data), dtype=np.uint8)
        n = src.size
        if len(out) != n:
            raise CodecError(f"unshuffle: output has {len(out)} bytes, input {n}")
        body = n - n % itemsize
        dst = np.frombuffer(out, dtype=np.uint8)
        np.copyto(dst[:body].reshape(-1, itemsize), src[:body].reshape(itemsize, -1).T)
        if body != n:
            dst[body:] = src[body:]


NUMPY_SHUFFLER: Final = NumpyShuffler()
