"""The writer's fence checks and exclusive publishes (:mod:`ckpt_agent.persist.fencing`),
and the guard of retention and blob GC."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ckpt_agent.decide.retention import RetentionPlan
from ckpt_agent.errors import FencedError, RetryableStorageError
from ckpt_agent.format.fence import Fence, WriterRecord, claim
from ckpt_agent.format.layout import blobs_prefix, commit_key, rank_manifest_key, sha256_hex
from ckpt_agent.format.manifest import CheckpointMeta, CommitManifest, RankManifest
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.persist.fencing import publish_commit, publish_manifest, republish_manifest
from ckpt_agent.persist.housekeeping import apply_retention, gc_blobs
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.storage.fs import LocalStorage

RUN = "r"


@pytest.fixture
def store(tmp_path: Path) -> LocalStorage:
    return LocalStorage(tmp_path / "root")


def _save(writer: CheckpointWriter, step: int, payload: bytes = b"w" * 4096) -> str:
    meta = CheckpointMeta(run_id=RUN, step=step, tier=Tier.FULL, created_at=time.time())
    src = TensorSource("t", "uint8", (len(payload),), memoryview(payload))
    part = writer.write_rank(meta, 0, {"step": step}, [src])
    writer.commit(meta, [part])
    return meta.checkpoint_id


def _writer(store: LocalStorage, fence: Fence | None) -> CheckpointWriter:
    w = CheckpointWriter(store, RUN, chunk_bytes=1024, inline_max_bytes=16)
    w.fence = fence
    return w


def test_manifests_record_the_generation_and_verify(store: LocalStorage) -> None:
    claim(store, RUN)
    w = _writer(store, claim(store, RUN))
    cid = _save(w, 1)
    commit = CommitManifest.from_bytes(store.read(commit_key(RUN, cid)))
    rank = RankManifest.from_bytes(store.read(rank_manifest_key(RUN, cid, 0)))
    assert commit.meta.generation == rank.meta.generation == 2
    assert verify_hashes(store, RUN, cid).ok
    assert _save(w, 1, b"x" * 4096) == cid  # a re-save of its own id replaces it
    assert verify_hashes(store, RUN, cid).ok
    w.close()


def test_the_holder_replaces_an_older_writers_checkpoint_at_its_id(store: LocalStorage) -> None:
    old = _writer(store, claim(store, RUN))
    cid = _save(old, 1, b"o" * 4096)
    new = _writer(store, claim(store, RUN))
    assert _save(new, 1, b"n" * 4096) == cid
    assert CommitManifest.from_bytes(store.read(commit_key(RUN, cid))).meta.generation == 2
    assert verify_hashes(store, RUN, cid).ok
    old.close()
    new.close()


def test_a_fenced_writer_stops_before_its_first_write_and_deletes_nothing(
    store: LocalStorage,
) -> None:
    old = _writer(store, claim(store, RUN))
    new = _writer(store, claim(store, RUN))
    cid = _save(new, 1)
    before = sorted(i.key for i in store.list())
    with pytest.raises(FencedError, match="taken over by a newer writer"):
        _save(old, 1, b"z" * 4096)
    with pytest.raises(FencedError):
        old.unpublish(cid)
    assert sorted(i.key for i in store.list()) == before
    assert verify_hashes(store, RUN, cid).ok
    old.close()
    new.close()


def test_a_newer_generations_commit_fences_without_its_claim(store: LocalStorage) -> None:
    newer = _writer(store, Fence(store, RUN, WriterRecord(generation=9)))
    cid = _save(newer, 1)
    older = _writer(store, Fence(store, RUN, WriterRecord(generation=3)))
    with pytest.raises(FencedError, match="committed by writer generation 9"):
        _save(older, 1)
    assert verify_hashes(store, RUN, cid).ok
    newer.close()
    older.close()


def test_the_holder_gives_up_on_a_key_someone_keeps_taking(
    store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    fence = claim(store, RUN)
    monkeypatch.setattr(store, "create_exclusive", lambda key, data: False)
    with pytest.raises(RetryableStorageError, match="keeps publishing here"):
        publish_commit(store, RUN, "full_step_000000000001", b"{}", fence)


def test_retention_and_gc_delete_nothing_once_the_guard_refuses(store: LocalStorage) -> None:
    w = _writer(store, None)
    ids = [_save(w, s, bytes([s]) * 4096) for s in (1, 2, 3)]
    store.write(f"{blobs_prefix(RUN)}{'0' * 64}", b"orphan")
    before = sorted(i.key for i in store.list())
    old = Fence(store, RUN, WriterRecord(generation=1))
    claim(store, RUN)
    claim(store, RUN)  # generation 2 exists: the old fence refuses
    plan = RetentionPlan(delete=dict.fromkeys(ids[:2], "t"), deletion_order=tuple(ids[:2]))
    with pytest.raises(FencedError):
        apply_retention(store, RUN, plan, guard=old.check)
    with pytest.raises(FencedError):
        gc_blobs(store, RUN, grace_s=0, guard=old.check)
    after = sorted(i.key for i in store.list() if "/writers/" not in i.key)
    assert after == before
    w.close()


def test_republish_replaces_only_its_own_manifest_while_holding(store: LocalStorage) -> None:
    """DCP's rank 0 publishes its manifest again with DCP's metadata (#28): only its own,
    and a fenced writer replaces nothing."""
    key = rank_manifest_key(RUN, "full_step_000000000001", 0)
    mine = claim(store, RUN)
    publish_manifest(store, key, b"first", mine)
    republish_manifest(store, key, b"second", mine, (sha256_hex(b"first"), 5))
    assert store.read(key) == b"second"
    store.delete(key)
    store.commit(key, b"theirs")  # someone else's at our key: never replaced
    with pytest.raises(RetryableStorageError, match="replaced this process's manifest"):
        republish_manifest(store, key, b"third", mine, (sha256_hex(b"second"), 6))
    assert store.read(key) == b"theirs"
    claim(store, RUN)  # a newer writer: fenced before anything
    with pytest.raises(FencedError):
        republish_manifest(store, key, b"third", mine, (sha256_hex(b"theirs"), 6))
    assert store.read(key) == b"theirs"
    republish_manifest(store, key, b"plain", None, ("", 0))  # no fence: replaced in place
    assert store.read(key) == b"plain"


def test_a_writer_woken_between_its_check_and_its_write_leaves_the_holders_verdict(
    store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the stress check's random-crash campaign hit: the old writer checks its
    fence and finds no COMMIT at the id it is about to save, then freezes (a partitioned
    node); a newer writer claims the run, commits that id and validates it; the old one
    wakes. Nothing it does from there on may touch the holder's checkpoint or verdict."""
    import ckpt_agent.persist.fencing as fencing
    from ckpt_agent.format.listing import list_checkpoints
    from ckpt_agent.format.verdict import ValidationVerdict
    from ckpt_agent.persist.verdicts import write_verdict
    from ckpt_agent.records import CheckpointStatus

    old = _writer(store, claim(store, RUN))
    holder: dict[str, str] = {}
    real = fencing._commit_generation

    def frozen_after_the_read(storage: LocalStorage, run_id: str, ckpt_id: str) -> int | None:
        found = real(storage, run_id, ckpt_id)  # nothing there yet
        if holder:  # the newer writer's own saves: no freeze
            return found
        holder["id"] = ""
        new = _writer(store, claim(store, RUN))  # meanwhile: the newer writer takes over
        cid = _save(new, 1)
        committed = CommitManifest.from_bytes(store.read(commit_key(RUN, cid)))
        digest = sha256_hex(store.read(commit_key(RUN, cid)))
        verdict = ValidationVerdict(
            checkpoint_id=cid,
            commit_sha256=digest,
            status=CheckpointStatus.VALID,
            reason="",
            validated_at=time.time(),
            checks=("stored hashes",),
            duration_s=0.0,
        )
        assert committed.meta.generation == 2 and write_verdict(store, RUN, verdict, digest)
        holder["id"] = cid
        new.close()
        return found

    monkeypatch.setattr(fencing, "_commit_generation", frozen_after_the_read)
    with pytest.raises(FencedError):
        _save(old, 1, b"o" * 4096)
    statuses = {r.id: r.status for r in list_checkpoints(store, RUN)}
    assert statuses[holder["id"]] == CheckpointStatus.VALID
    assert verify_hashes(store, RUN, holder["id"]).ok
    old.close()
