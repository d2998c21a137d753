"""The L0 heartbeat: captured on the training thread, written by a thread of its own.

What happens where:

* **training thread** (:meth:`Heartbeats.put`, inside ``Checkpointer.step`` when a
  heartbeat is due): the step, the time, the data position (encoded at once: it is
  the user's object) and the raw RNG states — :func:`random.getstate`, NumPy's
  legacy state (the previous one re-used while the generator has not moved,
  :class:`NumpyRngState`), ``torch.get_rng_state()`` (and CUDA's) — go into the
  pending slot: one attribute store, no lock, no I/O, no encoding.
* **heartbeat thread** (:class:`HeartbeatWriter`): at most once per
  ``heartbeat.flushIntervalSeconds`` it takes the newest capture (older ones are
  coalesced away), packs its RNG states (:class:`~ckpt_agent.format.heartbeat.PackedRng`),
  appends it to the ring (the newest 4) and commits the ring object (write, fsync,
  rename): at most one fsync per interval, about 56 KB each.

Durability: a heartbeat is in storage at most one interval plus one write after
``step()`` returned; ``Checkpointer.wait()`` and ``close()`` flush, so the
newest one is durable when they return.
"""

from __future__ import annotations

import ctypes
import logging
import random
import sys
import sysconfig
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from ckpt_agent.background import libc, lower_thread_priority
from ckpt_agent.errors import CheckpointFormatError, StorageError
from ckpt_agent.format.fence import Fence
from ckpt_agent.format.heartbeat import (
    Heartbeat,
    PackedRng,
    assemble_rng,
    encode_heartbeats,
    pack_numpy_rng,
    pack_python_rng,
    read_heartbeat,
)
from ckpt_agent.format.layout import heartbeat_key
from ckpt_agent.records import Json
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.core.inline import encode_inline
from ckpt_agent.storage.base import Storage

__all__ = [
    "HeartbeatCapture",
    "HeartbeatCapturer",
    "HeartbeatWriter",
    "Heartbeats",
    "NumpyRngState",
    "PythonRngState",
    "RngPacker",
]

log = logging.getLogger(__name__)

_MT_WORDS = 624
_STATE_BYTES = (_MT_WORDS + 1) * 4
_PY_HEADER = 16
"""``PyObject_HEAD`` of a CPython object with the GIL (refcount, type)."""


@cache
def _memcmp() -> Any:
    lib = libc()
    fn = getattr(lib, "memcmp", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class NumpyRngState:
    """NumPy's legacy global generator state, re-read only when the generator moved.

    ``np.random.get_state()`` builds a dict and copies 624 words (tens of µs); most
    training loops never draw from NumPy's global generator. The MT19937 state
    (``key[624]``, ``pos``) is watched through the bit generator's documented
    ``ctypes.state_address`` and compared with the copy taken at the last full read
    (one ``memcmp``). The cached state is returned only when those 2500 bytes are
    unchanged and it held no cached Gaussian (a cached one is consumed without
    moving the generator). The layout is checked once against ``get_state()``; where
    it does not match, every call reads the state in full.
    """

    def __init__(self) -> None:
        self._words: np.ndarray[Any, Any] | None = None
        self._seen = np.zeros(_MT_WORDS + 1, dtype=np.uint32)
        self._seen_at = self._seen.ctypes.data
        self._live_at = 0
        self._last: tuple[Any, ...] | None = None
        self._memcmp = _memcmp()
        try:
            bitgen = np.random.mtrand._rand._bit_generator
            raw = (ctypes.c_uint32 * (_MT_WORDS + 1)).from_address(bitgen.ctypes.state_address)
            words = np.ctypeslib.as_array(raw)
            st = np.random.get_state(legacy=True)
            assert isinstance(st, tuple)
            if (
                st[0] == "MT19937"
                and np.array_equal(words[:_MT_WORDS], st[1])
                and int(words[_MT_WORDS]) == int(st[2])
                and self._memcmp is not None
            ):
                self._words = words
                self._live_at = int(bitgen.ctypes.state_address)
        except Exception:  # another NumPy: read in full every time
            self._words = None

    @property
    def watched(self) -> bool:
        """The fast path is available (the layout matched)."""
        return self._words is not None

    def get(self) -> tuple[Any, ...]:
        """``np.random.get_state(legacy=True)`` as of now."""
        last, words = self._last, self._words
        if (
            last is not None
            and words is not None
            and last[3] == 0
            and self._memcmp(self._live_at, self._seen_at, _STATE_BYTES) == 0
        ):
            return last
        st = np.random.get_state(legacy=True)
        assert isinstance(st, tuple)
        if words is not None:
            np.copyto(self._seen[:_MT_WORDS], st[1])
            self._seen[_MT_WORDS] = st[2]
        self._last = st
        return st


class PythonRngState:
    """:func:`random.getstate` as of now, re-read only when the generator moved.

    ``random.getstate()`` builds a tuple of 625 integers (about 30 µs here). On
    CPython the module's generator object holds ``int index; uint32_t state[624]``
    right after the object header; those 2500 bytes are compared (one ``memcmp``)
    with the copy taken at the last full read, and the cached state is returned
    while they and ``gauss_next`` are unchanged. The layout is checked once against
    ``getstate()`` (and the object's size first); anywhere else — another
    interpreter, a free-threaded build, another layout — every call reads in full.
    """

    def __init__(self) -> None:
        self._inst: Any = getattr(random.getstate, "__self__", None)
        self._seen = np.zeros(_MT_WORDS + 1, dtype=np.uint32)
        self._seen_at = self._seen.ctypes.data
        self._live_at = 0
        self._last: tuple[Any, ...] | None = None
        self._memcmp = _memcmp()
        try:
            self._live_at = self._locate()
        except Exception:
            self._live_at = 0

    def _locate(self) -> int:
        inst = self._inst
        if (
            inst is None
            or self._memcmp is None
            or sys.implementation.name != "cpython"
            or sysconfig.get_config_var("Py_GIL_DISABLED")
            or type(inst).__basicsize__ < _PY_HEADER + _STATE_BYTES
        ):
            return 0
        at = id(inst) + _PY_HEADER
        raw = np.ctypeslib.as_array((ctypes.c_uint32 * (_MT_WORDS + 1)).from_address(at))
        version, words, _ = inst.getstate()
        ok = version == 3 and len(words) == _MT_WORDS + 1
        ok = ok and int(raw[0]) == words[-1] and raw[1:].tolist() == list(words[:-1])
        return at if ok else 0

    @property
    def watched(self) -> bool:
        return self._live_at != 0

    def get(self) -> tuple[Any, ...]:
        last = self._last
        if (
            last is not None
            and self._live_at
            and self._memcmp(self._live_at, self._seen_at, _STATE_BYTES) == 0
            and self._inst.gauss_next == last[2]
        ):
            return last
        st = random.getstate()
        if self._live_at:
            ctypes.memmove(self._seen_at, self._live_at, _STATE_BYTES)
        self._last = st
        return st


@dataclass(slots=True)  # not frozen: its __init__ runs on the training thread at every
class HeartbeatCapture:  # heartbeat, and a frozen one pays an object.__setattr__ per field
    """What the training thread captured for one heartbeat (encoded by the writer; never
    changed once handed over)."""

    step: int
    time: float
    epoch: int | None
    data: Json
    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] = ()

    def heartbeat(self) -> Heartbeat:
        """The stored form (the RNG states packed): called on the heartbeat thread."""
        version, words, gauss = self.python
        name, key, pos, has_gauss, cached = self.numpy
        rng = PackedRng(
            python=(int(version), tuple(words), gauss),
            numpy=(
                str(name),
                np.ascontiguousarray(key, dtype="<u4").tobytes(),
                int(pos),
                int(has_gauss),
                float(cached),
            ),
            torch_cpu=_tensor_bytes(self.torch_cpu),
            cuda=tuple(_tensor_bytes(t) for t in self.cuda),
        )
        return Heartbeat(
            step=self.step, time=self.time, epoch=self.epoch, data=self.data, rng_packed=rng
        )


def _tensor_bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous():
        return t.numpy().tobytes()  # torch.get_rng_state(): one copy, no dispatch
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


class RngPacker:
    """A capture's RNG states as :meth:`PackedRng.pack` bytes, on the training thread, at
    every step (JIT saves' step record): Python's and NumPy's parts are packed again only
    when their generator moved (the capture then holds another state object), so a step
    pays for the torch generator's bytes and one join."""

    def __init__(self) -> None:
        self._python: tuple[object, bytes] = (None, b"")
        self._numpy: tuple[object, bytes] = (None, b"")

    def __call__(self, cap: HeartbeatCapture) -> bytes:
        if cap.python is not self._python[0]:
            version, words, gauss = cap.python
            self._python = (cap.python, pack_python_rng((int(version), tuple(words), gauss)))
        if cap.numpy is not self._numpy[0]:
            name, key, pos, has_gauss, cached = cap.numpy
            key_bytes = np.ascontiguousarray(key, dtype="<u4").tobytes()
            state = (str(name), key_bytes, int(pos), int(has_gauss), float(cached))
            self._numpy = (cap.numpy, pack_numpy_rng(state))
        return assemble_rng(
            self._python[1],
            self._numpy[1],
            _tensor_bytes(cap.torch_cpu),
            tuple(_tensor_bytes(t) for t in cap.cuda),
        )


class HeartbeatWriter:
    """Writes the heartbeat ring from its own thread, at most once per ``interval`` seconds.

    :meth:`put` only stores the capture in the slot (the newest wins); the thread
    looks at the slot every ``interval`` and writes it when it is new.
    """

    def __init__(
        self,
        storage: Storage,
        run_id: str,
        rank: int,
        *,
        ring: int = 4,
        interval: float = 0.25,
        background_priority: bool = True,
    ) -> None:
        self._storage = storage
        self._run_id = run_id
        self._rank = rank
        #: The writer generation of this process (rank 0; None: unfenced).
        self.fence: Fence | None = None
        self.interval = interval
        self._ring: deque[Heartbeat] = deque(maxlen=ring)
        self._slot: tuple[int, HeartbeatCapture | Heartbeat] | None = None
        """(number, capture) of the newest capture (set by the training thread only)."""
        self._done = 0
        """The number of the newest capture handled (written, or its write failed)."""
        self._cond = threading.Condition()
        self._urgent = False
        self._closed = False
        self.captured = 0
        self.written = 0
        self.failures = 0
        self.last_error: BaseException | None = None
        self.last_bytes = 0
        self._priority = background_priority
        self._thread = threading.Thread(
            target=self._run, name=f"ckpt-heartbeat-{rank}", daemon=True
        )
        self._thread.start()

    @property
    def coalesced(self) -> int:
        """Captures replaced by a newer one before they were written."""
        return max(0, self.captured - self.written - self.failures)

    def seed(self, entries: list[Heartbeat], upto_step: int) -> None:
        """Continue an existing ring; entries past ``upto_step`` belong to an abandoned
        branch and are removed from storage right away (so nobody reads them as progress)."""
        keep = [e for e in entries if e.step <= upto_step]
        with self._cond:
            self._ring.clear()
            self._ring.extend(keep)
        if len(keep) != len(entries):
            if self.fence is not None:
                self.fence.check()
            key = heartbeat_key(self._run_id, self._rank)
            if keep:
                self._storage.commit(key, encode_heartbeats(self._run_id, self._rank, keep))
            else:
                self._storage.delete(key)

    def put(self, capture: HeartbeatCapture | Heartbeat) -> None:
        """Hand over the newest heartbeat (training thread: no lock, no I/O)."""
        self.captured += 1
        self._slot = (self.captured, capture)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Write the newest capture now; True once it (or a newer one) is handled."""
        slot = self._slot
        target = slot[0] if slot is not None else 0
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._urgent = True
            self._cond.notify_all()
            while self._done < target and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return self._done >= target

    def _run(self) -> None:
        if self._priority:
            lower_thread_priority()
        while True:
            with self._cond:
                if not (self._urgent or self._closed):
                    self._cond.wait(self.interval)  # at most one write per interval
                self._urgent = False
                slot, closing = self._slot, self._closed
            if slot is not None and slot[0] > self._done:
                self._write(slot[1])
                with self._cond:
                    self._done = slot[0]
                    self._cond.notify_all()
            elif closing:
                return

    def _write(self, item: HeartbeatCapture | Heartbeat) -> None:
        try:
            if self.fence is not None:  # a fenced writer's ring must not replace the holder's
                self.fence.check()
            hb = item.heartbeat() if isinstance(item, HeartbeatCapture) else item
            self._ring.append(hb)
            data = encode_heartbeats(self._run_id, self._rank, list(self._ring))
            self._storage.commit(heartbeat_key(self._run_id, self._rank), data)
            self.written += 1
            self.last_bytes = len(data)
        except Exception as e:
            self.failures += 1
            self.last_error = e
            log.warning("heartbeat write failed: %s", e)

    def close(self, timeout: float | None = 30.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)


class HeartbeatCapturer:
    """Captures a heartbeat on the training thread: step, time, data position (encoded at
    once: it is the user's object) and the raw RNG states; shared by the heartbeat ring
    and the just-in-time save's step record (:mod:`ckpt_agent.runtime.shm.jit`)."""

    def __init__(self, capture: StateCapture) -> None:
        self.capture = capture
        self._numpy = NumpyRngState()
        self._python = PythonRngState()
        self._cuda = torch.cuda.is_available()

    def __call__(self, step: int) -> HeartbeatCapture:
        data = self.capture.data_state() if self.capture.dataloader_state is not None else None
        epoch = data.get("epoch") if isinstance(data, dict) else None
        cuda: tuple[torch.Tensor, ...] = ()
        if self._cuda and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            cuda = tuple(torch.cuda.get_rng_state_all())
        return HeartbeatCapture(
            step=step,
            time=time.time(),
            epoch=epoch if isinstance(epoch, int) else None,
            data=None if data is None else encode_inline(data),
            python=self._python.get(),
            numpy=self._numpy.get(),
            torch_cpu=torch.get_rng_state(),
            cuda=cuda,
        )


class Heartbeats:
    """This rank's heartbeat ring: step, data position and RNG at every due heartbeat."""

    def __init__(self, engine: Engine, capturer: HeartbeatCapturer, *, resume_step: int) -> None:
        """Continue the stored ring; entries past ``resume_step - 1`` (an abandoned branch) go."""
        self.capturer = capturer
        spec = engine.config.tiers.heartbeat
        self.writer = HeartbeatWriter(
            engine.storage, engine.run_id, engine.ranks.rank, interval=spec.flush_interval_seconds
        )
        self.writer.fence = engine.parts.writer.fence  # rank 0's claim (None elsewhere)
        try:
            ring = read_heartbeat(engine.storage, engine.run_id, engine.ranks.rank)
        except (CheckpointFormatError, StorageError):
            ring = []
        self.writer.seed(ring, resume_step - 1)

    def put(self, step: int, captured: HeartbeatCapture | None = None) -> None:
        """Hand the heartbeat of ``step`` to the writer (training thread; the writer encodes
        it): ``captured`` when this step's was taken already, else captured now."""
        self.writer.put(
            captured if captured is not None and captured.step == step else self.capturer(step)
        )

    def flush(self, timeout: float | None) -> None:
        self.writer.flush(timeout)

    def close(self, timeout: float | None) -> None:
        self.writer.close(timeout)
