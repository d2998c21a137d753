"""One rank write's chunk tasks (persist.chunk_tasks): hashes, and waiting that keeps the first failure."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future

import pytest

from ckpt_agent.format.chunkread import BLOCK_BYTES
from ckpt_agent.format.layout import BLAKE3
from ckpt_agent.persist.chunk_tasks import ChunkRun, StoredChunk, raw_hashes


def test_raw_hashes_over_blocks_equal_the_whole_chunk_hashes() -> None:
    part = bytes(range(256)) * (BLOCK_BYTES // 128 + 3)  # more than two blocks, not a multiple
    sha, b3 = raw_hashes(memoryview(part))
    assert sha == hashlib.sha256(part).hexdigest()
    if BLAKE3 is None:
        assert b3 is None
    else:
        whole = BLAKE3()
        whole.update(part)
        assert b3 == whole.hexdigest()


def _done(
    value: StoredChunk | None = None, error: BaseException | None = None
) -> Future[StoredChunk]:
    fut: Future[StoredChunk] = Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value or StoredChunk(None))
    return fut


def test_drain_waits_for_every_task_and_upload_and_raises_the_first_failure() -> None:
    run = ChunkRun(uploads_ahead=2)
    upload: Future[tuple[bool, float]] = Future()
    upload.set_exception(OSError("disk full"))
    run.futures = [
        _done(),
        _done(error=ValueError("first")),
        _done(StoredChunk(None, upload=upload)),
    ]
    with pytest.raises(ValueError, match="first"):
        run.drain()
    assert run.done == 3


def test_drain_raises_an_upload_failure() -> None:
    run = ChunkRun(uploads_ahead=1)
    upload: Future[tuple[bool, float]] = Future()
    upload.set_exception(OSError("disk full"))
    run.futures = [_done(StoredChunk(None, upload=upload))]
    with pytest.raises(OSError, match="disk full"):
        run.drain()
