"""The checksums a flash persister records for each snapshot chunk, and checks them with
before an in-place restart (the threat model is in :mod:`ckpt_agent.flash.protocol`):
the raw SHA-256 (the chunk's content address in storage) and a fast checksum
(:func:`fast_checksum`). Torch-free."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

import numpy as np

from ckpt_agent.tuning import CHUNK_BYTES

__all__ = [
    "FAST_SCHEME",
    "HASH_CHUNK_BYTES",
    "RecordedHashes",
    "chunk_hashes",
    "fast_checksum",
    "fast_checksums",
]

#: Chunk size of the hashes a persister records (the writer's blob chunk size).
HASH_CHUNK_BYTES: Final = CHUNK_BYTES
#: The fast checksum's name in ``slot_<i>.hashes.json`` (see :func:`fast_checksum`).
FAST_SCHEME: Final = "rowsum64-4k"
_ROW_WORDS: Final = 512  # 4 KiB rows: a page, the granularity of a torn or stale region
_W1: Final = np.uint64(0x9E3779B97F4A7C15)
_W2: Final = np.uint64(0xC2B2AE3D27D4EB4F)


@dataclass(frozen=True)
class RecordedHashes:
    """What a persister recorded about a snapshot's bytes (per tensor/file, per chunk)."""

    sha256: dict[str, list[str]]
    """Raw SHA-256 of each chunk (the blobs' content addresses)."""
    fast: dict[str, list[str]] | None = None
    """:func:`fast_checksum` of each chunk (None: recorded by an older persister)."""


def chunk_hashes(data: memoryview, chunk: int = HASH_CHUNK_BYTES) -> list[str]:
    """SHA-256 of each ``chunk``-byte piece (the writer's blob chunking; one hash if empty)."""
    if len(data) == 0:
        return [hashlib.sha256(b"").hexdigest()]
    return [hashlib.sha256(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)]


def fast_checksum(data: memoryview | bytes | bytearray) -> str:
    """A fast, non-cryptographic checksum of ``data`` (32 hex digits; see the module doc).

    The bytes are read as little-endian 64-bit words in rows of 4 KiB (the
    tail zero-padded); each row's sum (mod 2^64) is weighted by two odd
    per-row weights and summed, giving two 64-bit sums. Odd weights make
    any change of a single word change both; the row weights tell rows
    (pages) apart. The length is part of the result.
    """
    n = len(data)
    words = n // 8
    full = words // _ROW_WORDS * _ROW_WORDS
    u = np.frombuffer(data, dtype="<u8", count=full)
    sums = u.reshape(-1, _ROW_WORDS).sum(axis=1, dtype=np.uint64)
    tail = bytes(data[full * 8 :])
    if tail:
        padded = tail + bytes(-len(tail) % 8)
        extra = np.frombuffer(padded, dtype="<u8").sum(dtype=np.uint64)
        sums = np.append(sums, np.uint64(extra))
    idx = np.arange(1, sums.size + 1, dtype=np.uint64)
    s1 = int((sums * (idx * _W1 | np.uint64(1))).sum(dtype=np.uint64)) if sums.size else 0
    s2 = int((sums * (idx * _W2 | np.uint64(1))).sum(dtype=np.uint64)) if sums.size else 0
    return f"{s1:016x}{s2:016x}{n:x}"


def fast_checksums(data: memoryview, chunk: int = HASH_CHUNK_BYTES) -> list[str]:
    """:func:`fast_checksum` of each ``chunk``-byte piece (one checksum if empty)."""
    if len(data) == 0:
        return [fast_checksum(b"")]
    return [fast_checksum(data[i : i + chunk]) for i in range(0, len(data), chunk)]
