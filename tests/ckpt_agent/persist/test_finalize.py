"""The post-commit pipeline (validate → verdict → catalog → retention → GC) and its builder."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.errors import StorageError
from ckpt_agent.format.layout import blob_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.readers import read_validation
from ckpt_agent.format.termination import ENV_PATH, parse_report
from ckpt_agent.metrics import Metrics
from ckpt_agent.persist.builder import PersistBuilder, PersistParts
from ckpt_agent.persist.finalize import FinalizeJob, anomalies_from_records
from ckpt_agent.persist.writer import TensorSource
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions

EXPECTED = {"model/w": ("float32", (64, 64))}


def _write(parts: PersistParts, run: str, step: int) -> tuple[str, str]:
    data = b"".join(struct.pack("<f", (i % 97) * 0.25 + step) for i in range(64 * 64))
    src = [TensorSource("model/w", "float32", (64, 64), memoryview(data))]
    state = {"model": {"w": {"__tensor__": "model/w"}}}
    meta = CheckpointMeta(run_id=run, step=step, tier=Tier.PULSE, sections=("model",))
    committed = parts.writer.commit(meta, [parts.writer.write_rank(meta, 0, state, src)])
    record = committed.commit.record(committed.manifest_hash, CheckpointStatus.PENDING)
    parts.catalog.upsert(run, record)
    return checkpoint_id(Tier.PULSE, step), committed.manifest_hash


def _break_retention(parts: PersistParts, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(grace_s: float) -> Any:
        raise StorageError("storage down")

    monkeypatch.setattr(parts.finalizer, "apply_retention", broken)


def _build(
    cfg: AgentConfig, tmp_path: Path, store: LocalStorage
) -> tuple[PersistParts, Metrics, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []

    def emit(event: str, **fields: Any) -> None:
        events.append({"event": event, **fields})

    metrics = Metrics()
    parts = PersistBuilder(cfg, storage=store).build(
        tmp_path / "catalog.sqlite", metrics=metrics, emit=emit, gc_grace_s=0.0
    )
    return parts, metrics, events


def test_finalize_records_the_verdict_and_applies_retention(
    tmp_path: Path, ck_store: LocalStorage, ck_config: Callable[..., AgentConfig]
) -> None:
    cfg = ck_config(retention={"routineKeep": 1, "importantKeep": 1})
    parts, metrics, events = _build(cfg, tmp_path, ck_store)
    try:
        for step in (5, 10, 15):
            cid, digest = _write(parts, cfg.run_id, step)
            result = parts.finalizer.finalize(
                FinalizeJob(cid, Tier.PULSE, step, digest, expected=EXPECTED)
            )
            assert result.outcome.valid, result.outcome.reason
            rec = read_validation(ck_store, cfg.run_id, cid)
            assert rec is not None and rec.status == CheckpointStatus.VALID
        assert parts.finalizer.last_valid_step == 15 and parts.finalizer.valid == 3
        assert metrics.value("ckpt_last_valid_step") == 15
        assert metrics.value("ckpt_checkpoints_total", {"tier": "pulse", "status": "valid"}) == 3
        kept = [r.step for r in list_checkpoints(ck_store, cfg.run_id, include_heartbeat=False)]
        assert 15 in kept and len(kept) < 3
        assert [e["event"] for e in events].count("validated") == 3
        assert any(e["event"] == "retention" and e["deleted"] for e in events)
        assert result.retention is not None and result.retention.deleted
        expired = parts.catalog.get(cfg.run_id, checkpoint_id(Tier.PULSE, 5))
        assert expired is not None and expired.status == CheckpointStatus.EXPIRED
    finally:
        parts.close()


def test_finalize_flags_a_corrupted_blob_and_deletes_it(
    tmp_path: Path, ck_store: LocalStorage, ck_config: Callable[..., AgentConfig]
) -> None:
    cfg = ck_config()
    parts, metrics, events = _build(cfg, tmp_path, ck_store)
    try:
        cid, digest = _write(parts, cfg.run_id, 5)
        blob_dir = tmp_path / "store" / cfg.run_id / "blobs"
        blob = next(p for p in blob_dir.rglob("*") if p.is_file())
        blob.write_bytes(b"garbage")
        result = parts.finalizer.finalize(FinalizeJob(cid, Tier.PULSE, 5, digest))
        assert not result.outcome.valid and result.outcome.bad_blobs
        assert parts.finalizer.corrupted == 1
        labels = {"tier": "pulse", "status": "corrupted"}
        assert metrics.value("ckpt_checkpoints_total", labels) == 1
        (ev,) = [e for e in events if e["event"] == "corrupted"]
        assert ev["checkpoint"] == cid and ev["status"] == "corrupted" and ev["bad_blobs"]
        for d in result.outcome.bad_blobs:  # self-heal: the bad blob is gone
            assert not ck_store.exists(blob_key(cfg.run_id, d))
    finally:
        parts.close()


def test_finalize_tolerates_retention_errors_when_asked(
    tmp_path: Path,
    ck_store: LocalStorage,
    ck_config: Callable[..., AgentConfig],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = ck_config()
    metrics = Metrics()
    parts = PersistBuilder(cfg, storage=ck_store).build(
        tmp_path / "catalog.sqlite", metrics=metrics, tolerate_retention_errors=True
    )
    try:
        cid, digest = _write(parts, cfg.run_id, 5)
        _break_retention(parts, monkeypatch)
        result = parts.finalizer.finalize(FinalizeJob(cid, Tier.PULSE, 5, digest))
        assert result.outcome.valid and result.retention is None
    finally:
        parts.close()


def test_anomalies_from_records_protect_checkpoints_before_them(
    tmp_path: Path, ck_store: LocalStorage, ck_config: Callable[..., AgentConfig]
) -> None:
    cfg = ck_config()
    parts, _, _ = _build(cfg, tmp_path, ck_store)
    try:
        _write(parts, cfg.run_id, 5)
        records = list_checkpoints(ck_store, cfg.run_id, include_heartbeat=False)
        assert anomalies_from_records(5)(records) == []
    finally:
        parts.close()


def test_builder_applies_the_policys_s3_section(tmp_path: Path) -> None:
    cfg = AgentConfig.model_validate(
        {
            "storageUrl": "s3://bucket/prefix",
            "s3": {"region": "eu-west-1", "partSizeMb": 32, "maxConcurrency": 8, "maxAttempts": 5},
        }
    )
    opts = PersistBuilder(cfg, environ={}).storage_options()
    assert (opts.region, opts.part_size_bytes, opts.max_concurrency, opts.max_attempts) == (
        "eu-west-1",
        32 * 1024 * 1024,
        8,
        5,
    )
    local = AgentConfig.model_validate({"storageUrl": (tmp_path / "s").as_uri(), "s3": {}})
    assert PersistBuilder(local, environ={}).storage_options().part_size_bytes == 16 * 1024 * 1024


def test_the_validators_loader_gets_the_policys_s3_section(
    ck_store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader child opens storage from its environment: the builder hands it the options
    it built (endpoint, attempts, part size from the config), not only the pod's CKPT_S3_*."""
    monkeypatch.setenv("CKPT_S3_MAX_ATTEMPTS", "2")  # the pod's env: the policy overrides it
    cfg = AgentConfig.model_validate(
        {
            "storageUrl": "s3://bucket/prefix",
            "s3": {"endpoint": "http://minio.example:9000", "maxAttempts": 7, "partSizeMb": 32},
        }
    )
    builder = PersistBuilder(cfg, storage=ck_store)
    validator = builder.validator(ck_store)
    try:
        child = StorageOptions.from_env(validator.env)
        assert child == builder.storage_options()
        assert (child.endpoint_url, child.max_attempts, child.part_size_bytes) == (
            "http://minio.example:9000",
            7,
            32 * 1024 * 1024,
        )
        assert validator.env.get("PATH") == os.environ.get("PATH")  # the rest of the env stays
    finally:
        validator.close()


def test_finalize_rewrites_the_termination_report_after_each_verdict(
    tmp_path: Path, ck_store: LocalStorage, ck_config: Callable[..., AgentConfig]
) -> None:
    cfg = ck_config(retention={"routineKeep": 1, "importantKeep": 1})
    report_path = tmp_path / "termination-log"
    metrics = Metrics()
    parts = PersistBuilder(cfg, storage=ck_store, environ={ENV_PATH: str(report_path)}).build(
        tmp_path / "catalog.sqlite", metrics=metrics, gc_grace_s=0.0
    )
    try:
        assert parts.finalizer.report is not None
        steps = []
        for step in (5, 10, 15):
            cid, digest = _write(parts, cfg.run_id, step)
            result = parts.finalizer.finalize(
                FinalizeJob(cid, Tier.PULSE, step, digest, expected=EXPECTED)
            )
            report = parse_report(report_path.read_bytes())
            assert report.run_id == cfg.run_id
            steps = [c.step for c in report.checkpoints]
            assert steps[0] == step  # the checkpoint just verified is reported
            assert result.retention is not None
            # what retention deleted is not reported any more
            assert not set(result.retention.deleted) & {c.id for c in report.checkpoints}
        kept = [r.step for r in list_checkpoints(ck_store, cfg.run_id, include_heartbeat=False)]
        assert steps == sorted(kept, reverse=True)
    finally:
        parts.close()


def test_a_verdict_is_reported_when_retention_fails_and_a_corrupted_one_too(
    tmp_path: Path,
    ck_store: LocalStorage,
    ck_config: Callable[..., AgentConfig],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = ck_config()
    report_path = tmp_path / "termination-log"
    parts = PersistBuilder(cfg, storage=ck_store, environ={ENV_PATH: str(report_path)}).build(
        tmp_path / "catalog.sqlite", metrics=Metrics(), tolerate_retention_errors=True
    )
    try:
        good, good_digest = _write(parts, cfg.run_id, 5)
        bad, bad_digest = _write(parts, cfg.run_id, 10)
        _break_retention(parts, monkeypatch)
        parts.finalizer.finalize(FinalizeJob(good, Tier.PULSE, 5, good_digest, expected=EXPECTED))
        report = parse_report(report_path.read_bytes())  # from the catalog: retention failed
        assert [(c.id, c.status) for c in report.checkpoints] == [(good, "valid")]
        wrong = {"model/w": ("float32", (8, 8))}  # the verdict: corrupted (shape mismatch)
        result = parts.finalizer.finalize(
            FinalizeJob(bad, Tier.PULSE, 10, bad_digest, expected=wrong)
        )
        assert not result.outcome.valid and result.retention is None
        report = parse_report(report_path.read_bytes())
        assert [(c.id, c.status) for c in report.checkpoints] == [
            (bad, "corrupted"),
            (good, "valid"),
        ]
        assert report.checkpoints[0].verdict_at >= report.checkpoints[0].created_at
    finally:
        parts.close()


def test_a_seeded_last_valid_step_is_not_lowered_by_an_older_verdict(
    tmp_path: Path, ck_store: LocalStorage, ck_config: Callable[..., AgentConfig]
) -> None:
    """A resume seeds the newest valid step storage held; a checkpoint validated later at a
    lower step (the run resumed from an older one) leaves it, a newer one raises it."""
    cfg = ck_config()
    parts, metrics, _ = _build(cfg, tmp_path, ck_store)
    try:
        parts.finalizer.seed_last_valid_step(20)
        for step, expected in ((10, 20), (25, 25)):
            cid, digest = _write(parts, cfg.run_id, step)
            parts.finalizer.finalize(FinalizeJob(cid, Tier.PULSE, step, digest, expected=EXPECTED))
            assert parts.finalizer.last_valid_step == expected
        assert metrics.value("ckpt_last_valid_step") == 25
    finally:
        parts.close()
