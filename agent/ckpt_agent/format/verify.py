"""Hash-level verification of a checkpoint: re-read every byte, compare SHA-256s.

Torch-free and streaming (``ckpt verify``, the operator, the validator's
first check). Decoding (codec, raw hashes, shapes) is the loader's job
(:mod:`ckpt_agent.persist.validate`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from ckpt_agent.errors import NotFoundError, RetryableError, StorageError, one_line
from ckpt_agent.format.entries import BlobEntry
from ckpt_agent.format.layout import blob_key, sha256_hex
from ckpt_agent.format.readers import read_commit, read_rank_manifest
from ckpt_agent.storage.base import Storage

__all__ = ["Progress", "VerifyResult", "verify_hashes"]

_READ_CHUNK: Final = 8 * 1024 * 1024


@dataclass
class VerifyResult:
    """Hash-level verification of one checkpoint (:func:`verify_hashes`)."""

    checkpoint_id: str
    manifest_hash: str = ""
    ok: bool = True
    errors: list[str] = field(default_factory=list)
    blobs_checked: int = 0
    bytes_checked: int = 0
    missing: list[str] = field(default_factory=list)
    """Digests of blobs that are gone."""
    mismatched: list[str] = field(default_factory=list)
    """Digests of blobs whose bytes do not hash to their name (or have the wrong size)."""

    def fail(self, message: str) -> None:
        self.ok = False
        self.errors.append(message)

    @property
    def reason(self) -> str:
        if self.ok:
            return ""
        more = f" (+{len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
        return self.errors[0] + more


#: ``progress(bytes_done, bytes_total)``
Progress = Callable[[int, int], None]


def verify_hashes(
    storage: Storage,
    run_id: str,
    ckpt_id: str,
    *,
    progress: Progress | None = None,
    ranks: Sequence[int] | None = None,
) -> VerifyResult:
    """Re-read every byte of a checkpoint and compare SHA-256s (streaming, torch-free).

    Checks the COMMIT parses, each rank manifest matches the hash the COMMIT
    records, and every referenced blob exists, has its recorded size and
    hashes to its name. Never raises for bad data: the result says what is
    wrong. A transient storage failure (:class:`~ckpt_agent.errors.RetryableError`)
    is raised, not reported: it says nothing about the checkpoint, and a caller
    that took it for a failed check would give a good checkpoint up. Decoding
    (codec, raw hashes, shapes) is the loader's job (:mod:`ckpt_agent.persist.validate`).
    """
    result = VerifyResult(checkpoint_id=ckpt_id)
    try:
        committed = read_commit(storage, run_id, ckpt_id)
    except RetryableError:
        raise
    except Exception as e:  # bad data of any kind is a failed check, never a crash
        result.fail(one_line(e))
        return result
    result.manifest_hash = committed.manifest_hash
    wanted: dict[str, BlobEntry] = {}
    for ref in committed.commit.ranks:
        if ranks is not None and ref.rank not in ranks:
            continue
        try:
            m = read_rank_manifest(storage, run_id, committed, ref.rank)
        except RetryableError:
            raise
        except Exception as e:
            result.fail(one_line(e))
            continue
        for name, t in (*m.tensors.items(), *m.files.items()):
            if t.inline is not None and sha256_hex(t.inline) != t.inline_sha256:
                result.fail(f"{ckpt_id}: inline data of {name!r} does not match its SHA-256")
        for digest in m.referenced_blobs():
            wanted[digest] = m.blobs[digest]
    total = sum(b.size for b in wanted.values())
    done = 0
    for digest in sorted(wanted):
        blob = wanted[digest]
        key = blob_key(run_id, digest)
        h = hashlib.sha256()
        n = 0
        try:
            with storage.open_read(key) as f:
                while n <= blob.size:  # never more than the declared size plus one byte
                    chunk = f.read(min(_READ_CHUNK, blob.size + 1 - n))
                    if not chunk:
                        break
                    h.update(chunk)
                    n += len(chunk)
                    if progress is not None:
                        progress(done + n, total)
        except NotFoundError:
            result.missing.append(digest)
            result.fail(f"{ckpt_id}: blob {digest[:16]}… is missing from storage")
            continue
        except RetryableError:
            raise
        except StorageError as e:
            result.fail(f"{ckpt_id}: blob {digest[:16]}…: {e}")
            continue
        result.blobs_checked += 1
        result.bytes_checked += n
        done += blob.size
        if n != blob.size:
            result.mismatched.append(digest)
            result.fail(
                f"{ckpt_id}: blob {digest[:16]}… has {n} bytes, manifest says {blob.size} "
                "(truncated?)"
            )
        elif h.hexdigest() != digest:
            result.mismatched.append(digest)
            result.fail(f"{ckpt_id}: blob {digest[:16]}… does not match its SHA-256 (corrupted)")
        if progress is not None:
            progress(done, total)
    return result
