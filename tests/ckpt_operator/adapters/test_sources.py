"""The storage-backed checkpoint source, on real checkpoints written by the agent's writer."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.format.heartbeat import Heartbeat, encode_heartbeats
from ckpt_agent.format.layout import commit_key, heartbeat_key, validation_key
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage import StorageError
from ckpt_agent.storage.fs import LocalStorage
from ckpt_operator.adapters.sources import (
    SECRET_TTL_S,
    StorageCheckpointSource,
    StorageSourceFactory,
    VerificationFailedError,
    storage_options_for,
)
from ckpt_operator.model.config import LocalPathGrant, TenancyConfig

RUN = "mnist-ddp-5f0c6a7e"


def write(writer: CheckpointWriter, step: int, tier: Tier, payload: bytes, prev: str | None) -> str:
    meta = CheckpointMeta(
        run_id=RUN, step=step, tier=tier, created_at=1000.0 + step, prev_hash=prev
    )
    tensors = [
        TensorSource("frozen", "uint8", (len(payload),), memoryview(payload)),
        TensorSource("head", "uint8", (8,), memoryview(step.to_bytes(8, "little"))),
    ]
    rank = writer.write_rank(meta, 0, {"step": step}, tensors)
    done = writer.commit(meta, [rank])
    writer.storage.commit(
        validation_key(RUN, meta.checkpoint_id),
        ValidationVerdict(
            meta.checkpoint_id, done.manifest_hash, CheckpointStatus.VALID
        ).to_bytes(),
    )
    return done.manifest_hash


@pytest.fixture
def store(tmp_path: Path) -> LocalStorage:
    storage = LocalStorage(tmp_path / "ckpt")
    writer = CheckpointWriter(
        storage, RUN, codec=CodecPolicy(codec="none"), chunk_bytes=4096, inline_max_bytes=0
    )
    frozen = os.urandom(3 * 4096)  # shared by every checkpoint (dedup)
    h = write(writer, 100, Tier.FULL, frozen, None)
    h = write(writer, 200, Tier.PULSE, frozen, h)
    write(writer, 300, Tier.PULSE, frozen, h)
    storage.commit(
        heartbeat_key(RUN, 0),
        encode_heartbeats(
            RUN, 0, [Heartbeat(step=310, time=5000.0), Heartbeat(step=311, time=5001.0)]
        ),
    )
    return storage


def test_lists_committed_checkpoints(store: LocalStorage) -> None:
    src = StorageCheckpointSource(store)
    records = src.list_checkpoints(RUN)
    assert [(r.id, r.status) for r in records] == [
        ("full_step_000000000100", CheckpointStatus.VALID),
        ("pulse_step_000000000200", CheckpointStatus.VALID),
        ("pulse_step_000000000300", CheckpointStatus.VALID),
        ("heartbeat_step_000000000311", CheckpointStatus.VALID),  # newest of the ring
    ]
    assert records[2].prev_hash == records[1].manifest_hash
    assert [r.id for r in src.list_checkpoints(RUN, include_heartbeat=False)] == [
        r.id for r in records[:3]
    ]
    assert src.progress(RUN) == [(310, 5000.0), (311, 5001.0)]
    assert src.progress("other-run") == []


def test_verify_detects_a_flipped_byte(store: LocalStorage, tmp_path: Path) -> None:
    src = StorageCheckpointSource(store)
    assert src.verify(RUN, "pulse_step_000000000300") is True
    # corrupt the blob only checkpoint 300 references (its "head" tensor)
    blobs = sorted((tmp_path / "ckpt" / RUN / "blobs").rglob("*"), key=lambda p: p.stat().st_mtime)
    newest = [p for p in blobs if p.is_file()][-1]
    data = bytearray(newest.read_bytes())
    data[0] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(VerificationFailedError, match="SHA-256"):
        src.verify(RUN, "pulse_step_000000000300")


def test_delete_then_gc_keeps_shared_blobs(store: LocalStorage, tmp_path: Path) -> None:
    src = StorageCheckpointSource(store, gc_grace_s=0.0, clock=lambda: time.time() + 10)
    blob_dir = tmp_path / "ckpt" / RUN / "blobs"
    before = {p.name for p in blob_dir.rglob("*") if p.is_file()}
    src.delete_checkpoint(RUN, "pulse_step_000000000200")
    assert [r.id for r in src.list_checkpoints(RUN, include_heartbeat=False)] == [
        "full_step_000000000100",
        "pulse_step_000000000300",
    ]
    assert not (tmp_path / "ckpt" / RUN / "steps" / "pulse_step_000000000200").exists()
    gc = src.collect_garbage(RUN)
    after = {p.name for p in blob_dir.rglob("*") if p.is_file()}
    assert len(gc.deleted) == 1 and len(before - after) == 1  # only 200's own "head" blob
    # what remains still verifies: the shared frozen blobs survived
    assert src.verify(RUN, "full_step_000000000100")
    assert src.verify(RUN, "pulse_step_000000000300")


def _age(paths: Any, seconds: float) -> None:
    for p in paths:
        if p.is_file():
            t = p.stat().st_mtime - seconds
            os.utime(p, (t, t))


def test_gc_spares_young_blobs_and_in_flight_manifests(store: LocalStorage, tmp_path: Path) -> None:
    src = StorageCheckpointSource(store)  # default grace: an hour
    src.delete_checkpoint(RUN, "pulse_step_000000000200")
    assert src.collect_garbage(RUN).deleted == []  # blobs are seconds old
    # an uncommitted checkpoint (rank manifest written, no COMMIT) protects its blobs too,
    # however old they are
    writer = CheckpointWriter(store, RUN, codec=CodecPolicy(codec="none"), inline_max_bytes=0)
    meta = CheckpointMeta(run_id=RUN, step=400, tier=Tier.PULSE)
    writer.write_rank(meta, 0, {}, [TensorSource("t", "uint8", (64,), memoryview(os.urandom(64)))])
    _age((tmp_path / "ckpt" / RUN / "blobs").rglob("*"), 2 * 3600)
    gc = src.collect_garbage(RUN)
    assert len(gc.deleted) == 1 and gc.stale_folders == []  # only 200's own "head" blob
    rank = tmp_path / "ckpt" / RUN / "steps" / "pulse_step_000000000400" / "rank_00000.json"
    assert rank.exists()
    from ckpt_agent.format.manifest import RankManifest

    manifest = RankManifest.from_bytes(rank.read_bytes())
    for digest in manifest.referenced_blobs():
        assert (tmp_path / "ckpt" / RUN / "blobs" / "sha256" / digest[:2] / digest).exists()


def test_gc_removes_stale_uncommitted_folders_and_their_blobs(
    store: LocalStorage, tmp_path: Path
) -> None:
    writer = CheckpointWriter(store, RUN, codec=CodecPolicy(codec="none"), inline_max_bytes=0)
    meta = CheckpointMeta(run_id=RUN, step=400, tier=Tier.PULSE)
    writer.write_rank(meta, 0, {}, [TensorSource("t", "uint8", (64,), memoryview(os.urandom(64)))])
    src = StorageCheckpointSource(store, clock=lambda: time.time() + 2 * 3600)  # a crash leftover
    gc = src.collect_garbage(RUN)
    assert gc.stale_folders == ["pulse_step_000000000400"] and len(gc.deleted) == 1
    assert not (tmp_path / "ckpt" / RUN / "steps" / "pulse_step_000000000400").exists()
    for ckpt_id in ("full_step_000000000100", "pulse_step_000000000300"):
        assert src.verify(RUN, ckpt_id)


def test_gc_collects_nothing_while_a_manifest_is_unreadable(
    store: LocalStorage, tmp_path: Path
) -> None:
    src = StorageCheckpointSource(store, gc_grace_s=0.0, clock=lambda: time.time() + 10)
    src.delete_checkpoint(RUN, "pulse_step_000000000200")
    rank = tmp_path / "ckpt" / RUN / "steps" / "pulse_step_000000000300" / "rank_00000.json"
    rank.write_bytes(b"{not json")
    gc = src.collect_garbage(RUN)
    assert gc.deleted == [] and gc.unreadable_manifests


def test_storage_options_follow_the_policy(fixture: Any) -> None:
    spec = CheckpointPolicySpec.model_validate(fixture("checkpointpolicy.json")["spec"])
    opts = storage_options_for(spec, access_key_id="AK", secret_access_key="SK")
    assert opts.endpoint_url == "http://minio.storage.svc:9000"
    assert opts.use_path_style and opts.region == "us-east-1"
    assert opts.access_key_id == "AK" and opts.secret_access_key == "SK"
    assert opts.part_size_bytes == 16 * 1024 * 1024


def test_factory_reads_the_credentials_secret(fixture: Any) -> None:
    spec = CheckpointPolicySpec.model_validate(fixture("checkpointpolicy.json")["spec"])
    asked: list[tuple[str, str]] = []

    async def missing(ns: str, name: str) -> dict[str, str] | None:
        asked.append((ns, name))
        return None

    factory = StorageSourceFactory(missing)
    with pytest.raises(StorageError, match="ml-team/ckpt-s3-credentials"):
        asyncio.run(factory("ml-team", "llm-finetune", spec))
    assert asked == [("ml-team", "ckpt-s3-credentials")]

    async def partial(ns: str, name: str) -> dict[str, str] | None:
        return {"AWS_ACCESS_KEY_ID": "AK"}

    with pytest.raises(StorageError, match="lacks"):
        asyncio.run(StorageSourceFactory(partial)("ml-team", "llm-finetune", spec))


def test_a_burst_reads_the_credentials_secret_once_per_ttl(fixture: Any) -> None:
    spec = CheckpointPolicySpec.model_validate(fixture("checkpointpolicy.json")["spec"])
    reads: list[str] = []
    keys = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"}

    async def secret(ns: str, name: str) -> dict[str, str] | None:
        reads.append(name)
        return dict(keys) if len(reads) != 3 else None  # the third read: deleted meanwhile

    now = [1000.0]
    tenancy = TenancyConfig(allowed_s3_endpoints=("http://minio.storage.svc:9000",))
    factory = StorageSourceFactory(secret, clock=lambda: now[0], tenancy=tenancy)

    async def opens(n: int) -> None:
        for _ in range(n):
            await factory("ml-team", "llm-finetune", spec)

    try:
        asyncio.run(opens(50))  # a burst of restarts: one read
        assert len(reads) == 1
        now[0] += SECRET_TTL_S  # stale: read again (a rotated key is used from now on)
        asyncio.run(opens(5))
        assert len(reads) == 2
        now[0] += SECRET_TTL_S
        with pytest.raises(StorageError, match="not found"):
            asyncio.run(opens(1))
        asyncio.run(opens(1))  # a missing Secret is not remembered: read at once again
        assert len(reads) == 4
    finally:
        factory.close()


def test_factory_caches_local_sources(tmp_path: Path) -> None:
    spec = CheckpointPolicySpec.model_validate(
        {"storage": {"type": "local", "local": {"path": str(tmp_path)}}}
    )

    async def never(ns: str, name: str) -> dict[str, str] | None:
        raise AssertionError("local storage needs no secret")

    grant = TenancyConfig(local_paths=(LocalPathGrant("ns", str(tmp_path)),))
    factory = StorageSourceFactory(never, tenancy=grant)

    async def twice() -> tuple[object, object]:
        return await factory("ns", "p", spec), await factory("ns", "p", spec)

    a, b = asyncio.run(twice())
    assert a is b and isinstance(a, StorageCheckpointSource)
    factory.close()


def test_a_hostile_commit_is_listed_as_corrupted_and_the_rest_kept(store: LocalStorage) -> None:
    """Issue #17: one forged COMMIT (a 5,000-digit number, 24 MiB of padding) or heartbeat
    ring never makes the operator's listing, verification or progress raise."""
    src = StorageCheckpointSource(store)
    key = commit_key(RUN, "pulse_step_000000000200")
    store.commit(key, store.read(key).replace(b'"score":', b'"score":' + b"9" * 5000 + b',"x":'))
    key = commit_key(RUN, "pulse_step_000000000300")
    store.commit(key, store.read(key) + b" " * (24 << 20))
    status = {r.id: r.status for r in src.list_checkpoints(RUN)}
    assert status["full_step_000000000100"] == CheckpointStatus.VALID
    assert status["pulse_step_000000000200"] == CheckpointStatus.CORRUPTED
    assert status["pulse_step_000000000300"] == CheckpointStatus.CORRUPTED
    with pytest.raises(VerificationFailedError, match="limit"):
        src.verify(RUN, "pulse_step_000000000300")
    store.commit(heartbeat_key(RUN, 0), b'{"format":"ckpt-operator.heartbeat","x":' + b"9" * 5000)
    assert src.progress(RUN) == []
