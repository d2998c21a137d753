"""Fixtures for the checkpoint-engine tests (names start with ``ck_`` to stay out of the way)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.policy import AgentConfig
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_mnist_like.py"


@pytest.fixture
def ck_store(tmp_path: Path) -> LocalStorage:
    """A local store without per-blob fsync (commits still fsync)."""
    return LocalStorage(tmp_path / "store", StorageOptions(fsync=False))


def make_config(tmp_path: Path, **overrides: Any) -> AgentConfig:
    """A small, fast agent config (camelCase dict overrides, merged one level deep)."""
    data: dict[str, Any] = {
        "runId": "run1",
        "storageUrl": (tmp_path / "store").as_uri(),
        "workDir": str(tmp_path / "work"),
        "tiers": {
            "heartbeat": {"everySteps": 1},
            "pulse": {"baseInterval": 5, "minInterval": 2, "maxInterval": 8},
            "full": {"everySteps": 1000},
        },
        "scheduler": {"risk": {"enabled": False}},
        "validation": {"loadInSubprocess": False},
        "retention": {"routineKeep": 3, "importantKeep": 3},
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            merged = dict(data[k])
            merged.update(v)
            data[k] = merged
        else:
            data[k] = v
    return AgentConfig.model_validate(data)


@pytest.fixture(scope="session")
def ck_make_config() -> Callable[..., AgentConfig]:
    """``make_config(root, **overrides)``, for session-scoped fixtures with their own root."""
    return make_config


@pytest.fixture
def ck_config(tmp_path: Path) -> Callable[..., AgentConfig]:
    def factory(**overrides: Any) -> AgentConfig:
        return make_config(tmp_path, **overrides)

    return factory


@pytest.fixture
def ck_config_file(tmp_path: Path) -> Callable[..., Path]:
    """Write a config (as the operator mounts it) and return its path."""

    def factory(
        name: str = "ckpt-config.json", *, root: Path | None = None, **overrides: Any
    ) -> Path:
        cfg = make_config(root or tmp_path, **overrides)
        path = tmp_path / name
        path.write_text(json.dumps(cfg.to_wire()))
        return path

    return factory


@pytest.fixture
def ck_example() -> Path:
    """The example training script."""
    return EXAMPLE
