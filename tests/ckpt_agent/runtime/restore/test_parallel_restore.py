"""Restore through the parallel, in-place reader: bit-exact, nothing applied before verified.

``Checkpointer.start()`` → :class:`~ckpt_agent.runtime.restore.restorer.Restorer` →
:func:`~ckpt_agent.runtime.core.serialization.load_tensors` →
:func:`~ckpt_agent.format.parallel_read.read_into`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ckpt_agent import tuning
from ckpt_agent.errors import ResumeError, ResumeStorageError, RetryableStorageError
from ckpt_agent.format.layout import blob_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.policy import AgentConfig
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.storage.fs import LocalStorage

ConfigFactory = Callable[..., AgentConfig]
RUN = "run1"


class Mixed:
    """fp32 and bf16 layers, an int64 buffer, AdamW (its state in each parameter's dtype)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 512),
            torch.nn.Linear(512, 256).to(torch.bfloat16),
            torch.nn.Linear(256, 300),
        )
        self.model.register_buffer("counts", torch.randint(0, 1 << 40, (1000,)))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.calls: list[str] = []
        for name, obj in (("model", self.model), ("optimizer", self.opt)):
            self._spy(name, obj)

    def _spy(self, name: str, obj: Any) -> None:
        real = obj.load_state_dict

        def spy(*args: Any, **kw: Any) -> Any:
            self.calls.append(name)
            return real(*args, **kw)

        object.__setattr__(obj, "load_state_dict", spy)

    def step(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def checkpointer(self, cfg: AgentConfig) -> Checkpointer:
        return Checkpointer(cfg, model=self.model, optimizer=self.opt)

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, st in self.opt.state_dict()["state"].items():
            out.update({f"opt/{i}/{k}": v.clone() for k, v in st.items()})
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(_bits(got[k]), _bits(v)), k


def _saves(cfg: AgentConfig, steps: tuple[int, ...]) -> tuple[list[str], list[dict[str, Any]]]:
    """One save after each count of train steps: the ids and the states saved."""
    t = Mixed(seed=0)
    ckpt = t.checkpointer(cfg)
    ckpt.start()
    ids, states = [], []
    done = 0
    for n in steps:
        for s in range(done, n):
            t.step()
            ckpt.step(s, 1.0)
        done = n
        cid = ckpt.save_now("test")
        assert cid is not None
        ids.append(cid)
        states.append(t.state())
    ckpt.wait(60)
    ckpt.close()
    return ids, states


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_restore_is_bit_exact_for_every_dtype(ck_config: ConfigFactory, codec: str) -> None:
    cfg = ck_config(compression={"codec": codec, "byteShuffle": True, "minSizeBytes": 0})
    (cid,), (saved,) = _saves(cfg, (3,))
    _, m = read_checkpoint(LocalStorage(cfg.storage_url.removeprefix("file://")), RUN, cid)
    assert {e.dtype for e in m.tensors.values()} >= {"float32", "bfloat16", "int64"}
    if codec == "zstd":
        assert {b.codec.shuffle for b in m.blobs.values() if b.codec.codec == "zstd"} >= {2, 4}
    fresh = Mixed(seed=1)
    point = fresh.checkpointer(cfg).start()
    assert point.checkpoint_id == cid
    _assert_same(fresh.state(), saved)


def test_a_corrupted_chunk_is_found_before_anything_is_loaded(ck_config: ConfigFactory) -> None:
    """The newest checkpoint's last chunk is flipped: the parallel restore refuses it before
    any live object is touched, marks it corrupted and falls back to the older one; with no
    older one the start fails and the model is exactly as it was."""
    cfg = ck_config(compression={"codec": "zstd"})
    (first, second), (state_first, _) = _saves(cfg, (2, 4))
    store = LocalStorage(cfg.storage_url.removeprefix("file://"))
    _, m = read_checkpoint(store, RUN, second)
    older = {d for e in read_checkpoint(store, RUN, first)[1].tensors.values() for d in e.chunks}
    digest = next(d for e in reversed(list(m.tensors.values())) for d in e.chunks if d not in older)
    path = store.root / blob_key(RUN, digest)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))

    fresh = Mixed(seed=1)
    point = fresh.checkpointer(cfg).start()
    assert point.checkpoint_id == first
    assert second in dict(point.rejected) and "corrupted bytes" in dict(point.rejected)[second]
    assert fresh.calls == ["model", "optimizer"]  # once, for the older checkpoint only
    _assert_same(fresh.state(), state_first)
    statuses = {r.id: r.status for r in list_checkpoints(store, RUN)}
    assert statuses[second] == CheckpointStatus.CORRUPTED

    store.delete(blob_key(RUN, next(iter(older))))  # now the older one is unusable too
    alone = Mixed(seed=2)
    before = alone.state()
    with pytest.raises(ResumeError, match=r"could be restored|none is usable"):
        alone.checkpointer(cfg).start()
    assert alone.calls == []
    _assert_same(alone.state(), before)


class FlakyReads(LocalStorage):
    """Reads of blobs fail with a transient EIO ``failures`` times (then, or never, work)."""

    def __init__(self, root: Any, failures: int) -> None:
        super().__init__(root)
        self.failures = failures

    def _maybe_fail(self, key: str) -> None:
        if "/blobs/" in key and self.failures > 0:
            self.failures -= 1
            raise RetryableStorageError(f"injected: Input/output error reading {key}")

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        self._maybe_fail(key)
        return super().read(key, start, length)

    def read_view(self, key: str) -> contextlib.AbstractContextManager[memoryview]:
        self._maybe_fail(key)
        return super().read_view(key)

    def read_into(self, key: str, out: memoryview, *args: Any, **kw: Any) -> int:
        self._maybe_fail(key)
        return super().read_into(key, out, *args, **kw)


class EveryBlobOnce(LocalStorage):
    """The first read of every blob fails with a transient EIO."""

    def __init__(self, root: Any) -> None:
        super().__init__(root)
        self.failed: set[str] = set()

    def _first_fails(self, key: str) -> None:
        if "/blobs/" in key and key not in self.failed:
            self.failed.add(key)
            raise RetryableStorageError(f"injected: Input/output error reading {key}")

    def read_view(self, key: str) -> contextlib.AbstractContextManager[memoryview]:
        self._first_fails(key)
        return super().read_view(key)

    def read_into(self, key: str, out: memoryview, *args: Any, **kw: Any) -> int:
        self._first_fails(key)
        return super().read_into(key, out, *args, **kw)


def _restart_on(cfg: AgentConfig, store: LocalStorage) -> tuple[Mixed, Checkpointer]:
    fresh = Mixed(seed=1)
    return fresh, Checkpointer(cfg, model=fresh.model, optimizer=fresh.opt, storage=store)


def test_a_transient_read_error_is_retried_and_marks_nothing(
    ck_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "RESTORE_READ_BACKOFF_S", 0.0)
    cfg = ck_config()
    (first, second), (_, state_second) = _saves(cfg, (2, 4))
    store = FlakyReads(cfg.storage_url.removeprefix("file://"), failures=1)
    fresh, ckpt = _restart_on(cfg, store)
    point = ckpt.start()
    assert store.failures == 0  # the EIO happened, and the re-read worked
    assert point.checkpoint_id == second and not dict(point.rejected)
    _assert_same(fresh.state(), state_second)
    ckpt.close()
    statuses = {r.id: r.status for r in list_checkpoints(store, RUN)}
    assert statuses[second] == CheckpointStatus.VALID and statuses[first] == CheckpointStatus.VALID


def test_every_chunk_is_re_read_after_a_transient_error(
    ck_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each blob's first read fails: the chunk reads retry, so one start succeeds."""
    monkeypatch.setattr(tuning, "CHUNK_READ_BACKOFF_S", 0.0)
    cfg = ck_config()
    (_, second), (_, state_second) = _saves(cfg, (2, 4))
    store = EveryBlobOnce(cfg.storage_url.removeprefix("file://"))
    fresh, ckpt = _restart_on(cfg, store)
    assert ckpt.start().checkpoint_id == second
    assert len(store.failed) > 3  # more blobs failed once than the restorer's attempts
    _assert_same(fresh.state(), state_second)
    ckpt.close()


def test_a_storage_that_keeps_failing_fails_the_start_without_a_rewind(
    ck_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never a good checkpoint marked corrupted for an EIO, never an older one chosen."""
    monkeypatch.setattr(tuning, "RESTORE_READ_BACKOFF_S", 0.0)
    monkeypatch.setattr(tuning, "CHUNK_READ_BACKOFF_S", 0.0)
    cfg = ck_config()
    (first, second), _ = _saves(cfg, (2, 4))
    store = FlakyReads(cfg.storage_url.removeprefix("file://"), failures=10**6)
    fresh, ckpt = _restart_on(cfg, store)
    before = fresh.state()
    with pytest.raises(ResumeStorageError, match=r"kept failing while .*nothing was marked"):
        ckpt.start()
    assert fresh.calls == []
    _assert_same(fresh.state(), before)
    statuses = {r.id: r.status for r in list_checkpoints(store, RUN)}
    assert statuses[first] == statuses[second] == CheckpointStatus.VALID


def test_the_restore_read_knobs_take_effect_when_overridden(
    ck_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``tuning.RESTORE_READ_*`` are read when a candidate is read, not copied at import: a
    test's (or an operator's) override is what the restorer uses."""
    monkeypatch.setattr(tuning, "RESTORE_READ_ATTEMPTS", 2)
    monkeypatch.setattr(tuning, "RESTORE_READ_BACKOFF_S", 0.0625)
    monkeypatch.setattr(tuning, "CHUNK_READ_BACKOFF_S", 0.0)
    cfg = ck_config()
    _saves(cfg, (2,))
    store = FlakyReads(cfg.storage_url.removeprefix("file://"), failures=10**6)
    _, ckpt = _restart_on(cfg, store)
    with caplog.at_level(logging.WARNING, logger="ckpt_agent.runtime.restore.loading"):
        with pytest.raises(ResumeStorageError, match=r"\(2 attempts; last"):
            ckpt.start()
    delays = [r.args[2] for r in caplog.records if "retrying in" in r.msg and r.args]
    assert delays == [0.0625]
