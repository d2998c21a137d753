"""The SQLite catalog, and retention/GC applied to storage."""

from __future__ import annotations

import struct
import time
from pathlib import Path

from ckpt_agent.decide.retention import plan_retention
from ckpt_agent.format.layout import blob_key, commit_key, rank_manifest_key, validation_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.catalog import BUSY_TIMEOUT_MS, Catalog
from ckpt_agent.persist.housekeeping import apply_retention, delete_checkpoint, gc_blobs
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import RetentionSpec, Tier
from ckpt_agent.records import CheckpointStatus, RetentionClass, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"


def _write(
    store: LocalStorage, w: CheckpointWriter, step: int, head_seed: int, score: float = 0.0
) -> str:
    frozen = b"".join(struct.pack("<f", i * 0.5) for i in range(4096))
    head = b"".join(struct.pack("<f", i * head_seed) for i in range(4096))
    meta = CheckpointMeta(
        run_id=RUN,
        step=step,
        tier=Tier.PULSE,
        created_at=time.time(),
        score=score,
        retention_class=RetentionClass.CRITICAL if score >= 0.8 else RetentionClass.ROUTINE,
        sections=("model",),
    )
    srcs = [
        TensorSource("model/frozen", "float32", (4096,), memoryview(frozen)),
        TensorSource("model/head", "float32", (4096,), memoryview(head)),
    ]
    done = w.commit(meta, [w.write_rank(meta, 0, {}, srcs)])
    cid = checkpoint_id(Tier.PULSE, step)
    store.commit(
        validation_key(RUN, cid),
        ValidationVerdict(cid, done.manifest_hash, CheckpointStatus.VALID).to_bytes(),
    )
    return cid


def test_wal_busy_timeout_and_rows(tmp_path: Path) -> None:
    cat = Catalog(tmp_path / "c.sqlite")
    assert cat.journal_mode == "wal"
    assert cat._db.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_MS == 30_000
    from ckpt_agent.records import CheckpointRecord

    rec = CheckpointRecord(
        id="pulse_step_000000000005",
        step=5,
        tier=Tier.PULSE,
        status=CheckpointStatus.PENDING,
        score=0.4,
        size_bytes=123,
        manifest_hash="a" * 64,
        prev_hash="b" * 64,
        world_size=2,
        approximate=True,
    )
    cat.upsert(RUN, rec, timings={"stall_s": 0.01, "persist_s": 0.2})
    assert cat.set_status(RUN, rec.id, CheckpointStatus.VALID, validate_s=0.05)
    assert not cat.set_status(RUN, "nope", CheckpointStatus.VALID)
    (got,) = cat.records(RUN)
    assert got == rec.with_status(CheckpointStatus.VALID)
    assert cat.timings(RUN, rec.id) == {"stall_s": 0.01, "persist_s": 0.2, "validate_s": 0.05}
    assert cat.counts(RUN) == {"valid": 1}
    # a second connection (ckpt ls while training) reads concurrently
    reader = Catalog(tmp_path / "c.sqlite")
    assert reader.get(RUN, rec.id) == got
    reader.close()
    cat.close()


def test_rebuild_from_storage_keeps_known_timings(ck_store: LocalStorage, tmp_path: Path) -> None:
    w = CheckpointWriter(ck_store, RUN, chunk_bytes=4096)
    a = _write(ck_store, w, 10, 1)
    b = _write(ck_store, w, 20, 2, score=0.9)
    cat = Catalog(tmp_path / "c.sqlite")
    cat.upsert(RUN, list_checkpoints(ck_store, RUN)[0], timings={"stall_s": 0.5})
    cat.upsert(
        RUN,
        list_checkpoints(ck_store, RUN)[0].__class__(
            id="pulse_step_000000000099", step=99, tier=Tier.PULSE
        ),
    )
    recs = cat.rebuild_from_storage(ck_store, RUN)
    assert [r.id for r in recs] == [a, b]
    assert [r.id for r in cat.records(RUN)] == [a, b]  # the row storage does not know is gone
    assert cat.timings(RUN, a)["stall_s"] == 0.5
    rec_b = cat.get(RUN, b)
    assert rec_b is not None and rec_b.retention_class == RetentionClass.CRITICAL
    cat.close()


def test_retention_then_gc_frees_only_unreferenced_blobs(ck_store: LocalStorage) -> None:
    w = CheckpointWriter(ck_store, RUN, chunk_bytes=4096)
    ids = [_write(ck_store, w, s, s) for s in (10, 20, 30)]
    _, m10 = read_checkpoint(ck_store, RUN, ids[0])
    frozen = m10.tensors["model/frozen"].chunks
    head10 = m10.tensors["model/head"].chunks
    plan = plan_retention(list_checkpoints(ck_store, RUN), RetentionSpec(routine_keep=1))
    assert plan.deletion_order == (ids[1], ids[0])
    assert apply_retention(ck_store, RUN, plan, dry_run=True) == [ids[1], ids[0]]
    assert len(list_checkpoints(ck_store, RUN)) == 3
    deleted = apply_retention(ck_store, RUN, plan)
    assert deleted == [ids[1], ids[0]]
    assert [r.id for r in list_checkpoints(ck_store, RUN)] == [ids[2]]
    dry = gc_blobs(ck_store, RUN, grace_s=0, dry_run=True)
    assert set(head10) <= set(dry.deleted)
    assert all(ck_store.exists(blob_key(RUN, d)) for d in dry.deleted)  # dry run: nothing gone
    res = gc_blobs(ck_store, RUN, grace_s=0)
    assert set(head10) <= set(res.deleted)
    assert not set(frozen) & set(res.deleted)  # still referenced by step 30
    for d in frozen:
        assert ck_store.exists(blob_key(RUN, d))
    for d in head10:
        assert not ck_store.exists(blob_key(RUN, d))
    assert res.freed_bytes > 0


def test_gc_grace_period_and_crash_leftovers(ck_store: LocalStorage) -> None:
    w = CheckpointWriter(ck_store, RUN, chunk_bytes=4096)
    cid = _write(ck_store, w, 10, 1)
    # a crash after writing blobs and the rank manifest, before the COMMIT
    meta = CheckpointMeta(run_id=RUN, step=20, tier=Tier.PULSE, sections=("model",))
    orphan = b"\x01" * 20_000
    w.write_rank(meta, 0, {}, [TensorSource("model/x", "uint8", (20_000,), memoryview(orphan))])
    delete_checkpoint(ck_store, RUN, cid)
    young = gc_blobs(ck_store, RUN)  # default grace: an hour
    assert young.deleted == [] and young.kept_young > 0 and young.stale_folders == []
    later = gc_blobs(ck_store, RUN, now=time.time() + 7200)
    assert later.stale_folders == ["pulse_step_000000000020"]
    assert later.kept_young == 0 and len(later.deleted) > 0
    assert list(ck_store.list(f"{RUN}/blobs/")) == []
    assert not ck_store.exists(commit_key(RUN, cid))


def test_gc_deletes_no_blob_while_a_manifest_is_unreadable(ck_store: LocalStorage) -> None:
    w = CheckpointWriter(ck_store, RUN, chunk_bytes=4096)
    ids = [_write(ck_store, w, s, s) for s in (10, 20)]
    _, m10 = read_checkpoint(ck_store, RUN, ids[0])
    delete_checkpoint(ck_store, RUN, ids[0])  # its head blobs are now unreferenced
    # a crash leftover (no COMMIT) whose manifest is garbage: deleted as a stale folder
    meta = CheckpointMeta(run_id=RUN, step=30, tier=Tier.PULSE, sections=("model",))
    w.write_rank(meta, 0, {}, [TensorSource("model/x", "uint8", (64,), memoryview(b"\x02" * 64))])
    (ck_store.root / rank_manifest_key(RUN, checkpoint_id(Tier.PULSE, 30), 0)).write_bytes(b"{")
    manifest = ck_store.root / rank_manifest_key(RUN, ids[1], 0)
    good = manifest.read_bytes()
    manifest.write_bytes(b"{not json")  # it might reference any blob
    blobs = sorted(i.key for i in ck_store.list(f"{RUN}/blobs/"))
    res = gc_blobs(ck_store, RUN, grace_s=0)
    assert res.deleted == [] and res.freed_bytes == 0
    assert [m.split(":")[0] for m in res.unreadable_manifests] == [
        rank_manifest_key(RUN, ids[1], 0)
    ]
    assert res.stale_folders == [checkpoint_id(Tier.PULSE, 30)]
    assert sorted(i.key for i in ck_store.list(f"{RUN}/blobs/")) == blobs  # nothing gone
    manifest.write_bytes(good)  # repaired: the next pass collects
    res = gc_blobs(ck_store, RUN, grace_s=0)
    assert not res.unreadable_manifests
    assert set(m10.tensors["model/head"].chunks) <= set(res.deleted)
