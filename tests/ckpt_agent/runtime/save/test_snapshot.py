"""Snapshots (reusable buffers, isolation from later training) and the background workers."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.save.snapshot import (
    BackgroundWorker,
    HostArena,
    take_snapshot,
)
from ckpt_agent.tuning import DIRECT_IO_ALIGN


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _t(x: object) -> torch.Tensor:
    assert isinstance(x, torch.Tensor)
    return x


def test_snapshot_is_not_changed_by_later_training() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    arena = HostArena()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = model[0]
    assert isinstance(first, torch.nn.Linear)
    momentum = opt.state[first.weight]["momentum_buffer"].clone()
    snap = take_snapshot(
        1, Tier.PULSE, {"model": model.state_dict(), "optimizer": opt.state_dict()}, arena
    )
    # training goes on: in-place updates of parameters and optimizer state
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    items = {i.name: _t(i.buffer) for i in snap.items}
    for k, v in before.items():
        assert torch.equal(items[f"model/{k}"], v)
    assert torch.equal(items["optimizer/state/0/momentum_buffer"], momentum)
    # the JSON part is a fresh structure, not a view of the live param_groups
    opt.param_groups[0]["lr"] = 123.0
    assert snap.tree["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert snap.stall_s > 0
    assert snap.nbytes == sum(
        _t(i.buffer).numel() * _t(i.buffer).element_size() for i in snap.items
    )


def test_buffers_are_preallocated_once_and_reused() -> None:
    model = _model()
    arena = HostArena()
    s1 = take_snapshot(1, Tier.PULSE, {"model": model.state_dict()}, arena)
    n = arena.allocations
    ptrs = {i.name: i.buffer.data_ptr() for i in s1.items if isinstance(i.buffer, torch.Tensor)}
    s2 = take_snapshot(2, Tier.PULSE, {"model": model.state_dict()}, arena)
    assert arena.allocations == n == 4
    assert {
        i.name: i.buffer.data_ptr() for i in s2.items if isinstance(i.buffer, torch.Tensor)
    } == ptrs
    # a changed shape reallocates just that buffer
    take_snapshot(3, Tier.PULSE, {"model": {**model.state_dict(), "0.bias": torch.zeros(9)}}, arena)
    assert arena.allocations == n + 1


def test_numpy_arrays_are_copied_too() -> None:
    a = np.arange(5.0)
    snap = take_snapshot(1, Tier.PULSE, {"data": {"a": a}}, HostArena())
    a[:] = -1
    assert np.array_equal(snap.items[0].buffer, np.arange(5.0))


def test_approximate_filter_keeps_small_changes_stale_and_says_so() -> None:
    state = {"exp_avg": torch.ones(10), "weight": torch.ones(10)}
    arena = HostArena()
    first = take_snapshot(
        1, Tier.PULSE, {"optimizer": {"state": {0: state}}}, arena, approx_threshold=1e-3
    )
    assert not first.approximate  # the first copy is always taken
    state["exp_avg"] += 1e-5
    state["weight"] += 1e-5
    second = take_snapshot(
        2, Tier.PULSE, {"optimizer": {"state": {0: state}}}, arena, approx_threshold=1e-3
    )
    assert second.approximate
    items = {i.name: i for i in second.items}
    assert items["optimizer/state/0/exp_avg"].stale
    assert torch.equal(_t(items["optimizer/state/0/exp_avg"].buffer), torch.ones(10))
    assert not items["optimizer/state/0/weight"].stale  # only momentum-like buffers are filtered
    state["exp_avg"] += 1.0
    third = take_snapshot(
        3, Tier.PULSE, {"optimizer": {"state": {0: state}}}, arena, approx_threshold=1e-3
    )
    assert not third.approximate
    exact = take_snapshot(4, Tier.PULSE, {"optimizer": {"state": {0: state}}}, HostArena())
    assert not exact.approximate


# --------------------------------------------------------------------------- workers


def test_worker_reports_an_error_exactly_once() -> None:
    seen: list[int] = []

    def handler(job: int) -> None:
        if job == 2:
            raise OSError("disk on fire")
        seen.append(job)

    w: BackgroundWorker[int] = BackgroundWorker(
        "t", handler, capacity=3, describe=lambda j: f"job {j}"
    )
    for j in (1, 2, 3):
        assert w.submit(j)
    assert w.wait_idle(10)
    errs = w.take_errors()
    assert [(e.what, str(e.error)) for e in errs] == [("job 2", "disk on fire")]
    assert w.take_errors() == []
    assert seen == [1, 3]
    assert w.close(5)
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(4)


def test_worker_capacity_is_back_pressure() -> None:
    gate = threading.Event()

    def block(job: int) -> None:
        gate.wait(10)

    w: BackgroundWorker[int] = BackgroundWorker("t", block, capacity=1)
    assert w.submit(1)
    assert w.busy
    assert not w.submit(2)  # full: the caller decides (defer or wait)
    assert not w.wait_idle(0.05)
    gate.set()
    assert w.wait_idle(10)
    assert w.submit(3)
    w.close(5)


def test_large_host_buffers_are_page_aligned_for_direct_writes() -> None:
    """Their chunks can go to disk with O_DIRECT (no page-cache copy); small ones are not
    padded."""
    big = torch.randn(600, 1000)  # 2.4 MB
    small = torch.randn(10)
    arr = np.arange(300_000, dtype=np.float64)  # 2.4 MB NumPy state
    snap = take_snapshot(
        1, Tier.PULSE, {"model": {"big": big, "small": small}, "extra": {"a": arr}}, HostArena()
    )
    items = {i.name: i for i in snap.items}
    big_buf, arr_buf = items["model/big"].buffer, items["extra/a"].buffer
    assert isinstance(big_buf, torch.Tensor) and isinstance(arr_buf, np.ndarray)
    assert big_buf.data_ptr() % DIRECT_IO_ALIGN == 0 and torch.equal(big_buf, big)
    assert arr_buf.ctypes.data % DIRECT_IO_ALIGN == 0 and np.array_equal(arr_buf, arr)
    assert big_buf.is_contiguous() and arr_buf.flags.c_contiguous
    src = items["model/big"].source()
    assert len(src.data) == big.numel() * 4 and bytes(src.data) == big.numpy().tobytes()
    small_buf = items["model/small"].buffer
    assert isinstance(small_buf, torch.Tensor)
    assert small_buf.untyped_storage().nbytes() == 40  # no padding below the threshold
