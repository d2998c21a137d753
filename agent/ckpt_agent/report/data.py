"""What a report reads: a run's committed checkpoints, its decision logs and its audit log.

The storage is the truth for checkpoints (manifests, COMMITs, VALIDATION.json
verdicts, ``audit.log`` of manual recoveries); the pod's work directory
(``CKPT_WORK_DIR``) holds the decision logs (``decisions.rank<N>.jsonl``: every
scheduler decision, snapshot, commit or persist, validation verdict, retention action
and start/resume) and, in shared-memory (flash) mode, the persister's log
(``sidecar.jsonl``: persists with their bytes, validation verdicts, retention
actions; its events are tagged ``"source": "sidecar"``). Both may be hostile or
damaged: a line that is not a JSON object is counted and skipped, never fatal;
nothing is unpickled. Logs are streamed line by line: at most :data:`LINE_MAX`
bytes of a line are ever held, a longer line is skipped unread (counted apart,
:attr:`RunData.long_lines`), so a 600 MiB line costs no more memory than a short one.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_agent.errors import CheckpointFormatError, NotFoundError
from ckpt_agent.format.layout import audit_key, loads
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.persist.housekeeping import read_audit_tail
from ckpt_agent.records import CheckpointRecord
from ckpt_agent.report.summary import SIDECAR_SOURCE
from ckpt_agent.storage import Storage

__all__ = [
    "LINE_MAX",
    "LOG_GLOB",
    "SIDECAR_GLOB",
    "Progress",
    "RunData",
    "Skip",
    "iter_log",
    "load_run",
    "log_files",
]

#: The decision logs of one pod's work directory (one file per rank).
LOG_GLOB = "decisions.rank*.jsonl"
#: The shared-memory persister's log (the local persister's or the sidecar's).
SIDECAR_GLOB = "sidecar*.jsonl"
#: Longest decision-log line read, in bytes (a longer one is skipped unread, counted).
LINE_MAX = 1 << 20
#: Bytes read at a time while skipping the rest of an over-long line.
_SKIP_CHUNK = 1 << 20


class Skip(enum.Enum):
    """Why :func:`iter_log` skipped a line."""

    MALFORMED = "malformed"
    """Not a JSON object with a string ``event`` (damaged, truncated, hostile)."""
    TOO_LONG = "too long"
    """Over :data:`LINE_MAX` bytes: never read into memory."""


#: ``progress(what, done, total)``: ``done``/``total`` in bytes for logs, items otherwise.
Progress = Callable[[str, int, int], None]


@dataclass
class RunData:
    """Everything a run's report is built from."""

    run_id: str
    records: list[CheckpointRecord]
    """Committed checkpoints (heartbeats excluded), oldest first."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Decision-log entries of every rank, by time."""
    audit: list[dict[str, Any]] = field(default_factory=list)
    """Manual recoveries (``audit.log``)."""
    logs: list[str] = field(default_factory=list)
    """The log files read (decision logs and persister logs)."""
    skipped_lines: int = 0
    """Lines of the logs that were skipped: not JSON objects (damaged or truncated), or
    over :data:`LINE_MAX` bytes."""
    long_lines: int = 0
    """Of :attr:`skipped_lines`, those over :data:`LINE_MAX` bytes (skipped unread)."""


def log_files(work_dir: Path | None, pattern: str = LOG_GLOB) -> list[Path]:
    """The logs matching ``pattern`` in ``work_dir`` (none when it is None or missing)."""
    if work_dir is None or not work_dir.is_dir():
        return []
    return sorted(p for p in work_dir.glob(pattern) if p.is_file() and not p.is_symlink())


def _lines(f: BinaryIO) -> Iterator[tuple[bytes | None, int]]:
    """``(line, size)`` of each line of ``f``: the line's bytes, or None for one over
    :data:`LINE_MAX` bytes, whose rest is read and dropped in :data:`_SKIP_CHUNK` pieces."""
    while True:
        raw = f.readline(LINE_MAX + 1)
        if not raw:
            return
        if len(raw) <= LINE_MAX or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        size = len(raw)
        del raw
        while True:
            rest = f.readline(_SKIP_CHUNK)
            size += len(rest)
            if not rest or rest.endswith(b"\n"):
                break
        yield None, size


def iter_log(path: Path, progress: Progress | None = None) -> Iterator[dict[str, Any] | Skip]:
    """The JSON objects of one log, a :class:`Skip` for each line that is not one (or too
    long to read: bounded memory whatever the file holds)."""
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        for n, (raw, size) in enumerate(_lines(f)):
            done += size
            if progress is not None and n % 4096 == 0:
                progress(path.name, done, total)
            if raw is None:
                yield Skip.TOO_LONG
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):
                yield Skip.MALFORMED
                continue
            if isinstance(obj, dict) and isinstance(obj.get("event"), str):
                yield obj
            else:
                yield Skip.MALFORMED
    if progress is not None:
        progress(path.name, total, total)


def _read_audit(storage: Storage, run_id: str) -> list[dict[str, Any]]:
    """The audit log's entries (its newest lines only, see :func:`read_audit_tail`); a line
    that is not a JSON object, or one too long, deep or with absurd numbers, is skipped."""
    try:
        raw, _ = read_audit_tail(storage, run_id)
    except NotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for line in raw.splitlines():
        try:
            out.append(loads(line, f"{audit_key(run_id)} line", LINE_MAX))
        except CheckpointFormatError:
            continue
    return out


def _time_of(e: dict[str, Any]) -> float:
    t = e.get("time")
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else 0.0


def load_run(
    storage: Storage,
    run_id: str,
    work_dir: Path | Sequence[Path] | None = None,
    progress: Progress | None = None,
) -> RunData:
    """Read one run: checkpoints and audit log from storage, decision and persister logs
    from ``work_dir`` (or several: one per pod the run had, merged by time)."""
    if progress is not None:
        progress(f"listing {run_id}", 0, 1)
    records = list_checkpoints(storage, run_id, include_heartbeat=False)
    data = RunData(run_id, records, audit=_read_audit(storage, run_id))
    if progress is not None:
        progress(f"listing {run_id}", 1, 1)
    dirs = [work_dir] if work_dir is None or isinstance(work_dir, Path) else list(work_dir)
    for path, source in (
        (p, src)
        for d in dirs
        for pattern, src in ((LOG_GLOB, None), (SIDECAR_GLOB, SIDECAR_SOURCE))
        for p in log_files(d, pattern)
    ):
        data.logs.append(str(path))
        for obj in iter_log(path, progress):
            if isinstance(obj, Skip):
                data.skipped_lines += 1
                data.long_lines += obj is Skip.TOO_LONG
            else:
                data.events.append(obj if source is None else obj | {"source": source})
    data.events.sort(key=_time_of)
    return data
