"""One rank write's chunks in flight: their hashes, what each task stored, back-pressure.

:class:`~ckpt_agent.persist.writer.CheckpointWriter` hashes and encodes chunks
on CPU threads and writes them on upload threads; :class:`ChunkRun` is the
state one ``write_rank`` call shares with those tasks (claims of repeated
chunks, the upload slots, the first failure) and :class:`StoredChunk` what one
task did. :func:`raw_hashes` is a chunk's identity. Torch-free, no storage I/O.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from ckpt_agent.format.chunkread import BLOCK_BYTES
from ckpt_agent.format.entries import BlobEntry
from ckpt_agent.format.layout import BLAKE3

__all__ = ["ChunkRun", "StoredChunk", "raw_hashes"]


def raw_hashes(part: memoryview) -> tuple[str, str | None]:
    """A chunk's SHA-256 (its identity) and BLAKE3 (the restore's fast check; None without
    the package), both over each block (:data:`BLOCK_BYTES`, the reader's too) while it
    is in the CPU cache."""
    sha, b3 = hashlib.sha256(), None if BLAKE3 is None else BLAKE3()
    for start in range(0, len(part), BLOCK_BYTES):
        block = part[start : start + BLOCK_BYTES]
        sha.update(block)
        if b3 is not None:
            b3.update(block)
    return sha.hexdigest(), None if b3 is None else b3.hexdigest()


@dataclass(frozen=True)
class StoredChunk:
    """What one chunk's hash/encode task did."""

    entry: BlobEntry | None
    """The blob that holds the chunk (None: the same bytes as chunk ``same_as``)."""
    same_as: int = -1
    upload: Future[tuple[bool, float]] | None = None
    """Its write: (written now — else already in storage —, seconds); None: re-used."""
    hash_s: float = 0.0
    encode_s: float = 0.0


class ChunkRun:
    """One ``CheckpointWriter.write_rank`` call's chunks in flight (its persister thread)."""

    def __init__(self, uploads_ahead: int) -> None:
        self.futures: list[Future[StoredChunk]] = []
        self.claims: dict[str, int] = {}
        """raw SHA-256 → the chunk that writes it (a repeat within the checkpoint waits)."""
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(uploads_ahead)
        """Encoded chunks handed to the upload pool and not yet written (back-pressure)."""
        self.failed = threading.Event()
        """An upload failed: submit nothing more."""
        self.done = 0
        """Chunks from the front whose task has been waited for."""
        self.error: BaseException | None = None

    def _keep(self, e: BaseException) -> None:
        self.error = self.error or e

    def wait_front(self) -> None:
        """Wait for the oldest unfinished chunk task; keep the first failure."""
        fut = self.futures[self.done]
        self.done += 1
        try:
            fut.result()
        except BaseException as e:
            self._keep(e)

    def drain(self) -> None:
        """Wait for every chunk task, then every upload (no task may outlive the call:
        they read the caller's buffers); raise the first failure."""
        while self.done < len(self.futures):
            self.wait_front()
        for fut in self.futures:
            if fut.exception() is not None:
                continue
            upload = fut.result().upload
            if upload is None:
                continue
            try:
                upload.result()
            except BaseException as e:
                self._keep(e)
        if self.error is not None:
            raise self.error
