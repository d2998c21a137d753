"""Local SQLite catalog of checkpoints (an index; the manifests in storage are the truth).

One row per checkpoint: step, rank count, tier, status (+ reason), score,
retention class, size, hashes, flags and timings (snapshot stall, persist,
validation). WAL mode and a 30 s busy timeout, so ``ckpt ls`` can read while
the trainer writes. :meth:`Catalog.rebuild_from_storage` re-creates the rows
of a run from storage (keeping timings it already had), which is what the
engine does on :meth:`~ckpt_agent.runtime.checkpointer.Checkpointer.start`.

An unreadable catalog never stops training (docs/storage.md, "The local catalog"):

* **corrupt** (not a database, a malformed image, a failed ``quick_check``, a
  table that is not this catalog's): the file is moved aside as
  ``<name>.corrupt-<time>`` (with its ``-wal``; the newest :data:`KEEP_ASIDE`
  are kept for forensics, older ones removed) and a fresh catalog is created,
  which the start's :meth:`~Catalog.rebuild_from_storage` fills from storage;
* **locked** by another process beyond :data:`OPEN_WAIT_S`, or unopenable
  (permissions, I/O): this process uses a **private in-memory index** instead
  (:attr:`Catalog.private`), rebuilt from storage the same way, and logs why.
  Nothing reads the catalog across processes for a decision, so a private index
  loses nothing but its timings.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, RetentionClass
from ckpt_agent.storage.base import Storage
from ckpt_agent.text import clean

__all__ = ["BUSY_TIMEOUT_MS", "KEEP_ASIDE", "OPEN_WAIT_S", "Catalog"]

log = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 30_000
SCHEMA_VERSION = 1
#: How long opening waits for a catalog another process holds locked before this process
#: goes on with a private in-memory index (read when opening: a test may lower it).
OPEN_WAIT_S = 10.0
#: Corrupt catalogs kept beside the catalog for forensics (the newest; older ones removed).
KEEP_ASIDE = 2
#: What a moved-aside corrupt catalog's name carries after the catalog's name.
ASIDE_MARK = ".corrupt-"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id          TEXT    NOT NULL,
    id              TEXT    NOT NULL,
    step            INTEGER NOT NULL,
    tier            TEXT    NOT NULL,
    world_size      INTEGER NOT NULL DEFAULT 1,
    status          TEXT    NOT NULL,
    status_reason   TEXT    NOT NULL DEFAULT '',
    score           REAL    NOT NULL DEFAULT 0,
    retention_class TEXT,
    size_bytes      INTEGER NOT NULL DEFAULT 0,
    created_at      REAL    NOT NULL DEFAULT 0,
    manifest_hash   TEXT    NOT NULL DEFAULT '',
    prev_hash       TEXT,
    anomaly         TEXT,
    lightweight     INTEGER NOT NULL DEFAULT 0,
    approximate     INTEGER NOT NULL DEFAULT 0,
    emergency       INTEGER NOT NULL DEFAULT 0,
    reason          TEXT    NOT NULL DEFAULT '',
    stall_s         REAL,
    persist_s       REAL,
    validate_s      REAL,
    updated_at      REAL    NOT NULL,
    PRIMARY KEY (run_id, id)
);
CREATE INDEX IF NOT EXISTS checkpoints_step ON checkpoints (run_id, step);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

_COLUMNS = (
    "run_id, id, step, tier, world_size, status, status_reason, score, retention_class, "
    "size_bytes, created_at, manifest_hash, prev_hash, anomaly, lightweight, approximate, "
    "emergency, reason, stall_s, persist_s, validate_s, updated_at"
)


_COLUMN_NAMES = frozenset(c.strip() for c in _COLUMNS.split(","))


class _Corrupt(sqlite3.DatabaseError):
    """The file opened, but it is not a sound catalog."""


def _errorname(e: sqlite3.Error) -> str:
    return str(getattr(e, "sqlite_errorname", "") or "")


def _is_corrupt(e: sqlite3.Error) -> bool:
    return isinstance(e, _Corrupt) or _errorname(e).startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))


def _is_locked(e: sqlite3.Error) -> bool:
    name = _errorname(e)
    if name:
        return name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED"))
    return "locked" in str(e) or "busy" in str(e)


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Catalog:
    """Thread-safe (one connection, one lock) SQLite catalog.

    :attr:`private` is True when this process could not use the file (locked or
    unopenable) and keeps its index in memory; :attr:`moved_aside` names the corrupt
    file this open moved aside, if any (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.private = False
        self.moved_aside: Path | None = None
        self.journal_mode = ""
        self._db = self._open_or_recover()
        self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")

    def _open_or_recover(self) -> sqlite3.Connection:
        seen = _inode(self.path)
        try:
            return self._open(str(self.path))
        except sqlite3.Error as e:
            if not _is_corrupt(e):
                return self._private(e)
            first = e
        if _inode(self.path) == seen:  # not already replaced by another process
            try:
                self.moved_aside = _move_aside(self.path)
            except OSError as e:
                return self._private(e)
            log.warning(
                "catalog %s is corrupt (%s): moved aside as %s for forensics; a fresh one is "
                "rebuilt from the checkpoints in storage (the catalog is only their index)",
                clean(self.path),
                clean(first),
                clean(self.moved_aside.name),
            )
        try:
            return self._open(str(self.path))
        except sqlite3.Error as e:
            return self._private(e)

    def _open(self, where: str) -> sqlite3.Connection:
        wait_s = float(OPEN_WAIT_S)
        db = sqlite3.connect(where, timeout=wait_s, check_same_thread=False, isolation_level=None)
        try:
            db.execute(f"PRAGMA busy_timeout={int(wait_s * 1000)}")
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            db.execute("PRAGMA synchronous=NORMAL")
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if str(check).lower() != "ok":
                raise _Corrupt(f"quick_check: {str(check)[:200]}")
            names = {str(row[1]) for row in db.execute("PRAGMA table_info(checkpoints)")}
            if names and names != _COLUMN_NAMES:
                raise _Corrupt("its checkpoints table is not this catalog's")
            db.executescript(_SCHEMA)
            db.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )
        except BaseException:
            db.close()
            raise
        self.journal_mode = str(mode).lower()
        return db

    def _private(self, error: BaseException) -> sqlite3.Connection:
        why = (
            f"locked by another process for over {OPEN_WAIT_S:g} s"
            if isinstance(error, sqlite3.Error) and _is_locked(error)
            else "unusable"
        )
        log.warning(
            "catalog %s is %s (%s): this process keeps a private in-memory index instead, "
            "rebuilt from the checkpoints in storage (the catalog is only their index; "
            "nothing is lost but its timings)",
            clean(self.path),
            why,
            clean(error),
        )
        self.private = True
        return self._open(":memory:")

    # ------------------------------------------------------------------ writes

    def upsert(
        self,
        run_id: str,
        record: CheckpointRecord,
        *,
        status_reason: str | None = None,
        timings: Mapping[str, float | None] | None = None,
    ) -> None:
        """Insert or replace a checkpoint's row (timings not given are kept)."""
        t = dict(timings or {})
        reason = (
            status_reason if status_reason is not None else record.extra.get("status_reason", "")
        )
        with self._lock:
            old = self._db.execute(
                "SELECT stall_s, persist_s, validate_s FROM checkpoints WHERE run_id=? AND id=?",
                (run_id, record.id),
            ).fetchone()
            stall, persist, validate = old if old else (None, None, None)
            self._db.execute(
                f"INSERT OR REPLACE INTO checkpoints ({_COLUMNS}) VALUES "
                "(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    run_id,
                    record.id,
                    record.step,
                    record.tier.value,
                    record.world_size,
                    record.status.value,
                    reason,
                    record.score,
                    record.retention_class.value if record.retention_class else None,
                    record.size_bytes,
                    record.created_at,
                    record.manifest_hash,
                    record.prev_hash,
                    record.anomaly,
                    int(record.lightweight),
                    int(record.approximate),
                    int(record.emergency),
                    record.reason,
                    t.get("stall_s", stall),
                    t.get("persist_s", persist),
                    t.get("validate_s", validate),
                    time.time(),
                ),
            )

    def set_status(
        self,
        run_id: str,
        ckpt_id: str,
        status: CheckpointStatus,
        reason: str = "",
        *,
        validate_s: float | None = None,
    ) -> bool:
        """Change a row's status; False when there is no such row."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE checkpoints SET status=?, status_reason=?, "
                "validate_s=COALESCE(?, validate_s), updated_at=? WHERE run_id=? AND id=?",
                (status.value, reason, validate_s, time.time(), run_id, ckpt_id),
            )
            return cur.rowcount > 0

    def delete(self, run_id: str, ids: Iterable[str]) -> None:
        with self._lock:
            self._db.executemany(
                "DELETE FROM checkpoints WHERE run_id=? AND id=?", [(run_id, i) for i in ids]
            )

    def rebuild_from_storage(self, storage: Storage, run_id: str) -> list[CheckpointRecord]:
        """Replace the run's rows with what storage says (timings of known rows are kept)."""
        records = list_checkpoints(storage, run_id)
        with self._lock:
            old = {
                row[0]: row[1:]
                for row in self._db.execute(
                    "SELECT id, stall_s, persist_s, validate_s FROM checkpoints WHERE run_id=?",
                    (run_id,),
                )
            }
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM checkpoints WHERE run_id=?", (run_id,))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        for r in records:
            stall, persist, validate = old.get(r.id, (None, None, None))
            self.upsert(
                run_id, r, timings={"stall_s": stall, "persist_s": persist, "validate_s": validate}
            )
        return records

    # ------------------------------------------------------------------ reads

    def records(self, run_id: str) -> list[CheckpointRecord]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM checkpoints WHERE run_id=? ORDER BY step, tier",
                (run_id,),
            ).fetchall()
        return [_record(row) for row in rows]

    def get(self, run_id: str, ckpt_id: str) -> CheckpointRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM checkpoints WHERE run_id=? AND id=?", (run_id, ckpt_id)
            ).fetchone()
        return None if row is None else _record(row)

    def timings(self, run_id: str, ckpt_id: str) -> dict[str, float | None]:
        with self._lock:
            row = self._db.execute(
                "SELECT stall_s, persist_s, validate_s FROM checkpoints WHERE run_id=? AND id=?",
                (run_id, ckpt_id),
            ).fetchone()
        if row is None:
            return {}
        return {"stall_s": row[0], "persist_s": row[1], "validate_s": row[2]}

    def counts(self, run_id: str) -> dict[str, int]:
        """Status → number of checkpoints."""
        with self._lock:
            rows = self._db.execute(
                "SELECT status, COUNT(*) FROM checkpoints WHERE run_id=? GROUP BY status", (run_id,)
            ).fetchall()
        return {str(s): int(n) for s, n in rows}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _move_aside(path: Path) -> Path:
    """Rename a corrupt catalog (and its ``-wal``) to ``<name>.corrupt-<ns>``, drop its
    ``-shm``, and remove all but the newest :data:`KEEP_ASIDE` such files."""
    aside = path.with_name(f"{path.name}{ASIDE_MARK}{time.time_ns():020d}")
    os.replace(path, aside)
    wal = path.with_name(path.name + "-wal")
    if wal.exists():
        os.replace(wal, aside.with_name(aside.name + "-wal"))
    path.with_name(path.name + "-shm").unlink(missing_ok=True)
    kept = sorted(
        p
        for p in path.parent.glob(f"{path.name}{ASIDE_MARK}*")
        if not p.name.endswith(("-wal", "-shm"))
    )
    for old in kept[: max(0, len(kept) - KEEP_ASIDE)]:
        for f in (old, old.with_name(old.name + "-wal"), old.with_name(old.name + "-shm")):
            try:
                f.unlink(missing_ok=True)
            except OSError:
                log.warning("could not remove the old corrupt catalog %s", clean(f))
    return aside


def _record(row: tuple[object, ...]) -> CheckpointRecord:
    (
        _run,
        cid,
        step,
        tier,
        world,
        status,
        reason_s,
        score,
        rclass,
        size,
        created,
        mhash,
        prev,
        anomaly,
        light,
        approx,
        emerg,
        reason,
        _stall,
        _persist,
        _validate,
        _updated,
    ) = row
    extra = {"status_reason": str(reason_s)} if reason_s else {}
    return CheckpointRecord(
        id=str(cid),
        step=int(str(step)),
        tier=Tier(str(tier)),
        status=CheckpointStatus(str(status)),
        score=float(str(score)),
        retention_class=RetentionClass(str(rclass)) if rclass else None,
        size_bytes=int(str(size)),
        created_at=float(str(created)),
        manifest_hash=str(mhash),
        prev_hash=str(prev) if prev else None,
        anomaly=str(anomaly) if anomaly else None,
        lightweight=bool(light),
        approximate=bool(approx),
        emergency=bool(emerg),
        world_size=int(str(world)),
        reason=str(reason),
        extra=extra,
    )
