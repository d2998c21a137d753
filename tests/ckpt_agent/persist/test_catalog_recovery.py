"""An unreadable ``catalog.sqlite`` never stops a run (issue #28): the catalog is an index of
the manifests in storage, so a corrupt one is moved aside (kept, bounded) and rebuilt, and
one locked by another process is replaced by a private in-memory index after a bounded
wait, instead of a raw sqlite error from ``Checkpointer()``."""

from __future__ import annotations

import logging
import sqlite3
import struct
import time
from pathlib import Path

import pytest

from ckpt_agent.format.layout import validation_key
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist import catalog as catalog_mod
from ckpt_agent.persist.catalog import ASIDE_MARK, KEEP_ASIDE, Catalog
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"


def _checkpoints(store: LocalStorage, steps: tuple[int, ...] = (10, 20)) -> list[str]:
    writer = CheckpointWriter(store, RUN, chunk_bytes=4096)
    out = []
    for step in steps:
        meta = CheckpointMeta(RUN, step, Tier.PULSE, created_at=time.time(), sections=("model",))
        data = memoryview(struct.pack("<64f", *(float(i * step) for i in range(64))))
        rank = writer.write_rank(meta, 0, {}, [TensorSource("model/w", "float32", (64,), data)])
        done = writer.commit(meta, [rank])
        cid = checkpoint_id(Tier.PULSE, step)
        verdict = ValidationVerdict(cid, done.manifest_hash, CheckpointStatus.VALID)
        store.commit(validation_key(RUN, cid), verdict.to_bytes())
        out.append(cid)
    return out


def _filled(path: Path, rows: int = 300) -> None:
    """A sound catalog of ``rows`` rows (several pages), closed (its WAL checkpointed)."""
    cat = Catalog(path)
    for i in range(rows):
        cat.upsert(RUN, CheckpointRecord(id=f"pulse_step_{i:012d}", step=i, tier=Tier.PULSE))
    cat.close()


def _asides(path: Path) -> list[Path]:
    return sorted(
        p
        for p in path.parent.glob(f"{path.name}{ASIDE_MARK}*")
        if not p.name.endswith(("-wal", "-shm"))
    )


def test_a_garbage_catalog_is_moved_aside_and_rebuilt_from_storage(
    ck_store: LocalStorage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = _checkpoints(ck_store)
    path = tmp_path / "work" / "catalog.sqlite"
    path.parent.mkdir()
    garbage = b"\x1b[2J not a database " * 400
    path.write_bytes(garbage)
    (tmp_path / "work" / "catalog.sqlite-shm").write_bytes(b"stale")

    cat = Catalog(path)

    assert not cat.private and cat.moved_aside is not None
    assert cat.moved_aside.read_bytes() == garbage  # kept for forensics
    assert [r.id for r in cat.rebuild_from_storage(ck_store, RUN)] == ids
    assert [r.id for r in cat.records(RUN)] == ids and cat.journal_mode == "wal"
    cat.close()
    warning = next(r.getMessage() for r in caplog.records if "corrupt" in r.getMessage())
    assert "moved aside" in warning and "\x1b" not in warning
    reopened = Catalog(path)  # the rebuilt file is a sound catalog now
    assert reopened.moved_aside is None and [r.id for r in reopened.records(RUN)] == ids
    reopened.close()


def test_a_truncated_catalog_is_moved_aside_and_rebuilt(
    ck_store: LocalStorage, tmp_path: Path
) -> None:
    ids = _checkpoints(ck_store)
    path = tmp_path / "catalog.sqlite"
    _filled(path)
    size = path.stat().st_size
    assert size > 3 * 4096
    with open(path, "r+b") as f:
        f.truncate(size // 2)

    cat = Catalog(path)

    assert cat.moved_aside is not None and cat.moved_aside.stat().st_size == size // 2
    assert cat.records(RUN) == []  # the fresh index starts empty ...
    cat.rebuild_from_storage(ck_store, RUN)
    assert [r.id for r in cat.records(RUN)] == ids  # ... and is rebuilt from storage
    cat.close()


def test_a_foreign_database_is_not_taken_for_the_catalog(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE checkpoints (x TEXT)")
    db.commit()
    db.close()
    cat = Catalog(path)
    assert cat.moved_aside is not None
    cat.upsert(RUN, CheckpointRecord(id="pulse_step_000000000001", step=1, tier=Tier.PULSE))
    assert len(cat.records(RUN)) == 1
    cat.close()


def test_only_the_newest_corrupt_catalogs_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite"
    made = []
    for i in range(KEEP_ASIDE + 3):
        path.write_bytes(f"garbage {i}".encode() * 100)
        cat = Catalog(path)
        assert cat.moved_aside is not None
        made.append(cat.moved_aside)
        cat.close()
    assert _asides(path) == made[-KEEP_ASIDE:]
    assert [p.read_bytes()[:9] for p in _asides(path)] == [
        f"garbage {i}".encode()[:9] for i in range(3, KEEP_ASIDE + 3)
    ]


def test_a_locked_catalog_gives_a_private_index_after_a_bounded_wait(
    ck_store: LocalStorage,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ids = _checkpoints(ck_store)
    path = tmp_path / "catalog.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("CREATE TABLE other (x)")
    holder.execute("BEGIN EXCLUSIVE")
    before = path.read_bytes()
    monkeypatch.setattr(catalog_mod, "OPEN_WAIT_S", 0.2)
    caplog.set_level(logging.WARNING)

    cat = Catalog(path)

    assert cat.private and cat.moved_aside is None
    assert [r.id for r in cat.rebuild_from_storage(ck_store, RUN)] == ids
    cat.set_status(RUN, ids[0], CheckpointStatus.EXPIRED, "test")
    assert cat.counts(RUN) == {"expired": 1, "valid": 1}
    cat.close()
    assert path.read_bytes() == before and _asides(path) == []  # the holder's file untouched
    warning = next(r.getMessage() for r in caplog.records if "private" in r.getMessage())
    assert "locked by another process" in warning
    holder.execute("ROLLBACK")
    holder.close()
    again = Catalog(path)  # once released, the file is used again
    assert not again.private and again.journal_mode == "wal"
    again.close()


def test_an_unopenable_catalog_gives_a_private_index(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite"
    path.mkdir()  # a folder where the file belongs: sqlite cannot open it
    cat = Catalog(path)
    assert cat.private and path.is_dir()
    cat.upsert(RUN, CheckpointRecord(id="pulse_step_000000000001", step=1, tier=Tier.PULSE))
    assert len(cat.records(RUN)) == 1
    cat.close()
