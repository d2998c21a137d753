"""Issue #28 on both backends (filesystem and MinIO): the operator's bounded listing stops
at its bound and says so, and its chunked deletes unpublish a chunk's COMMITs in one
batched delete, then remove the folders."""

from __future__ import annotations

from typing import Any

import pytest

from ckpt_agent.format.layout import commit_key
from ckpt_agent.format.listing import ListingLimits, list_checkpoints, scan_checkpoints
from ckpt_agent.persist.housekeeping import delete_checkpoints
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.base import Storage

RUN = "garbage-run"


def _garbage(storage: Storage, n: int) -> list[str]:
    ids = [checkpoint_id(Tier.PULSE, step) for step in range(n)]
    for cid in ids:
        storage.commit(commit_key(RUN, cid), b"\x00 not a commit")
    return ids


def test_a_bounded_scan_stops_at_its_bound_on_every_backend(storage: Storage) -> None:
    _garbage(storage, 60)
    whole = scan_checkpoints(storage, RUN, include_heartbeat=False)
    assert whole.complete and whole.entries == 60 and whole.unreadable == 60
    assert {r.status for r in whole.records} == {CheckpointStatus.CORRUPTED}
    cut = scan_checkpoints(
        storage, RUN, include_heartbeat=False, limits=ListingLimits(max_entries=25)
    )
    assert not cut.complete and "25 entries (the bound)" in cut.cut
    assert cut.entries == 25 and len(cut.records) == 24  # the 25th folder was cut through
    assert [r.id for r in cut.records] == [r.id for r in whole.records[:24]]


def test_chunked_deletes_batch_the_commits_on_every_backend(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _garbage(storage, 12)
    batches: list[list[str]] = []
    real = storage.delete_many

    def spy(keys: Any) -> int:
        keys = list(keys)
        batches.append(keys)
        return real(keys)

    monkeypatch.setattr(storage, "delete_many", spy)
    delete_checkpoints(storage, RUN, ids[:10])
    assert batches[0] == [commit_key(RUN, cid) for cid in ids[:10]]  # one request on S3
    assert [r.id for r in list_checkpoints(storage, RUN, include_heartbeat=False)] == ids[10:]
