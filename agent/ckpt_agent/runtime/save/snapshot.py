"""Snapshots (the only work on the training thread) and the background workers.

:class:`HostArena` keeps one preallocated host buffer per tensor name and
reuses it across saves (pinned memory when the source is on a GPU). Taking a
snapshot (:func:`take_snapshot`) copies every tensor of the state into its
buffer — no ``deepcopy``, no serialization, no hashing — and re-encodes the
small non-tensor parts (``param_groups``, scheduler counters, RNG) into fresh
JSON values. After it returns, nothing the training loop does can change what
the snapshot holds: the buffers belong to the snapshot until the persister
releases them, and the engine never takes a new snapshot while they are in
use (back-pressure).

:class:`BackgroundWorker` runs jobs on one thread, in order, with a bounded
queue; an exception is kept and handed back exactly once
(:meth:`BackgroundWorker.take_errors`); its thread runs at background priority
(:func:`ckpt_agent.background.lower_thread_priority`). The L0 heartbeat is
:mod:`ckpt_agent.runtime.save.heartbeat`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import torch

from ckpt_agent import tuning
from ckpt_agent.background import lower_thread_priority
from ckpt_agent.persist.writer import TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Json
from ckpt_agent.runtime.core.devices import synchronize_copies
from ckpt_agent.runtime.core.serialization import LiveArray, flatten, raw_bytes

__all__ = [
    "APPROX_KEYS",
    "BackgroundWorker",
    "HostArena",
    "Snapshot",
    "SnapshotItem",
    "take_snapshot",
]

log = logging.getLogger(__name__)

J = TypeVar("J")

#: Optimizer state entries the opt-in approximate filter may keep stale.
APPROX_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"})


@dataclass(frozen=True)
class SnapshotItem:
    """One tensor of a snapshot: its host copy and the live metadata it was taken from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer: torch.Tensor | np.ndarray
    stale: bool = False
    """Kept from the previous snapshot by the approximate filter (not re-copied)."""

    def source(self) -> TensorSource:
        return TensorSource(self.name, self.dtype, self.shape, raw_bytes(self.buffer))


@dataclass
class Snapshot:
    """Everything one checkpoint will hold, frozen at ``step``."""

    step: int
    tier: Tier
    tree: dict[str, Json]
    """Section name → tagged-JSON tree (tensors by reference)."""
    items: list[SnapshotItem]
    files: dict[str, bytes] = field(default_factory=dict)
    approximate: bool = False
    stall_s: float = 0.0
    created_at: float = 0.0
    nbytes: int = 0

    @property
    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name → (dtype, shape) of the live state, for validation."""
        return {i.name: (i.dtype, i.shape) for i in self.items}

    def sources(self) -> list[TensorSource]:
        return [i.source() for i in self.items]


def _page_aligned_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes starting on a page boundary (``DIRECT_IO_ALIGN``)."""
    raw = np.empty(nbytes + tuning.DIRECT_IO_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % tuning.DIRECT_IO_ALIGN
    return raw[skip : skip + nbytes]


def host_tensor(shape: torch.Size, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """An empty host buffer; page-aligned when large (its chunks can then be written to
    storage with ``O_DIRECT``, :class:`ckpt_agent.storage.fs_writer.DirectIO`)."""
    nbytes = shape.numel() * dtype.itemsize
    if nbytes < tuning.DIRECT_IO_MIN_BYTES or pin:
        # Pinned memory is page-aligned already (and CUDA's host allocator rounds sizes up
        # to a power of two: padding a 1 GiB buffer by a page would pin 2 GiB).
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
    return torch.from_numpy(_page_aligned_bytes(nbytes)).view(dtype).view(shape)


def host_array(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """:func:`host_tensor` for a NumPy array."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < tuning.DIRECT_IO_MIN_BYTES:
        return np.empty(shape, dtype=dtype)
    return _page_aligned_bytes(nbytes).view(dtype).reshape(shape)


class HostArena:
    """Reusable host buffers, one per tensor name (reallocated only when shape/dtype change).

    Large buffers are page-aligned (:func:`host_tensor`)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor | np.ndarray] = {}
        self._filled: set[str] = set()
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        total = 0
        for b in self._buffers.values():
            total += int(b.nbytes) if isinstance(b, np.ndarray) else b.numel() * b.element_size()
        return total

    def __len__(self) -> int:
        return len(self._buffers)

    def _buffer(self, live: LiveArray) -> tuple[torch.Tensor | np.ndarray, bool]:
        """The buffer for ``live`` and whether it already holds an earlier copy."""
        v = live.value
        buf = self._buffers.get(live.name)
        if isinstance(v, np.ndarray):
            if not (isinstance(buf, np.ndarray) and buf.shape == v.shape and buf.dtype == v.dtype):
                buf = host_array(v.shape, v.dtype)
                self._buffers[live.name] = buf
                self._filled.discard(live.name)
                self.allocations += 1
            return buf, live.name in self._filled
        if not (isinstance(buf, torch.Tensor) and buf.shape == v.shape and buf.dtype == v.dtype):
            pin = v.device.type == "cuda"
            buf = host_tensor(v.shape, v.dtype, pin=pin)
            self._buffers[live.name] = buf
            self._filled.discard(live.name)
            self.allocations += 1
        return buf, live.name in self._filled

    def reserve(self, arrays: Sequence[LiveArray]) -> None:
        """Allocate and touch (zero) the buffers for ``arrays`` without copying them: reads
        only their shapes, dtypes and devices, so it may run beside the training thread
        (never beside a snapshot)."""
        for live in arrays:
            buf, filled = self._buffer(live)
            if not filled:
                if isinstance(buf, np.ndarray):
                    buf.fill(0)
                else:
                    buf.zero_()

    def copy_in(self, live: LiveArray, approx_threshold: float | None = None) -> SnapshotItem:
        buf, filled = self._buffer(live)
        v = live.value
        stale = False
        if isinstance(v, np.ndarray):
            assert isinstance(buf, np.ndarray)
            np.copyto(buf, v)
        else:
            assert isinstance(buf, torch.Tensor)
            src = v.detach()
            if (
                approx_threshold is not None
                and filled
                and src.device.type == "cpu"
                and src.is_floating_point()
                and src.numel() > 0
                and live.name.rsplit("/", 1)[-1] in APPROX_KEYS
                and float((src - buf).abs().max()) < approx_threshold
            ):
                stale = True  # keep the previously written values: the blob is re-used
            else:
                buf.copy_(src, non_blocking=src.device.type == "cuda")
        self._filled.add(live.name)
        return SnapshotItem(live.name, live.dtype, live.shape, buf, stale)

    def prune(self, keep: set[str]) -> None:
        """Free buffers of tensors that no longer exist."""
        for name in list(self._buffers):
            if name not in keep:
                del self._buffers[name]
                self._filled.discard(name)

    def clear(self) -> None:
        self._buffers.clear()
        self._filled.clear()


def take_snapshot(
    step: int,
    tier: Tier,
    sections: Mapping[str, object],
    arena: HostArena,
    *,
    files: Mapping[str, bytes] | None = None,
    approx_threshold: float | None = None,
    now: float | None = None,
) -> Snapshot:
    """Copy ``sections`` (name → live state object) into ``arena`` (the training-thread stall)."""
    t0 = time.perf_counter()
    live: dict[str, LiveArray] = {}
    tree: dict[str, Json] = {}
    for name, value in sections.items():
        tree[name] = flatten(value, name, live)
    items = [arena.copy_in(a, approx_threshold) for a in live.values()]
    synchronize_copies(a.value for a in live.values())  # every device, not just the current
    stall = time.perf_counter() - t0
    return Snapshot(
        step=step,
        tier=tier,
        tree=tree,
        items=items,
        files=dict(files or {}),
        approximate=any(i.stale for i in items),
        stall_s=stall,
        created_at=time.time() if now is None else now,
        nbytes=sum(len(i.source().data) for i in items),
    )


# --------------------------------------------------------------------------- workers


@dataclass
class JobError:
    """A failed background job."""

    what: str
    error: BaseException
    tier: Tier | None = None
    """The tier of the save that failed (None: not a save, e.g. a validation); the
    scheduler retries that tier."""


class BackgroundWorker(Generic[J]):
    """One daemon thread running ``handler(job)`` for submitted jobs, in order.

    ``capacity`` bounds queued + running jobs; :meth:`submit` returns False
    when full (the caller decides: defer or :meth:`wait_idle`). Exceptions
    are logged, kept, and returned once by :meth:`take_errors`.
    """

    def __init__(
        self,
        name: str,
        handler: Callable[[J], None],
        *,
        capacity: int = 1,
        describe: Callable[[J], str] = repr,
        tier_of: Callable[[J], Tier | None] = lambda job: None,
    ) -> None:
        self.name = name
        self._handler = handler
        self._describe = describe
        self._tier_of = tier_of
        self._capacity = capacity
        self._queue: queue.Queue[J | None] = queue.Queue()
        self._cond = threading.Condition()
        self._inflight = 0
        self._errors: list[JobError] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        with self._cond:
            return self._inflight

    @property
    def busy(self) -> bool:
        return self.pending > 0

    def submit(self, job: J) -> bool:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if self._inflight >= self._capacity:
                return False
            self._inflight += 1
        self._queue.put(job)
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no job is queued or running; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_below(self, n: int, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._inflight >= n:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def take_errors(self) -> list[JobError]:
        if not self._errors:  # every training step: no lock while there is none (an error
            return []  # appended meanwhile is taken by the next call, as with the lock)
        with self._cond:
            errs, self._errors = self._errors, []
        return errs

    def _run(self) -> None:
        lower_thread_priority()  # the threads its pools start inherit it
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._handler(job)
            except BaseException as e:
                what = self._describe(job)
                log.error("%s: %s failed: %s", self.name, what, e, exc_info=True)
                with self._cond:
                    self._errors.append(JobError(what, e, self._tier_of(job)))
            finally:
                with self._cond:
                    self._inflight -= 1
                    self._cond.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """Finish queued jobs and stop; False if the thread did not end in time."""
        with self._cond:
            if self._closed:
                return not self._thread.is_alive()
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()
