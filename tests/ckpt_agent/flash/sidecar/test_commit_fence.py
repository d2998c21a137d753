"""The sidecar that commits for rank 0 claims the run's writer generation at its first
commit, once, and hands it to the writer and the finalize pipeline."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from ckpt_agent.flash.sidecar.commit import Coordinator
from ckpt_agent.format.fence import generations
from ckpt_agent.storage.fs import LocalStorage


def test_the_coordinator_claims_once_and_arms_writer_and_finalizer(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "store")
    parts = SimpleNamespace(
        storage=store, writer=SimpleNamespace(fence=None), finalizer=SimpleNamespace(fence=None)
    )
    coord = Coordinator(
        "run1", cast(Any, parts), cast(Any, None), cast(Any, None), commit_timeout_s=1
    )
    coord._hold()
    coord._hold()
    assert generations(store, "run1") == [1]
    assert parts.writer.fence is parts.finalizer.fence
    assert parts.writer.fence.generation == 1
