"""``Checkpointer()`` over an unreadable ``catalog.sqlite`` (issue #28): a garbage file and one
locked by another process no longer stop the run with a raw sqlite error; the index is rebuilt
from the checkpoints in storage and the run resumes."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_agent.persist import catalog as catalog_mod
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer

ConfigFactory = Callable[..., AgentConfig]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _saved(cfg: AgentConfig) -> Path:
    """One committed save of step 0; the catalog's path."""
    with Checkpointer(cfg, model=_model()) as ckpt:
        ckpt.start()
        ckpt.step(0, 1.0)
        ckpt.save_now("test")
    return Path(str(cfg.work_dir)) / "catalog.sqlite"


def test_a_garbage_catalog_is_rebuilt_and_the_run_resumes(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    path = _saved(cfg)
    path.write_bytes(b"\x00garbage" * 512)
    with Checkpointer(cfg, model=_model()) as ckpt:
        assert ckpt.start().step == 1
        rows = ckpt._engine.catalog.records("run1")  # rebuilt from storage
        assert [r.step for r in rows if r.tier.value != "heartbeat"] == [0]
    assert len(list(path.parent.glob("catalog.sqlite.corrupt-*"))) == 1


def test_a_locked_catalog_gives_a_private_index_and_the_run_resumes(
    ck_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = ck_config()
    path = _saved(cfg)
    path.unlink()
    for extra in ("catalog.sqlite-wal", "catalog.sqlite-shm"):
        (path.parent / extra).unlink(missing_ok=True)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("CREATE TABLE x (y)")
    holder.execute("BEGIN EXCLUSIVE")
    monkeypatch.setattr(catalog_mod, "OPEN_WAIT_S", 0.2)
    try:
        with Checkpointer(cfg, model=_model()) as ckpt:
            assert ckpt.start().step == 1
            assert ckpt._engine.catalog.private
    finally:
        holder.close()
