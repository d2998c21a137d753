"""The L0 heartbeat: captured on the training thread, written by its own thread, rate-bounded."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from ckpt_agent.format.heartbeat import Heartbeat, read_heartbeat
from ckpt_agent.runtime.core.inline import heartbeat_state
from ckpt_agent.runtime.core.serialization import capture_rng, restore_rng
from ckpt_agent.runtime.save.heartbeat import (
    HeartbeatCapture,
    HeartbeatWriter,
    NumpyRngState,
    PythonRngState,
    RngPacker,
)
from ckpt_agent.storage.fs import LocalStorage


class Counting(LocalStorage):
    """Counts commits (one fsync each); ``delay`` makes every commit slow."""

    delay = 0.0
    commits = 0

    def commit(self, key: str, data: bytes) -> None:
        time.sleep(self.delay)
        type(self).commits += 1
        super().commit(key, data)


def _capture(step: int, numpy: NumpyRngState) -> HeartbeatCapture:
    return HeartbeatCapture(
        step=step,
        time=time.time(),
        epoch=None,
        data={"pos": step},
        python=random.getstate(),
        numpy=numpy.get(),
        torch_cpu=torch.get_rng_state(),
    )


def test_puts_never_wait_and_writes_are_bounded_per_interval(ck_store: LocalStorage) -> None:
    class Slow(Counting):
        delay = 0.05
        commits = 0

    store = Slow(ck_store.root)
    hb = HeartbeatWriter(store, "run1", 0, ring=3, interval=0.2)
    t0 = time.perf_counter()
    for step in range(50):
        hb.put(Heartbeat(step=step, time=0.0, data={"pos": step}))
    assert time.perf_counter() - t0 < 0.05  # puts do not wait for the store
    assert hb.flush(10)
    assert read_heartbeat(store, "run1")[-1].step == 49  # flushed: the newest is durable
    for step in range(50, 80):  # 30 puts over ~0.6 s: about 3 writes at 0.2 s, never 30
        hb.put(Heartbeat(step=step, time=0.0))
        time.sleep(0.02)
    before = Slow.commits
    hb.close()
    ring = read_heartbeat(store, "run1")
    assert ring[-1].step == 79 and len(ring) <= 3
    assert hb.written <= 1 + 6 and hb.coalesced > 60  # 0.6 s / 0.2 s + close, with slack
    assert Slow.commits - before <= 1


def test_a_captured_heartbeat_restores_every_generator_exactly(ck_store: LocalStorage) -> None:
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.randn()  # a cached Gaussian in NumPy's legacy state
    numpy = NumpyRngState()
    hb = HeartbeatWriter(ck_store, "run1", 0, interval=0.05)
    hb.put(_capture(7, numpy))
    expected = (random.random(), np.random.randn(), np.random.rand(), torch.rand(3))
    assert hb.flush(10)
    hb.close()
    (stored,) = read_heartbeat(ck_store, "run1")
    assert stored.rng_packed is not None and stored.rng is None
    data, rng = heartbeat_state(stored)
    assert data == {"pos": 7} and isinstance(rng, dict)
    restore_rng(rng)
    got = (random.random(), np.random.randn(), np.random.rand(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_numpy_state_is_reused_only_while_the_generator_has_not_moved() -> None:
    np.random.seed(11)
    watch = NumpyRngState()
    first = watch.get()
    if watch.watched:  # the layout matched: the unchanged state is not re-read
        assert watch.get() is first
    np.random.rand()  # moved: a new state
    moved = watch.get()
    assert moved is not first and moved[2] != first[2]
    np.random.randn()  # one Gaussian drawn, its pair cached: has_gauss = 1
    cached = watch.get()
    assert cached[3] == 1
    np.random.randn()  # the cached one consumed: the words do not move, has_gauss does
    after = watch.get()
    assert after[3] == 0 and after is not cached
    live = np.random.get_state(legacy=True)
    assert isinstance(live, tuple)
    for got, want in zip(watch.get(), live, strict=True):
        assert np.array_equal(got, want) if isinstance(got, np.ndarray) else got == want


def test_python_state_is_reused_only_while_the_generator_has_not_moved() -> None:
    random.seed(12)
    watch = PythonRngState()
    first = watch.get()
    if watch.watched:
        assert watch.get() is first
    random.random()
    moved = watch.get()
    assert moved is not first and moved == random.getstate()
    random.gauss(0.0, 1.0)  # a second normal cached in gauss_next
    cached = watch.get()
    assert cached[2] is not None and cached == random.getstate()
    random.gauss(0.0, 1.0)  # the cached one consumed: the words do not move, gauss_next does
    after = watch.get()
    assert after[2] is None and after == random.getstate()
    random.setstate(first)
    assert watch.get() == first


def test_heartbeat_state_still_reads_the_json_rng_of_older_entries() -> None:
    from ckpt_agent.runtime.core.inline import encode_inline

    torch.manual_seed(1)
    old = Heartbeat(step=3, time=0.0, data={"pos": 3}, rng=encode_inline(capture_rng()))
    data, rng = heartbeat_state(old)
    assert data == {"pos": 3} and isinstance(rng, dict)
    cpu = rng["torch_cpu"]
    assert isinstance(cpu, torch.Tensor) and torch.equal(cpu, torch.get_rng_state())


@pytest.mark.parametrize("interval", [0.05])
def test_flush_after_close_returns(ck_store: LocalStorage, interval: float) -> None:
    hb = HeartbeatWriter(ck_store, "run1", 0, interval=interval)
    hb.close()
    hb.put(Heartbeat(step=1, time=0.0))
    assert not hb.flush(0.2)  # nobody writes after close: it says so, it does not hang


def test_the_step_records_packer_writes_the_rings_format_and_repacks_what_moved() -> None:
    numpy, python, pack = NumpyRngState(), PythonRngState(), RngPacker()

    def capture(step: int) -> HeartbeatCapture:
        return HeartbeatCapture(
            step=step, time=1.0, epoch=None, data=None, python=python.get(),
            numpy=numpy.get(), torch_cpu=torch.get_rng_state(),
        )  # fmt: skip

    random.seed(1)
    np.random.seed(2)
    for draw in (None, "torch", "python", "numpy"):
        if draw == "torch":
            torch.rand(3)
        elif draw == "python":
            random.random()
        elif draw == "numpy":
            np.random.rand()
        cap = capture(1)
        want = cap.heartbeat().rng_packed
        assert want is not None
        assert pack(cap) == want.pack(), draw  # the same bytes as the ring's record
