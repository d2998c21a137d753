"""Issue #17, torch-free: every reader stays bounded and total on forged or damaged data.

Caps come from :mod:`ckpt_agent.format.layout` (docs/format.md, "Limits"):
documents are read at most to their limit plus one byte and parsed with
integer/float hooks; a chunk never decodes to more than 16 MiB; tensors are
refused past their element/byte limits before anything is allocated; the
listing reports a bad COMMIT and lists the rest; verification reads no more
than a blob's declared size plus one byte, and never hangs on a FIFO.
"""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path
from typing import BinaryIO

import pytest
import zstandard
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.errors import CheckpointFormatError, CodecError, JsonTreeError
from ckpt_agent.format import jsontree
from ckpt_agent.format.codec import CodecSpec, decode
from ckpt_agent.format.entries import BlobEntry, TensorEntry
from ckpt_agent.format.layout import (
    CHUNK_MAX_BYTES,
    COMMIT_MAX_BYTES,
    TENSOR_MAX_ELEMENTS,
    blob_key,
    commit_key,
    dumps,
    loads,
    rank_manifest_key,
    validation_key,
)
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta, CommitManifest
from ckpt_agent.format.readers import read_checkpoint, read_commit
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.validate import load_check
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"
D = "ab" * 32


def _save(store: LocalStorage, step: int, data: bytes, **kw: object) -> str:
    w = CheckpointWriter(store, RUN, **kw)  # type: ignore[arg-type]
    meta = CheckpointMeta(
        run_id=RUN, step=step, tier=Tier.PULSE, created_at=1e9 + step, sections=("model",)
    )
    src = TensorSource("model/w", "uint8", (len(data),), memoryview(data))
    done = w.commit(
        meta, [w.write_rank(meta, 0, {"model": {"w": {"__tensor__": "model/w"}}}, [src])]
    )
    cid = checkpoint_id(Tier.PULSE, step)
    verdict = ValidationVerdict(cid, done.manifest_hash, CheckpointStatus.VALID)
    store.commit(validation_key(RUN, cid), verdict.to_bytes())
    return cid


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return res.exit_code, res.output


# --------------------------------------------------------------------------- JSON


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        (b'{"a":' + b"9" * 5000 + b"}", "5000 digits"),
        (b'{"a":-' + b"9" * 40 + b"}", "digits"),
        (b'{"a":1e400}', "out of range"),
        (b'{"a":-1e400}', "out of range"),
        (b'{"a":0.' + b"1" * 100 + b"}", "out of range"),
        (b'{"a":NaN}', "constant"),
        (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    ],
)
def test_json_hooks_refuse_huge_numbers_and_deep_nesting(doc: bytes, words: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(CheckpointFormatError, match=words):
        loads(doc, "x")
    assert time.perf_counter() - t0 < 1.0


def test_json_size_is_checked_before_parsing() -> None:
    with pytest.raises(CheckpointFormatError, match="limit"):
        loads(b"{}" + b" " * 100, "x", max_bytes=64)
    assert loads(b'{"a":' + b"9" * 39 + b"}", "x") == {"a": int("9" * 39)}


def test_the_writer_refuses_what_readers_refuse() -> None:
    with pytest.raises(JsonTreeError, match="digits"):
        jsontree.encode({"seed": 10**39})
    assert jsontree.encode({"seed": 10**39 - 1}) == {"seed": 10**39 - 1}
    with pytest.raises(ValueError, match="at most"):
        CheckpointWriter(LocalStorage("/tmp"), RUN, chunk_bytes=CHUNK_MAX_BYTES + 16)


# --------------------------------------------------------------------------- entries


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "float32", "shape": [10**12], "nbytes": 4 * 10**12, "chunks": []},
        {"dtype": "float32", "shape": [2**70, 0], "nbytes": 0, "chunks": []},
        {"dtype": "uint8", "shape": [1] * 33, "nbytes": 1, "chunks": []},
        {"dtype": "uint8", "shape": [TENSOR_MAX_ELEMENTS + 1], "nbytes": 0, "chunks": []},
        {"dtype": "object", "shape": [1], "nbytes": 8, "chunks": []},
    ],
    ids=["1e12-elements", "overflow", "dims", "over-cap", "object"],
)
def test_tensor_entries_past_the_limits_are_refused(entry: dict[str, object]) -> None:
    with pytest.raises(CheckpointFormatError):
        TensorEntry.from_json(entry, "t")


@pytest.mark.parametrize(
    "entry",
    [
        {"codec": "zstd", "size": 32 << 10, "raw_size": 1 << 30, "raw_sha256": D},
        {"codec": "none", "size": 100, "raw_size": 50, "raw_sha256": D},
        {"codec": "none", "size": 100, "raw_size": 100, "raw_sha256": "cd" * 32},
        {"codec": "none", "size": 100, "raw_size": 100, "raw_sha256": D, "raw_blake3": "x"},
        {"codec": "none", "size": 100, "raw_size": 100, "raw_sha256": D, "raw_blake3": 7},
    ],
    ids=["bomb-1GiB", "none-size", "none-hash", "blake3-text", "blake3-number"],
)
def test_blob_entries_past_the_limits_are_refused(entry: dict[str, object]) -> None:
    with pytest.raises(CheckpointFormatError):
        BlobEntry.from_json(D, entry, "b")


def test_a_zstd_bomb_never_decodes_past_the_declared_size() -> None:
    zeros = bytes(1 << 20)
    cobj = zstandard.ZstdCompressor(level=1).compressobj()  # no content size in the frame
    bomb = b"".join(cobj.compress(zeros) for _ in range(1024)) + cobj.flush()  # 1 GiB of zeros
    assert len(bomb) < 64 << 10
    spec = CodecSpec("zstd", 1, 0)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(CodecError):
            decode(bomb, spec, 1 << 30)  # declared 1 GiB: over the chunk limit, refused first
        with pytest.raises(CodecError):
            decode(bomb, spec, 4096)  # declared small: decompression stops at it
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0 and peak < 1 << 20
    sized = zstandard.ZstdCompressor(level=1).compress(bytes(CHUNK_MAX_BYTES + 1))
    with pytest.raises(CodecError, match="chunk limit"):
        decode(sized, spec, CHUNK_MAX_BYTES + 1)


# --------------------------------------------------------------------------- documents


def test_an_oversized_commit_is_refused_reading_at_most_its_limit(ck_store: LocalStorage) -> None:
    cid = _save(ck_store, 1, bytes(64))
    path = ck_store.root / commit_key(RUN, cid)
    path.write_bytes(path.read_bytes() + b" " * (24 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError, match="limit"):
            read_commit(ck_store, RUN, cid)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * COMMIT_MAX_BYTES
    rec = {r.id: r for r in list_checkpoints(ck_store, RUN)}[cid]
    assert rec.status == CheckpointStatus.CORRUPTED and cid in rec.extra["error"]


def test_listing_names_a_bad_commit_and_lists_the_rest(ck_store: LocalStorage) -> None:
    good = _save(ck_store, 1, bytes(64))
    bad = _save(ck_store, 2, bytes(64))
    key = commit_key(RUN, bad)
    raw = ck_store.read(key).replace(b'"score":', b'"score":' + b"9" * 5000 + b',"z":')
    ck_store.commit(key, raw)
    recs = {r.id: r for r in list_checkpoints(ck_store, RUN)}
    assert recs[good].status == CheckpointStatus.VALID
    assert recs[bad].status == CheckpointStatus.CORRUPTED
    assert f"{bad}/COMMIT" in recs[bad].extra["error"]
    assert [r.id for r in list_checkpoints(ck_store, RUN, include_broken=False)] == [good]
    args = ("--storage", str(ck_store.root), "--run-id", RUN)
    code, out = _cli("ls", *args)
    assert code == 0 and good in out and bad in out and "Traceback" not in out
    code, out = _cli("ls", "--json", *args)
    assert code == 0 and {r["id"] for r in json.loads(out)} >= {good, bad}
    code, out = _cli("verify", "--all", *args)
    assert code == 1 and "Traceback" not in out and f"{bad}/COMMIT" in out


def test_an_unreadable_verdict_is_ignored_not_fatal(ck_store: LocalStorage) -> None:
    cid = _save(ck_store, 1, bytes(64))
    ck_store.commit(validation_key(RUN, cid), b'{"format":"ckpt-operator.validation","x":[')
    assert list_checkpoints(ck_store, RUN)[0].status == CheckpointStatus.PENDING
    bad = dumps({"format": "ckpt-operator.validation", "status": "valid", "validated_at": []})
    ck_store.commit(validation_key(RUN, cid), bad)
    assert list_checkpoints(ck_store, RUN)[0].status == CheckpointStatus.PENDING


def test_created_at_out_of_range_is_refused_and_listed(ck_store: LocalStorage) -> None:
    cid = _save(ck_store, 1, bytes(64))
    key = commit_key(RUN, cid)
    ck_store.commit(key, ck_store.read(key).replace(b'"created_at":', b'"created_at":1e400,"y":'))
    with pytest.raises(CheckpointFormatError, match="out of range"):
        CommitManifest.from_bytes(ck_store.read(key))
    code, out = _cli("ls", "--storage", str(ck_store.root), "--run-id", RUN)
    assert code == 0 and cid in out and "corrupted" in out and "Traceback" not in out


def test_symlink_loop_under_steps_does_not_break_listing(ck_store: LocalStorage) -> None:
    good = _save(ck_store, 1, bytes(64))
    steps = ck_store.root / RUN / "steps"
    os.symlink(steps / "loop", steps / "loop")
    os.symlink(steps, steps / "pulse_step_000000000009")
    assert [r.id for r in list_checkpoints(ck_store, RUN)] == [good]
    code, out = _cli("ls", "--storage", str(ck_store.root), "--run-id", RUN)
    assert code == 0 and good in out


# --------------------------------------------------------------------------- blobs


class _Counting(LocalStorage):
    """Counts the bytes handed out by ``open_read`` streams."""

    read_bytes = 0

    def open_read(self, key: str) -> BinaryIO:
        f = super().open_read(key)
        outer = self
        real = f.read

        def read(n: int = -1) -> bytes:
            data = real(n)
            outer.read_bytes += len(data)
            return data

        f.read = read  # type: ignore[method-assign]
        return f


def test_verify_reads_at_most_the_declared_size_plus_one(tmp_path: Path) -> None:
    store = _Counting(tmp_path / "store")
    cid = _save(store, 1, os.urandom(4096), codec=CodecPolicy("none"), inline_max_bytes=0)
    _, m = read_checkpoint(store, RUN, cid)
    digest = m.tensors["model/w"].chunks[0]
    with open(store.root / blob_key(RUN, digest), "ab") as f:
        f.write(bytes(32 << 20))
    res = verify_hashes(store, RUN, cid)
    assert not res.ok and digest in res.mismatched
    assert store.read_bytes <= 4096 + 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["blob", "manifest", "commit"])
def test_a_fifo_in_place_of_an_object_never_hangs_a_reader(
    ck_store: LocalStorage, which: str
) -> None:
    cid = _save(ck_store, 1, os.urandom(4096), inline_max_bytes=0)
    _, m = read_checkpoint(ck_store, RUN, cid)
    key = {
        "blob": blob_key(RUN, m.tensors["model/w"].chunks[0]),
        "manifest": rank_manifest_key(RUN, cid, 0),
        "commit": commit_key(RUN, cid),
    }[which]
    path = ck_store.root / key
    path.unlink()
    os.mkfifo(path)
    assert not verify_hashes(ck_store, RUN, cid).ok
    assert not load_check(ck_store, RUN, cid).ok
    usable = {r.id for r in list_checkpoints(ck_store, RUN) if r.status != "corrupted"}
    assert which != "commit" or cid not in usable


def test_the_validator_decodes_a_repeated_chunk_once_in_bounded_memory(
    ck_store: LocalStorage,
) -> None:
    cid = _save(ck_store, 1, bytes(32 << 20), chunk_bytes=1 << 20)
    _, m = read_checkpoint(ck_store, RUN, cid)
    assert len(m.tensors["model/w"].chunks) == 32 and len(m.blobs) == 1
    tracemalloc.start()
    try:
        report = load_check(ck_store, RUN, cid)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.ok, report.error
    assert report.bytes_read == 32 << 20 and peak < 8 << 20
