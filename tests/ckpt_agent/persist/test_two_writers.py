"""Two writers on one run id (a zombie pod and the restarted job, or two jobs given the
same run id), 20 seeded interleavings each, on the filesystem and on MinIO: every
checkpoint acknowledged to the writer that holds the run survives and verifies, the
fenced writer stops with FencedError, and it deletes nothing the holder committed.

The interleavings are one storage operation at a time (``two_writers.Lockstep``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.errors import FencedError
from ckpt_agent.storage.base import Storage
from ckpt_agent.storage.fs import LocalStorage
from tests.ckpt_agent.persist.two_writers import scenario, surviving_problems
from tests.ckpt_agent.storage.conftest import make_s3, minio  # noqa: F401 - fixtures

SEEDS = range(20)


@pytest.fixture(params=["fs", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A factory of fresh, empty stores of one backend (MinIO: one server, a prefix each)."""
    if request.param == "fs":
        yield lambda seed: LocalStorage(tmp_path / f"root-{seed}")
    else:
        make = request.getfixturevalue("make_s3")
        yield lambda seed: make()


def _check(store: Storage, seed: int, *, same_steps: bool) -> None:
    zombie, holder, world = scenario(store, seed, same_steps=same_steps)
    assert holder.error is None, holder.error
    assert holder.generation == zombie.generation + 1
    assert isinstance(zombie.error, FencedError), zombie.error
    assert f"generation {holder.generation}" in str(zombie.error)
    assert world.violations == [], f"seed {seed}: the zombie deleted {world.violations[:5]}"
    assert surviving_problems(store, holder) == [], f"seed {seed}"
    assert holder.acked  # the holder saved, and its newest checkpoints are there


@pytest.mark.parametrize("same_steps", [True, False], ids=["same-steps", "disjoint-steps"])
def test_two_writers_on_one_run(backend: Any, same_steps: bool) -> None:
    for seed in SEEDS:
        store = backend(seed)
        try:
            _check(store, seed, same_steps=same_steps)
        finally:
            store.close()
