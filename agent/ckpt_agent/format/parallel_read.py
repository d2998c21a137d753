"""Many tensors at once: their chunks read, decoded and verified concurrently, in place.

:func:`read_into` is the restore path's reader. Every chunk of every target
is one task on a small thread pool (one worker per usable CPU, at most
:data:`RESTORE_WORKERS_MAX`; SHA-256, zstd and the numpy unshuffle release
the GIL); each task reads its blob straight into its slice of the target's
buffer and verifies it there (:func:`~ckpt_agent.format.chunkread.read_chunk`).
A tensor of many chunks is read by all workers, not one.

Memory beyond the targets: the chunks in flight, at most one per worker
(the storage's views of them, and a scratch of one chunk per worker for
shuffled blobs). No ``bytes`` object per tensor or chunk.

Nothing is used before it is verified: the caller's buffers are fresh
(staging), and :func:`read_into` returns only when every chunk has been
verified; on the first failure no further chunk is started, the running
ones finish and the error is raised (the buffers are then the caller's to
drop). Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Final

from ckpt_agent.background import usable_cpus
from ckpt_agent.format.chunkread import Scratch, check_inline, read_chunk
from ckpt_agent.format.codec import PY_SHUFFLER, Shuffler
from ckpt_agent.format.entries import BlobEntry, TensorEntry
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.storage.base import Storage

__all__ = ["RESTORE_WORKERS_MAX", "Target", "read_into", "restore_workers"]

#: Most reader threads (beyond a few, one local disk or the memory bus is the limit).
RESTORE_WORKERS_MAX: Final = 8


@dataclass(frozen=True)
class Target:
    """One tensor to read: its manifest entry and the buffer of ``entry.nbytes`` it goes to."""

    name: str
    entry: TensorEntry
    out: memoryview


@dataclass(frozen=True)
class _Task:
    blob: BlobEntry
    what: str
    part: memoryview


def restore_workers() -> int:
    """Reader threads for this process: the CPUs it may run on (affinity and cgroup quota,
    :func:`~ckpt_agent.background.usable_cpus`), at most the maximum."""
    return max(1, min(RESTORE_WORKERS_MAX, usable_cpus()))


def _tasks(manifest: RankManifest, targets: Sequence[Target]) -> list[_Task]:
    """The chunks of every target (inline ones are checked and copied here)."""
    tasks: list[_Task] = []
    for t in targets:
        what = f"{manifest.checkpoint_id}: {t.name!r}"
        if len(t.out) != t.entry.nbytes:
            raise ValueError(
                f"{what}: output buffer has {len(t.out)} bytes, tensor {t.entry.nbytes}"
            )
        if t.entry.inline is not None:
            check_inline(t.entry, what)
            t.out[:] = t.entry.inline
            continue
        offset = 0
        for digest in t.entry.chunks:  # the manifest checked that they add up to nbytes
            blob = manifest.blobs[digest]
            tasks.append(_Task(blob, what, t.out[offset : offset + blob.raw_size]))
            offset += blob.raw_size
    return tasks


def read_into(
    storage: Storage,
    run_id: str,
    manifest: RankManifest,
    targets: Sequence[Target],
    *,
    shuffler: Shuffler = PY_SHUFFLER,
    workers: int | None = None,
) -> None:
    """Read, decode and verify every target's chunks into its ``out``, concurrently.

    Raises the first chunk's :class:`~ckpt_agent.errors.IntegrityError` (in
    the targets' order) once the chunks already running have finished.
    """
    tasks = _tasks(manifest, targets)
    n = min(workers if workers is not None else restore_workers(), len(tasks))
    if n <= 1:
        scratch = Scratch()
        for task in tasks:
            read_chunk(storage, run_id, task.blob, task.what, task.part, shuffler, scratch)
        return
    local = threading.local()

    def one(task: _Task) -> None:
        scratch: Scratch | None = getattr(local, "scratch", None)
        if scratch is None:
            scratch = local.scratch = Scratch()
        read_chunk(storage, run_id, task.blob, task.what, task.part, shuffler, scratch)

    failed: Future[None] | None = None
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="ckpt-read") as pool:
        futures = [pool.submit(one, task) for task in tasks]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()  # not started: never started; running: finish (the pool waits)
    if failed is not None:
        err = failed.exception()
        assert err is not None
        raise err
