"""The CUDA paths that run without a GPU here: which devices a snapshot waits for, which
host buffers are pinned, and the CUDA RNG capture/restore logic (torch.cuda faked)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_agent.runtime.core.devices import cuda_devices, synchronize_copies
from ckpt_agent.runtime.core.serialization import LiveArray, capture_rng, restore_rng
from ckpt_agent.runtime.save import snapshot


class OnGpu(torch.Tensor):
    """A CPU tensor that says it lives on a GPU (what the code under test looks at)."""

    gpu = torch.device("cuda:0")

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.gpu


def on_gpu(index: int, n: int = 4) -> torch.Tensor:
    t = torch.zeros(n).as_subclass(OnGpu)
    assert isinstance(t, OnGpu)
    t.gpu = torch.device("cuda", index)
    return t


def test_a_snapshot_waits_for_every_device_it_copied_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.synchronize()`` waits for the current device only: a state on two GPUs
    needs both waited for, each once."""
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    on0, on1, again = on_gpu(0), on_gpu(1), on_gpu(1, 2)
    values: list[object] = [on1, on0, again, torch.zeros(3), 5, None]
    assert cuda_devices(values) == {torch.device("cuda:0"), torch.device("cuda:1")}
    synchronize_copies(values)
    assert synced == [torch.device("cuda:0"), torch.device("cuda:1")]
    synced.clear()
    synchronize_copies([torch.zeros(3)])  # CPU only: nothing to wait for (no CUDA call)
    assert synced == []


def test_host_buffers_are_pinned_exactly_for_gpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    real_empty = torch.empty

    def empty(*shape: Any, **kw: Any) -> torch.Tensor:
        asked.append(bool(kw.pop("pin_memory", False)))
        return real_empty(*shape, **kw)

    gpu = on_gpu(0, 6)
    monkeypatch.setattr(torch, "empty", empty)
    arena = snapshot.HostArena()
    arena._buffer(LiveArray("model/w", gpu))
    arena._buffer(LiveArray("model/b", torch.zeros(3)))
    assert asked == [True, False]


def test_large_pinned_buffers_are_not_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned memory is page-aligned as allocated; padding it for O_DIRECT alignment would
    make CUDA's host allocator (sizes rounded up to a power of two) pin twice the state."""
    sizes: list[tuple[int, bool]] = []
    real_empty = torch.empty

    def empty(*shape: Any, **kw: Any) -> torch.Tensor:
        pin = bool(kw.pop("pin_memory", False))
        t = real_empty(*shape, **kw)
        sizes.append((t.numel() * t.element_size(), pin))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    n = 1 << 20  # 4 MiB of float32: over the O_DIRECT threshold
    arena = snapshot.HostArena()
    arena._buffer(LiveArray("model/w", on_gpu(0, n)))
    cpu, _ = arena._buffer(LiveArray("model/v", torch.zeros(n)))
    assert sizes == [(4 * n, True)]  # exactly the state: pinned, unpadded
    assert isinstance(cpu, torch.Tensor) and cpu.data_ptr() % 4096 == 0  # pageable: aligned


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, states: list[torch.Tensor]) -> list[Any]:
    """torch.cuda as a process with ``len(states)`` devices holding these generator states."""
    cuda = torch.cuda
    set_calls: list[Any] = []
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: len(states))
    monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(cuda, "set_rng_state_all", lambda new: set_calls.append(list(new)))
    return set_calls


def test_cuda_rng_states_round_trip_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    states = [torch.randint(0, 256, (16,), dtype=torch.uint8, generator=gen) for _ in range(2)]
    set_calls = _fake_cuda(monkeypatch, states)
    saved = capture_rng()
    cuda = saved["cuda"]
    assert isinstance(cuda, list)
    assert [torch.equal(a, b) for a, b in zip(cuda, states, strict=True)] == [True, True]
    assert restore_rng(saved) == []
    [restored] = set_calls
    assert all(torch.equal(a, b) for a, b in zip(restored, states, strict=True))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(restored, cuda, strict=True))


def test_cuda_rng_of_another_device_count_is_a_warning_or_strict_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    states = [torch.zeros(16, dtype=torch.uint8)] * 2
    set_calls = _fake_cuda(monkeypatch, states)
    saved = capture_rng()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    warnings = restore_rng(saved)
    assert set_calls == [] and "2 CUDA RNG state(s)" in warnings[0]
    with pytest.raises(RuntimeError, match="CUDA RNG not restored"):
        restore_rng(saved, strict_cuda=True)


def test_uninitialized_cuda_is_not_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA context yet (a CPU-only run on a GPU node): capturing must not create one."""
    _fake_cuda(monkeypatch, [torch.zeros(16, dtype=torch.uint8)])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert "cuda" not in capture_rng()
