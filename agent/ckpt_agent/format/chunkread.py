"""One chunk of a tensor: read from storage straight into its destination, verified there.

The restore side of :mod:`ckpt_agent.format.codec`, without intermediate
buffers: a ``none`` blob is copied from the storage's view into the
destination block by block, each block hashed while it is in the cache; a
``zstd`` blob is decompressed into the destination (or, when the bytes were
shuffled, into a per-worker :class:`Scratch` of one chunk and unshuffled into
the destination). Then the destination's hash is compared with the raw hash
the manifest records: its BLAKE3 where the writer recorded one (:func:`raw_check`;
a cryptographic hash like SHA-256, about three times faster on one core), else
its SHA-256. SHA-256 stays the blob's name (its content address).

What is verified is what is used: the hash is taken of the destination's
bytes after the last write into it, so a blob changed while it is read (a
torn or concurrent write, a mapping whose file is replaced) cannot slip
unverified bytes in. The stored bytes of a compressed blob are not hashed
again on this path (the raw hash over the decoded bytes decides; the
validator checks that every blob hashes to its name); they are hashed when a
chunk fails, to say whether the blob itself is corrupted. See
``docs/security.md`` (integrity) for the threat model.

Torch-free and numpy-free (the operator imports :mod:`ckpt_agent.format.readers`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Final

import zstandard

from ckpt_agent import tuning
from ckpt_agent.errors import CodecError, IntegrityError, NotFoundError, RetryableStorageError
from ckpt_agent.format.codec import CODEC_NONE, CodecSpec, Shuffler, check_zstd_frame
from ckpt_agent.format.entries import BlobEntry, TensorEntry
from ckpt_agent.format.layout import BLAKE3, Hasher, blob_key, sha256_hex
from ckpt_agent.storage.base import Storage

__all__ = [
    "BLOCK_BYTES",
    "Scratch",
    "check_inline",
    "copy_hashed",
    "decode_into",
    "raw_check",
    "read_chunk",
]

#: Copy-and-hash granularity: a block is hashed while it is still in the CPU cache.
BLOCK_BYTES: Final = 1 << 20


class Scratch:
    """One reusable buffer of at most a chunk (one per worker thread), grown on demand."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def get(self, n: int) -> memoryview:
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return memoryview(self._buf)[:n]


HashFactory = Callable[[], Hasher]


def raw_check(blob: BlobEntry) -> tuple[HashFactory, str]:
    """How a chunk's decoded bytes are checked: (new hasher, expected hex digest). BLAKE3
    where the manifest records it and the ``blake3`` package is here, else SHA-256."""
    if blob.raw_blake3 is not None and BLAKE3 is not None:
        return BLAKE3, blob.raw_blake3
    return hashlib.sha256, blob.raw_sha256


def copy_hashed(src: memoryview, out: memoryview, new: HashFactory = hashlib.sha256) -> str:
    """Copy ``src`` into ``out`` (same length) and return the hash (``new``, SHA-256 by
    default) of ``out``'s bytes."""
    h = new()
    for start in range(0, len(out), BLOCK_BYTES):
        block = out[start : start + BLOCK_BYTES]
        block[:] = src[start : start + BLOCK_BYTES]
        h.update(block)  # releases the GIL: other workers copy meanwhile
    return h.hexdigest()


def _decompress_into(stored: memoryview, dest: memoryview) -> None:
    """Decompress one zstd frame into exactly ``dest``; refuse a frame holding more or less."""
    got = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(stored) as reader:
            while got < len(dest):
                n = reader.readinto(dest[got:])
                if not n:
                    break
                got += n
            more = reader.read(1)
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt zstd data: {e}") from None
    if got != len(dest) or more:
        have = f"{got}" if not more else f"more than {len(dest)}"
        raise CodecError(f"decompressed {have} bytes, manifest says {len(dest)}")


def decode_into(
    stored: memoryview,
    spec: CodecSpec,
    out: memoryview,
    shuffler: Shuffler,
    scratch: Scratch,
    new: HashFactory = hashlib.sha256,
) -> str:
    """Decode ``stored`` into ``out`` (the raw size) and return the hash (``new``, SHA-256
    by default) of ``out``.

    Raises :class:`CodecError` for a malformed frame or a size mismatch; never
    writes past ``out`` (nor past one chunk of ``scratch``).
    """
    raw_size = len(out)
    view = stored.cast("B") if stored.format != "B" else stored
    if spec.codec == CODEC_NONE:
        if len(view) != raw_size:
            raise CodecError(f"stored size {len(view)} != declared raw size {raw_size}")
        return copy_hashed(view, out, new)
    check_zstd_frame(view, raw_size)
    shuffled = bool(spec.shuffle) and raw_size >= spec.shuffle
    dest = scratch.get(raw_size) if shuffled else out
    _decompress_into(view, dest)
    if shuffled:
        shuffler.unshuffle(dest, spec.shuffle, out)
    h = new()
    h.update(out)
    return h.hexdigest()


def read_chunk(
    storage: Storage,
    run_id: str,
    blob: BlobEntry,
    what: str,
    part: memoryview,
    shuffler: Shuffler,
    scratch: Scratch,
    *,
    check_stored: bool = False,
) -> None:
    """Read ``blob`` into ``part`` (its raw size) and verify ``part``'s bytes.

    With ``check_stored`` an encoded blob's stored bytes are first checked against
    its name (the validator's check); without, only on failure, to name the fault. An
    uncompressed blob's stored bytes are its raw bytes: one check proves both.
    Raises :class:`IntegrityError`. A retryable storage error is retried
    (:data:`~ckpt_agent.tuning.CHUNK_READ_ATTEMPTS`) before it is raised.
    """
    for attempt in range(1, tuning.CHUNK_READ_ATTEMPTS + 1):
        try:
            _read_chunk(storage, run_id, blob, part, what, shuffler, scratch, check_stored)
            return
        except RetryableStorageError:  # an EIO, a reset: the bytes may be fine, read again
            if attempt == tuning.CHUNK_READ_ATTEMPTS:
                raise
            time.sleep(tuning.CHUNK_READ_BACKOFF_S * 2 ** (attempt - 1))


def _read_chunk(
    storage: Storage,
    run_id: str,
    blob: BlobEntry,
    part: memoryview,
    what: str,
    shuffler: Shuffler,
    scratch: Scratch,
    check_stored: bool,
) -> None:
    digest = blob.digest
    new, expected = raw_check(blob)
    check = (new, expected)
    if blob.codec.codec == CODEC_NONE:
        problem, got = _read_raw(storage, run_id, blob, part, check)
    else:
        problem, got = _read_encoded(
            storage, run_id, blob, part, shuffler, scratch, check, check_stored
        )
    if problem:
        raise IntegrityError(f"{what}: blob {digest[:16]}… {problem}")
    if got != expected:
        raise IntegrityError(f"{what}: blob {digest[:16]}… decodes to the wrong bytes")


def _read_raw(
    storage: Storage,
    run_id: str,
    blob: BlobEntry,
    part: memoryview,
    check: tuple[HashFactory, str],
) -> tuple[str, str]:
    """An uncompressed blob, read straight into ``part`` (stored bytes = raw bytes; its
    name is their SHA-256): (problem, hash of ``part``). ``check``: :func:`raw_check`.

    One hash, whoever reads: the stored bytes are the raw bytes, so the raw check (the
    writer's BLAKE3 where recorded, else the SHA-256) proves them as the name would; the
    SHA-256 is computed only after a mismatch, to say whether the stored bytes are
    corrupted: ``check_stored`` asks for nothing more here (it does for encoded blobs)."""
    new, expected = check
    if len(part) != blob.size:
        return f"has room for {len(part)} bytes, manifest says {blob.size}", ""
    h = new()

    def on_block(piece: memoryview) -> None:
        h.update(piece)  # releases the GIL: other workers read meanwhile

    try:
        size = storage.read_into(blob_key(run_id, blob.digest), part, on_block, BLOCK_BYTES)
    except NotFoundError:
        return "is missing from storage", ""
    if size != blob.size:
        return f"has {size} bytes, manifest says {blob.size} (truncated or overwritten)", ""
    got = h.hexdigest()
    if got == expected:
        return "", got
    # A mismatch: the stored bytes' SHA-256 (the blob's name) says whether they are corrupted.
    stored = got if new is hashlib.sha256 else sha256_hex(part)
    if stored != blob.digest:
        return f"hashes to {stored[:16]}… (corrupted bytes)", got
    return "", got


def _read_encoded(
    storage: Storage,
    run_id: str,
    blob: BlobEntry,
    part: memoryview,
    shuffler: Shuffler,
    scratch: Scratch,
    check: tuple[HashFactory, str],
    check_stored: bool,
) -> tuple[str, str]:
    """A compressed blob, decoded from the storage's view into ``part``: (problem, hash of
    ``part``). ``check``: :func:`raw_check`."""
    new, expected = check
    digest = blob.digest
    problem = ""
    got = ""
    try:
        with storage.read_view(blob_key(run_id, digest)) as stored:
            if len(stored) != blob.size:
                problem = (
                    f"has {len(stored)} bytes, manifest says {blob.size} (truncated or overwritten)"
                )
            elif check_stored and (h := sha256_hex(stored)) != digest:
                problem = f"hashes to {h[:16]}… (corrupted bytes)"
            else:
                try:
                    got = decode_into(stored, blob.codec, part, shuffler, scratch, new)
                except CodecError as e:
                    problem = str(e)  # raised below, once the mapping is released
                if (problem or got != expected) and (h := sha256_hex(stored)) != digest:
                    problem = f"hashes to {h[:16]}… (corrupted bytes)"
    except NotFoundError:
        problem = "is missing from storage"
    return problem, got


def check_inline(entry: TensorEntry, what: str) -> None:
    """Refuse (:class:`IntegrityError`) inline data that does not match its SHA-256."""
    assert entry.inline is not None
    if sha256_hex(entry.inline) != entry.inline_sha256:
        raise IntegrityError(f"{what}: inline data does not match its SHA-256")
