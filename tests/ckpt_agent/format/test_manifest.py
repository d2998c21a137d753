"""The on-storage format (torch-free): layout, manifests, listing, hash verification, codecs."""

from __future__ import annotations

import functools
import math
import mmap
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import pytest

from ckpt_agent.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CodecError,
    IntegrityError,
    JsonTreeError,
    NotFoundError,
    RetryableStorageError,
)
from ckpt_agent.format import jsontree
from ckpt_agent.format.codec import PY_SHUFFLER, CodecSpec, decode, encode
from ckpt_agent.format.heartbeat import Heartbeat, PackedRng, encode_heartbeats, read_heartbeat
from ckpt_agent.format.layout import (
    HEARTBEAT_MAX_BYTES,
    blob_key,
    commit_key,
    heartbeat_key,
    is_digest,
    is_rank_file,
    is_run_id,
    parse_checkpoint_id,
    rank_manifest_key,
    sha256_hex,
    validate_run_id,
    validation_key,
)
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta, CommitManifest
from ckpt_agent.format.readers import read_checkpoint, read_tensor_bytes
from ckpt_agent.format.schema import digest_field
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, Lineage, checkpoint_id
from ckpt_agent.storage.base import Storage
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"


def _floats(n: int, seed: int) -> bytes:
    import struct

    return b"".join(struct.pack("<f", math.sin(i * 0.37 + seed)) for i in range(n))


def _meta(step: int, tier: Tier = Tier.PULSE, prev: str | None = None) -> CheckpointMeta:
    return CheckpointMeta(
        run_id=RUN,
        step=step,
        tier=tier,
        created_at=1000.0 + step,
        score=0.25,
        components={"loss": 0.0, "gradient": 0.25, "system": 0.0},
        reason="test",
        prev_hash=prev,
        sections=("model",),
    )


def _write(
    store: LocalStorage,
    step: int,
    tensors: dict[str, bytes],
    *,
    writer: CheckpointWriter | None = None,
    tier: Tier = Tier.PULSE,
    prev: str | None = None,
    commit: bool = True,
) -> tuple[CheckpointWriter, str]:
    w = writer or CheckpointWriter(store, RUN, chunk_bytes=4096, inline_max_bytes=64)
    meta = _meta(step, tier, prev)
    srcs = [
        TensorSource(name, "float32", (len(data) // 4,), memoryview(data))
        for name, data in tensors.items()
    ]
    state = {"model": {name.split("/", 1)[1]: {jsontree.TENSOR: name} for name in tensors}}
    written = w.write_rank(meta, 0, state, srcs, {"train_config.json": b'{"lr": 0.1}'})
    if not commit:
        return w, ""
    done = w.commit(meta, [written])
    return w, done.manifest_hash


# --------------------------------------------------------------------------- layout


def test_layout_names_are_zero_padded_and_sortable() -> None:
    assert checkpoint_id(Tier.PULSE, 1200) == "pulse_step_000000001200"
    assert parse_checkpoint_id("full_step_000000000007") == (Tier.FULL, 7)
    assert rank_manifest_key(RUN, "pulse_step_000000001200", 3) == (
        "run1/steps/pulse_step_000000001200/rank_00003.json"
    )
    assert commit_key(RUN, "pulse_step_000000001200").endswith("/COMMIT")
    d = "ab" + "0" * 62
    assert blob_key(RUN, d) == f"run1/blobs/sha256/ab/{d}"
    ids = [checkpoint_id(Tier.PULSE, s) for s in (9, 10, 100, 1000)]
    assert sorted(ids) == ids
    with pytest.raises(ValueError, match="not a checkpoint id"):
        parse_checkpoint_id("pulse_step_12")
    with pytest.raises(ValueError, match="invalid run id"):
        commit_key("../x", "pulse_step_000000000001")
    with pytest.raises(CheckpointFormatError):
        blob_key(RUN, "not-a-digest")


@pytest.mark.parametrize(
    "name",
    [
        "pulse_step_000000000001\n",
        "pulse_step_000000000001\r",
        " pulse_step_000000000001",
        "pulse_step_0000000000012",
    ],
)
def test_checkpoint_ids_match_whole_strings_only(name: str) -> None:
    with pytest.raises(ValueError, match="not a checkpoint id"):
        parse_checkpoint_id(name)


@pytest.mark.parametrize("run_id", ["run1\n", "run1\r\n", "\nrun1", "run 1", ".", "..", "-x"])
def test_run_ids_match_whole_strings_only(run_id: str) -> None:
    assert not is_run_id(run_id)
    with pytest.raises(ValueError, match="invalid run id"):
        validate_run_id(run_id)


def test_digests_and_rank_files_match_whole_strings_only() -> None:
    d = "ab" + "0" * 62
    assert is_digest(d) and not is_digest(d + "\n") and not is_digest(d.upper())
    with pytest.raises(CheckpointFormatError):
        blob_key(RUN, d + "\n")
    with pytest.raises(CheckpointFormatError, match="not a SHA-256 hex digest"):
        digest_field(d + "\n", "COMMIT.prev_hash")
    assert is_rank_file("rank_00003.json") and not is_rank_file("rank_00003.json\n")


def test_torch_free_modules_do_not_import_torch_or_numpy() -> None:
    code = (
        "import sys\n"
        "import ckpt_agent.format.layout, ckpt_agent.format.manifest, ckpt_agent.format.readers\n"
        "import ckpt_agent.format.listing, ckpt_agent.format.verify, ckpt_agent.format.heartbeat\n"
        "import ckpt_agent.format.schema, ckpt_agent.storage.s3\n"
        "import ckpt_agent.format.codec, ckpt_agent.format.jsontree, ckpt_agent.persist.writer\n"
        "import ckpt_agent.persist.housekeeping, ckpt_agent.persist.catalog\n"
        "bad = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------- write / list


def test_commit_protocol_and_listing_only_committed(ck_store: LocalStorage) -> None:
    w, h1 = _write(ck_store, 10, {"model/w": _floats(3000, 1), "model/b": _floats(8, 2)})
    _, h2 = _write(
        ck_store, 20, {"model/w": _floats(3000, 3), "model/b": _floats(8, 2)}, writer=w, prev=h1
    )
    # a folder with blobs and a rank manifest but no COMMIT does not exist for readers
    _write(ck_store, 30, {"model/w": _floats(3000, 4)}, writer=w, commit=False)
    assert ck_store.exists(rank_manifest_key(RUN, checkpoint_id(Tier.PULSE, 30), 0))

    recs = list_checkpoints(ck_store, RUN)
    assert [r.id for r in recs] == ["pulse_step_000000000010", "pulse_step_000000000020"]
    assert all(r.status == CheckpointStatus.PENDING for r in recs)
    assert recs[1].prev_hash == h1 and recs[1].manifest_hash == h2
    assert recs[0].size_bytes > 0
    assert recs[1].reason == "test" and recs[1].score == 0.25

    committed, manifest = read_checkpoint(ck_store, RUN, recs[1].id)
    assert committed.commit.ranks[0].key == "rank_00000.json"
    assert manifest.meta.versions["format"] == "1"
    assert set(manifest.tensors) == {"model/w", "model/b"}
    assert manifest.tensors["model/b"].inline is not None  # 32 bytes: inline
    assert len(manifest.tensors["model/w"].chunks) == 3  # 12000 bytes / 4096-byte chunks
    assert "train_config.json" in manifest.files
    raw = read_tensor_bytes(ck_store, RUN, manifest, manifest.tensors["model/w"], "model/w")
    assert bytes(raw) == _floats(3000, 3)


def test_tensor_bytes_read_through_any_backend_view(
    ck_store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(ck_store, 10, {"model/w": _floats(3000, 1), "model/b": _floats(8, 2)})
    cid = checkpoint_id(Tier.PULSE, 10)
    _, manifest = read_checkpoint(ck_store, RUN, cid)
    entry = manifest.tensors["model/w"]
    key = blob_key(RUN, entry.chunks[0])
    with ck_store.read_view(key) as mapped:  # the filesystem maps the file
        assert isinstance(mapped.obj, mmap.mmap)
        assert bytes(mapped) == ck_store.read(key)
    copying = LocalStorage(ck_store.root)  # with the interface's default view: a copy
    monkeypatch.setattr(copying, "read_view", functools.partial(Storage.read_view, copying))
    monkeypatch.setattr(copying, "read_into", functools.partial(Storage.read_into, copying))
    with copying.read_view(key) as copied:
        assert isinstance(copied.obj, bytes) and bytes(copied) == ck_store.read(key)
    raw = read_tensor_bytes(copying, RUN, manifest, entry, "model/w")
    assert bytes(raw) == _floats(3000, 1)
    with pytest.raises(NotFoundError):
        with copying.read_view(key + "x"):
            pass
    with pytest.raises(NotFoundError):
        with ck_store.read_view(key + "x"):
            pass
    ck_store.write("run1/empty", b"")
    with ck_store.read_view("run1/empty") as empty:
        assert len(empty) == 0


def test_validation_verdict_sets_status_only_for_the_judged_commit(ck_store: LocalStorage) -> None:
    _, h1 = _write(ck_store, 10, {"model/w": _floats(3000, 1)})
    cid = checkpoint_id(Tier.PULSE, 10)
    rec = ValidationVerdict(cid, h1, CheckpointStatus.VALID, validated_at=1.0)
    ck_store.commit(validation_key(RUN, cid), rec.to_bytes())
    assert list_checkpoints(ck_store, RUN)[0].status == CheckpointStatus.VALID
    stale = ValidationVerdict(cid, "0" * 64, CheckpointStatus.VALID)
    ck_store.commit(validation_key(RUN, cid), stale.to_bytes())
    assert list_checkpoints(ck_store, RUN)[0].status == CheckpointStatus.PENDING


def test_unreadable_commit_is_listed_as_corrupted(ck_store: LocalStorage) -> None:
    _write(ck_store, 10, {"model/w": _floats(3000, 1)})
    cid = checkpoint_id(Tier.PULSE, 10)
    ck_store.commit(commit_key(RUN, cid), b"{not json")
    (rec,) = list_checkpoints(ck_store, RUN)
    assert rec.status == CheckpointStatus.CORRUPTED
    assert "not valid JSON" in rec.extra["error"]
    assert list_checkpoints(ck_store, RUN, include_broken=False) == []
    with pytest.raises(CheckpointNotFoundError, match="not committed"):
        read_checkpoint(ck_store, RUN, checkpoint_id(Tier.FULL, 10))


def test_listing_many_checkpoints_in_step_order(ck_store: LocalStorage) -> None:
    w = None
    for step in (100, 5, 1000, 42, 7, 99999):
        w, _ = _write(ck_store, step, {"model/w": _floats(100, step)}, writer=w)
    assert [r.step for r in list_checkpoints(ck_store, RUN)] == [5, 7, 42, 100, 1000, 99999]


def test_commit_from_another_checkpoint_is_refused(ck_store: LocalStorage) -> None:
    _write(ck_store, 10, {"model/w": _floats(3000, 1)})
    a = commit_key(RUN, checkpoint_id(Tier.PULSE, 10))
    ck_store.commit(commit_key(RUN, checkpoint_id(Tier.PULSE, 11)), ck_store.read(a))
    recs = {r.id: r for r in list_checkpoints(ck_store, RUN)}
    assert recs["pulse_step_000000000011"].status == CheckpointStatus.CORRUPTED
    assert "copied from another checkpoint" in recs["pulse_step_000000000011"].extra["error"]


def test_unknown_format_version_is_refused(ck_store: LocalStorage) -> None:
    _write(ck_store, 10, {"model/w": _floats(3000, 1)})
    key = commit_key(RUN, checkpoint_id(Tier.PULSE, 10))
    doc = ck_store.read(key).replace(b'"version":1', b'"version":99')
    with pytest.raises(CheckpointFormatError, match="version 99 is not supported"):
        CommitManifest.from_bytes(doc)


# --------------------------------------------------------------------------- de-duplication


def test_unchanged_tensors_are_stored_once(ck_store: LocalStorage) -> None:
    frozen = _floats(20_000, 7)  # 80 KB, 20 chunks
    w = CheckpointWriter(ck_store, RUN, chunk_bytes=4096, inline_max_bytes=64)
    meta1 = _meta(10)
    first = w.write_rank(
        meta1,
        0,
        {},
        [
            TensorSource("model/frozen", "float32", (20_000,), memoryview(frozen)),
            TensorSource("model/head", "float32", (100,), memoryview(_floats(100, 1))),
        ],
    )
    w.commit(meta1, [first])
    meta2 = _meta(20)
    second = w.write_rank(
        meta2,
        0,
        {},
        [
            TensorSource("model/frozen", "float32", (20_000,), memoryview(frozen)),
            TensorSource("model/head", "float32", (100,), memoryview(_floats(100, 2))),
        ],
    )
    w.commit(meta2, [second])
    assert second.blobs_reused == first.blobs_new - 1
    assert second.blobs_new == 1
    assert (
        second.manifest.tensors["model/frozen"].chunks
        == first.manifest.tensors["model/frozen"].chunks
    )
    # restore is exact from either checkpoint
    for step, head in ((10, 1), (20, 2)):
        _, m = read_checkpoint(ck_store, RUN, checkpoint_id(Tier.PULSE, step))
        assert bytes(read_tensor_bytes(ck_store, RUN, m, m.tensors["model/frozen"], "f")) == frozen
        assert bytes(read_tensor_bytes(ck_store, RUN, m, m.tensors["model/head"], "h")) == _floats(
            100, head
        )


def test_incompressible_chunks_are_kept_raw(ck_store: LocalStorage) -> None:
    noise = os.urandom(50_000)
    w = CheckpointWriter(ck_store, RUN, codec=CodecPolicy("zstd", 3, True, 0), chunk_bytes=1 << 20)
    meta = _meta(1)
    r = w.write_rank(meta, 0, {}, [TensorSource("model/x", "uint8", (50_000,), memoryview(noise))])
    (blob,) = r.manifest.blobs.values()
    assert blob.codec.codec == "none" and blob.size == 50_000


# --------------------------------------------------------------------------- verify


def _blob_path(store: LocalStorage, digest: str) -> Path:
    return store.root / RUN / "blobs" / "sha256" / digest[:2] / digest


def test_verify_hashes_ok_with_progress(ck_store: LocalStorage) -> None:
    _write(ck_store, 10, {"model/w": _floats(3000, 1)})
    seen: list[tuple[int, int]] = []
    res = verify_hashes(
        ck_store, RUN, checkpoint_id(Tier.PULSE, 10), progress=lambda d, t: seen.append((d, t))
    )
    assert res.ok, res.errors
    assert res.blobs_checked == 3  # 3 chunks (train_config.json is small: inline)
    assert seen and seen[-1][0] == seen[-1][1]


def test_verify_hashes_raises_a_transient_storage_error(ck_store: LocalStorage) -> None:
    """An outage is not damage: reported as a failed check, a good checkpoint is given up."""
    _write(ck_store, 10, {"model/w": _floats(3000, 1)})

    class Outage(LocalStorage):
        def open_read(self, key: str) -> BinaryIO:
            raise RetryableStorageError("injected: connection reset")

    with pytest.raises(RetryableStorageError):
        verify_hashes(Outage(ck_store.root), RUN, checkpoint_id(Tier.PULSE, 10))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest", "commit"])
def test_verify_hashes_reports_damage(ck_store: LocalStorage, damage: str) -> None:
    _write(ck_store, 10, {"model/w": _floats(3000, 1)})
    cid = checkpoint_id(Tier.PULSE, 10)
    _, m = read_checkpoint(ck_store, RUN, cid)
    digest = m.tensors["model/w"].chunks[1]
    path = _blob_path(ck_store, digest)
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
        expect = "does not match its SHA-256"
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-10])
        expect = "truncated"
    elif damage == "delete":
        path.unlink()
        expect = "missing"
    elif damage == "manifest":
        key = rank_manifest_key(RUN, cid, 0)
        ck_store.commit(key, ck_store.read(key).replace(b'"reason":"test"', b'"reason":"evil"'))
        expect = "modified or truncated"
    else:
        ck_store.delete(commit_key(RUN, cid))
        expect = "not committed"
    res = verify_hashes(ck_store, RUN, cid)
    assert not res.ok
    assert expect in res.reason, res.errors
    if damage in ("flip", "truncate"):
        assert res.mismatched == [digest]
        with pytest.raises(IntegrityError):
            read_tensor_bytes(ck_store, RUN, m, m.tensors["model/w"], "model/w")


# --------------------------------------------------------------------------- heartbeat


def test_heartbeat_ring_round_trip_and_size_limit(ck_store: LocalStorage) -> None:
    hbs = [
        Heartbeat(step=i, time=float(i), epoch=0, data={"pos": i}, rng={"x": [1, 2]})
        for i in range(5)
    ]
    ck_store.commit(heartbeat_key(RUN, 0), encode_heartbeats(RUN, 0, hbs))
    got = read_heartbeat(ck_store, RUN)
    assert [h.step for h in got] == [0, 1, 2, 3, 4] and got[-1].data == {"pos": 4}
    big = [Heartbeat(step=i, time=0.0, data="x" * 200_000) for i in range(4)]
    data = encode_heartbeats(RUN, 0, big)
    assert len(data) < HEARTBEAT_MAX_BYTES  # oldest entries dropped
    with pytest.raises(ValueError, match="over the"):
        encode_heartbeats(RUN, 0, [Heartbeat(step=0, time=0.0, data="x" * HEARTBEAT_MAX_BYTES)])
    recs = list_checkpoints(ck_store, RUN)
    assert [(r.tier, r.step, r.status) for r in recs] == [
        (Tier.HEARTBEAT, 4, CheckpointStatus.VALID)
    ]


def _packed_rng() -> PackedRng:
    words = (*range(1000, 1624), 624)
    key = bytes(range(256)) * 9 + bytes(192)  # 624 uint32 words
    return PackedRng(
        python=(3, words, None),
        numpy=("MT19937", key, 17, 1, -0.25),
        torch_cpu=bytes(range(200)) * 25 + bytes(56),
        cuda=(b"\x01" * 16, b"\x02" * 16),
    )


def test_heartbeat_rng_is_compact_binary_and_round_trips(ck_store: LocalStorage) -> None:
    rng = _packed_rng()
    packed = rng.pack()
    assert PackedRng.unpack(packed) == rng
    assert len(packed) < 10_200  # 625 + 624 words, 5056 + 2 x 16 generator bytes, headers
    bare = PackedRng(python=(3, rng.python[1] if rng.python else (), 0.5))
    assert PackedRng.unpack(bare.pack()) == bare
    hb = Heartbeat(step=7, time=1.0, data={"pos": 7}, rng_packed=rng)
    ck_store.commit(heartbeat_key(RUN, 0), encode_heartbeats(RUN, 0, [hb] * 4))
    assert len(ck_store.read(heartbeat_key(RUN, 0), 0, HEARTBEAT_MAX_BYTES)) < 4 * 14_000
    (got, *_) = read_heartbeat(ck_store, RUN)
    assert got.rng_packed == rng and got.rng is None


@pytest.mark.parametrize(
    "damage",
    ["magic", "truncate", "trailing", "unknown part", "huge generator", "many cuda"],
)
def test_a_damaged_packed_rng_is_a_format_error(damage: str) -> None:
    packed = bytearray(_packed_rng().pack())
    if damage == "magic":
        packed[0:4] = b"XXXX"
    elif damage == "truncate":
        del packed[-5:]
    elif damage == "trailing":
        packed += b"\0"
    elif damage == "unknown part":
        packed[4] |= 0x10
    elif damage == "huge generator":
        packed = bytearray(PackedRng(torch_cpu=b"").pack())
        packed[5:9] = (10**6).to_bytes(4, "little")
    else:
        packed = bytearray(PackedRng(cuda=(b"",)).pack())
        packed[5:7] = (1000).to_bytes(2, "little")
    with pytest.raises(CheckpointFormatError):
        PackedRng.unpack(bytes(packed))
    entry = {"step": 1, "time": 0.0, "rng_bin": "not base64!"}
    with pytest.raises(CheckpointFormatError, match="base64"):
        Heartbeat.from_json(entry, "hb")


# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize(
    "spec",
    [
        CodecSpec("none", 0, 0),
        CodecSpec("zstd", 3, 0),
        CodecSpec("zstd", 1, 4),
        CodecSpec("zstd", 3, 2),
    ],
)
def test_codec_round_trip(spec: CodecSpec) -> None:
    raw = _floats(10_001, 3) + b"xyz"  # a partial element at the end
    stored = encode(memoryview(raw), spec)
    back = decode(stored, spec, len(raw))
    assert bytes(back) == raw
    out = memoryview(bytearray(len(raw)))
    assert bytes(decode(stored, spec, len(raw), out=out)) == raw


def test_numpy_and_python_shuffle_agree() -> None:
    from ckpt_agent.format.shuffle import NUMPY_SHUFFLER

    raw = memoryview(_floats(4097, 1) + b"ab")
    for k in (2, 4, 8):
        a = bytes(memoryview(PY_SHUFFLER.shuffle(raw, k)))
        b = bytes(memoryview(NUMPY_SHUFFLER.shuffle(raw, k)))
        assert a == b
        out1 = memoryview(bytearray(len(raw)))
        out2 = memoryview(bytearray(len(raw)))
        PY_SHUFFLER.unshuffle(a, k, out1)
        NUMPY_SHUFFLER.unshuffle(a, k, out2)
        assert bytes(out1) == bytes(out2) == bytes(raw)


def test_codec_refuses_bad_input() -> None:
    with pytest.raises(CodecError, match="unknown codec"):
        CodecSpec.from_json({"codec": "pickle"})
    spec = CodecSpec("zstd", 3, 0)
    stored = bytes(memoryview(encode(memoryview(b"a" * 1000), spec)))
    with pytest.raises(CodecError, match="declares 1000 bytes"):
        decode(stored, spec, 10)  # never decompresses more than the manifest allows
    with pytest.raises(CodecError):
        decode(b"not zstd at all", spec, 10)
    with pytest.raises(CodecError, match="stored size"):
        decode(b"abc", CodecSpec("none", 0, 0), 4)


# --------------------------------------------------------------------------- tagged JSON


def test_jsontree_round_trips_state_dict_shapes() -> None:
    value = {
        "state": {0: {"step": 3}, 1: {"step": 4}},
        "param_groups": [{"betas": (0.9, 0.999), "lr": 1e-3, "params": [0, 1], "fused": None}],
        "best": math.inf,
        "worst": -math.inf,
        "blob": b"\x00\x01",
        "nested": ((1, 2), [3, (4,)]),
        "__tuple__": "a plain key that looks like a tag",
    }
    enc = jsontree.encode(value)
    import json

    text = json.dumps(enc, allow_nan=False)  # strict JSON
    assert jsontree.decode(json.loads(text)) == value
    nan = jsontree.decode(jsontree.encode({"x": math.nan}))
    assert isinstance(nan, dict) and math.isnan(nan["x"])


def test_jsontree_refuses_what_it_cannot_encode_exactly() -> None:
    class Opaque:
        pass

    with pytest.raises(JsonTreeError, match="optimizer/state/0: cannot checkpoint"):
        jsontree.encode({"optimizer": {"state": {0: Opaque()}}})
    with pytest.raises(JsonTreeError, match="no resolver"):
        jsontree.decode({"__tensor__": "x"})
    with pytest.raises(JsonTreeError, match="base64"):
        jsontree.decode({"__bytes__": "***"})


def test_sha256_helper() -> None:
    assert sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_lineage_is_optional_and_round_trips() -> None:
    plain = _meta(7).to_json()
    assert "lineage" not in plain  # a never-pinned run writes what older versions wrote
    assert CheckpointMeta.from_json(plain, "old").lineage == Lineage()
    pinned = replace(_meta(7), lineage=Lineage(2, ("CKPT_RESUME_FROM:x", "RECOVER.json:ab"), "y"))
    doc = pinned.to_json()
    assert doc["lineage"] == {
        "epoch": 2,
        "pins": ["CKPT_RESUME_FROM:x", "RECOVER.json:ab"],
        "parent": "y",
    }
    assert CheckpointMeta.from_json(doc, "new").lineage == pinned.lineage
    assert CheckpointMeta.from_json({**doc, "lineage": None}, "null").lineage == Lineage()
    bads: list[object] = [[], {"epoch": -1}, {"pins": "x"}, {"pins": [1]}, {"parent": 3}]
    for bad in bads:
        with pytest.raises(CheckpointFormatError):
            CheckpointMeta.from_json({**doc, "lineage": bad}, "bad")
