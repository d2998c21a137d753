"""Validation after write: a separate loader process, hash and shape checks, verdicts."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.format.layout import blob_key, commit_key, rank_manifest_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.readers import read_checkpoint, read_validation
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.validate import LoaderProcess, Validator, compare_meta, load_check
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier, ValidationSpec
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"
EXPECTED = {"model/w": ("float32", (64, 64)), "model/b": ("float32", (64,))}


def _write(store: LocalStorage, step: int = 1, codec: str = "zstd") -> str:
    w = CheckpointWriter(
        store, RUN, codec=CodecPolicy(codec, 3, True, 0), chunk_bytes=4096, inline_max_bytes=64
    )
    wdata = b"".join(struct.pack("<f", (i % 97) * 0.25) for i in range(64 * 64))
    bdata = b"".join(struct.pack("<f", i) for i in range(64))
    srcs = [
        TensorSource("model/w", "float32", (64, 64), memoryview(wdata)),
        TensorSource("model/b", "float32", (64,), memoryview(bdata)),
    ]
    state = {"model": {"w": {"__tensor__": "model/w"}, "b": {"__tensor__": "model/b"}}}
    meta = CheckpointMeta(run_id=RUN, step=step, tier=Tier.PULSE, sections=("model",))
    w.commit(meta, [w.write_rank(meta, 0, state, srcs)])
    return checkpoint_id(Tier.PULSE, step)


def _validator(store: LocalStorage, subprocess: bool = True, mode: str | None = None) -> Validator:
    spec = ValidationSpec(load_in_subprocess=subprocess)
    if mode is not None:
        spec = spec.model_copy(update={"mode": mode})
    return Validator(store, RUN, spec, timeout_s=60)


def test_valid_checkpoint_loads_in_a_separate_process(ck_store: LocalStorage) -> None:
    cid = _write(ck_store)
    v = _validator(ck_store)
    try:
        out = v.validate(cid, EXPECTED)
        assert out.valid, out.reason
        assert out.checks == ["hashes", "load (subprocess)", "shapes"]  # the default mode
        child = v._child
        assert child is not None and child.pid is not None and child.pid != os.getpid()
        # the process is reused for the next checkpoint
        cid2 = _write(ck_store, step=2)
        assert v.validate(cid2, EXPECTED).valid
        assert child.starts == 1
        v.record(out)
        rec = read_validation(ck_store, RUN, cid)
        assert rec is not None and rec.status == CheckpointStatus.VALID
        assert {r.id: r.status for r in list_checkpoints(ck_store, RUN)}[
            cid
        ] == CheckpointStatus.VALID
    finally:
        v.close()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("flip", "corrupted bytes"),
        ("truncate", "truncated"),
        ("delete_blob", "missing from storage"),
        ("delete_manifest", "rank manifest rank_00000.json is missing"),
        ("delete_commit", "not committed"),
        (
            "shape",
            "shape/dtype mismatch with the live model: model/w: checkpoint has float32[64, 64], live state has float32[64, 32]",
        ),
    ],
)
@pytest.mark.parametrize("mode", ["stored", "full"])
def test_damaged_checkpoints_are_corrupted_with_a_reason(
    ck_store: LocalStorage, damage: str, message: str, mode: str
) -> None:
    cid = _write(ck_store)
    _, m = read_checkpoint(ck_store, RUN, cid)
    digest = m.tensors["model/w"].chunks[2]
    path = ck_store.root / blob_key(RUN, digest)
    expected: dict[str, Any] = dict(EXPECTED)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:7])
    elif damage == "delete_blob":
        path.unlink()
    elif damage == "delete_manifest":
        ck_store.delete(rank_manifest_key(RUN, cid, 0))
    elif damage == "delete_commit":
        ck_store.delete(commit_key(RUN, cid))
    else:
        expected["model/w"] = ("float32", (64, 32))
    v = _validator(ck_store, subprocess=damage in ("flip", "shape"), mode=mode)
    try:
        out = v.validate(cid, expected)
    finally:
        v.close()
    assert out.status == CheckpointStatus.CORRUPTED
    assert message in out.reason
    if damage in ("flip", "truncate"):
        assert out.bad_blobs == [digest]


def test_a_dead_or_hung_loader_is_a_failed_load_and_is_replaced(ck_store: LocalStorage) -> None:
    cid = _write(ck_store)
    child = LoaderProcess(ck_store.url)
    try:
        assert child.load(RUN, cid, 0, timeout=60).ok
        pid = child.pid
        assert pid is not None
        os.kill(pid, 9)
        rep = child.load(RUN, cid, 0, timeout=60)
        # either the dead child is noticed before the request or while waiting for the answer
        if not rep.ok:
            assert "loader process" in rep.error
            rep = child.load(RUN, cid, 0, timeout=60)
        assert rep.ok and child.pid != pid
    finally:
        child.close()


def test_compare_meta_lists_every_difference() -> None:
    got = {"a": ("float32", (2,)), "b": ("int64", (3,)), "extra": ("float32", ())}
    exp = {"a": ("float32", (2,)), "b": ("int32", (3,)), "gone": ("float32", (1,))}
    assert compare_meta(exp, got) == [
        "gone: missing from the checkpoint",
        "extra: in the checkpoint but not in the live state",
        "b: checkpoint has int64[3], live state has int32[3]",
    ]


def test_malicious_blob_cannot_run_code_in_the_loader(
    ck_store: LocalStorage, tmp_path: Path
) -> None:
    sentinel = tmp_path / "pwned"

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (exec, (f"open({str(sentinel)!r}, 'w').write('x')",))

    payload = pickle.dumps(Boom())
    payload += b"\x00" * (-len(payload) % 4)
    w = CheckpointWriter(ck_store, RUN, codec=CodecPolicy("none"), inline_max_bytes=0)
    meta = CheckpointMeta(run_id=RUN, step=1, tier=Tier.PULSE, sections=("model",))
    n = len(payload) // 4
    w.commit(
        meta,
        [
            w.write_rank(
                meta,
                0,
                {"model": {"w": {"__tensor__": "model/w"}}},
                [TensorSource("model/w", "float32", (n,), memoryview(payload))],
            )
        ],
    )
    v = _validator(ck_store)
    try:
        out = v.validate(checkpoint_id(Tier.PULSE, 1), {"model/w": ("float32", (n,))})
    finally:
        v.close()
    assert out.valid  # well-formed numbers; nothing was executed
    assert not sentinel.exists()
    assert load_check(ck_store, RUN, checkpoint_id(Tier.PULSE, 1)).ok


@pytest.mark.parametrize("subprocess", [False, True])
def test_stored_mode_hashes_what_storage_returns_without_decoding(
    ck_store: LocalStorage, monkeypatch: pytest.MonkeyPatch, subprocess: bool
) -> None:
    """``validation.mode: stored`` re-reads and hashes every blob as stored, decodes only the
    tree (not the blobs): a flipped stored byte is still caught, in-process or in the child."""
    import ckpt_agent.persist.validate as validate

    def no_decode(*args: object, **kwargs: object) -> None:
        raise AssertionError("stored mode decoded a blob")

    if not subprocess:
        monkeypatch.setattr(validate, "check_tensor_bytes", no_decode)
    cid = _write(ck_store)
    spec = ValidationSpec(load_in_subprocess=subprocess, mode="stored")
    v = Validator(ck_store, RUN, spec, timeout_s=60)
    try:
        out = v.validate(cid, EXPECTED)
        assert out.valid, out.reason
        assert out.checks[0] == "stored hashes"
        _, m = read_checkpoint(ck_store, RUN, cid)
        digest = m.tensors["model/w"].chunks[1]
        path = ck_store.root / blob_key(RUN, digest)
        data = bytearray(path.read_bytes())
        data[5] ^= 0x01
        path.write_bytes(bytes(data))
        bad = v.validate(cid, EXPECTED)
    finally:
        v.close()
    assert bad.status == CheckpointStatus.CORRUPTED and bad.bad_blobs == [digest]


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_stored_mode_checks_uncompressed_blobs_by_their_blake3(
    ck_store: LocalStorage, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """An uncompressed blob's stored bytes are its raw bytes: ``stored`` checks them against
    the writer's BLAKE3 (what the restore checks too), not a second SHA-256; a compressed
    blob has only its name, the SHA-256. Either way a flipped stored byte is caught."""
    import ckpt_agent.persist.validate as validate
    from ckpt_agent.format.layout import BLAKE3

    if BLAKE3 is None:
        pytest.skip("the blake3 package is not installed")
    checks: list[object] = []  # the hasher each uncompressed blob was checked with
    real_check = validate.raw_check

    def recorded_check(blob: Any) -> Any:
        new, expected = real_check(blob)
        checks.append(new)
        return new, expected

    monkeypatch.setattr(validate, "raw_check", recorded_check)
    payload = bytes(range(256)) * 1024  # compressible: zstd keeps it compressed
    w = CheckpointWriter(ck_store, RUN, codec=CodecPolicy(codec), inline_max_bytes=0)
    meta = CheckpointMeta(run_id=RUN, step=1, tier=Tier.PULSE, sections=("model",))
    n = len(payload) // 4
    state = {"model": {"w": {"__tensor__": "model/w"}}}
    src = [TensorSource("model/w", "float32", (n,), memoryview(payload))]
    w.commit(meta, [w.write_rank(meta, 0, state, src)])
    cid = checkpoint_id(Tier.PULSE, 1)
    _, m = read_checkpoint(ck_store, RUN, cid)
    (digest,) = m.tensors["model/w"].chunks
    assert (m.blobs[digest].codec.codec == "none") == (codec == "none")
    assert load_check(ck_store, RUN, cid, mode="stored").ok
    assert checks == ([BLAKE3] if codec == "none" else [])  # zstd: by its name, the SHA-256
    path = ck_store.root / blob_key(RUN, digest)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    bad = load_check(ck_store, RUN, cid, mode="stored")
    assert not bad.ok and "corrupted bytes" in bad.error and bad.bad_blobs == [digest]
