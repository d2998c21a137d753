"""Fakes the runtime's unit tests build an :class:`~ckpt_agent.runtime.context.Engine` from.

:class:`MemoryStorage` is a :class:`~ckpt_agent.storage.base.Storage` in a dict (the real
writer, readers and listing run over it); :class:`FakeCatalog`, :class:`FakeValidator` and
:class:`FakeFinalizer` stand in for the SQLite catalog, the validator (and its loader
process) and the post-commit pipeline, and record what they were asked. :func:`make_engine`
wires them into an ``Engine`` through its ``persist`` seam: no file storage, no SQLite, no
child process.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import torch

from ckpt_agent.errors import NotFoundError
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.persist.builder import PersistBuilder, PersistParts
from ckpt_agent.persist.finalize import FinalizeJob
from ckpt_agent.persist.writer import BlobIndex
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.runtime.core.context import Engine, Ranks
from ckpt_agent.runtime.dist.comm import Comm
from ckpt_agent.storage.base import ObjectInfo, ObjectWriter, Storage, validate_key, validate_prefix

T = TypeVar("T")


class _MemoryWriter(ObjectWriter):
    def __init__(self, storage: MemoryStorage, key: str) -> None:
        super().__init__(storage, key)
        self._mem = storage
        self._buf = bytearray()

    def _write(self, data: memoryview) -> None:
        self._buf += data

    def _publish(self) -> None:
        self._mem.put(self.key, bytes(self._buf))

    def _discard(self) -> None:
        self._buf = bytearray()


class MemoryStorage(Storage):
    """Objects in a dict (thread-safe). ``before_write(key)`` runs before each write or
    commit is published (a test blocks or fails writes there)."""

    def __init__(self, url: str = "memory://test") -> None:
        self.url = url
        self.objects: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.before_write: Callable[[str], None] | None = None

    def put(self, key: str, data: bytes) -> None:
        if self.before_write is not None:
            self.before_write(key)
        with self._lock:
            self.objects[key] = data

    def open_write(self, key: str) -> ObjectWriter:
        return _MemoryWriter(self, validate_key(key))

    def commit(self, key: str, data: bytes) -> None:
        t0 = time.perf_counter()
        self.put(validate_key(key), bytes(data))
        self._record_write(key, time.perf_counter() - t0, len(data))

    def _get(self, key: str) -> bytes:
        with self._lock:
            try:
                return self.objects[key]
            except KeyError:
                raise NotFoundError(f"{key} not found in {self.url}") from None

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        data = self._get(key)
        end = len(data) if length is None else start + length
        return data[start:end]

    def open_read(self, key: str) -> BinaryIO:
        return io.BytesIO(self._get(key))

    def stat(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, len(self._get(key)))

    def list(self, prefix: str = "", *, delimiter: str | None = None) -> Iterator[ObjectInfo]:
        if prefix:
            validate_prefix(prefix)
        with self._lock:
            items = sorted((k, len(v)) for k, v in self.objects.items() if k.startswith(prefix))
        seen: set[str] = set()
        for key, size in items:
            rest = key[len(prefix) :]
            if delimiter and delimiter in rest:
                sub = prefix + rest.split(delimiter, 1)[0] + delimiter
                if sub not in seen:
                    seen.add(sub)
                    yield ObjectInfo(sub, 0)
                continue
            yield ObjectInfo(key, size)

    def delete(self, key: str) -> None:
        with self._lock:
            self.objects.pop(key, None)


class FakeCatalog:
    """The catalog's calls, in memory (records as the listing of the storage says)."""

    def __init__(self) -> None:
        self.rows: dict[str, CheckpointRecord] = {}
        self.timings: dict[str, Mapping[str, float | None]] = {}
        self.statuses: list[tuple[str, CheckpointStatus, str]] = []
        self.closed = False

    def upsert(
        self,
        run_id: str,
        record: CheckpointRecord,
        *,
        status_reason: str | None = None,
        timings: Mapping[str, float | None] | None = None,
    ) -> None:
        del run_id, status_reason
        self.rows[record.id] = record
        if timings is not None:
            self.timings[record.id] = dict(timings)

    def set_status(
        self,
        run_id: str,
        ckpt_id: str,
        status: CheckpointStatus,
        reason: str = "",
        *,
        validate_s: float | None = None,
    ) -> bool:
        del run_id, validate_s
        self.statuses.append((ckpt_id, status, reason))
        rec = self.rows.get(ckpt_id)
        if rec is not None:
            self.rows[ckpt_id] = rec.with_status(status)
        return rec is not None

    def delete(self, run_id: str, ids: Iterable[str]) -> None:
        del run_id
        for i in ids:
            self.rows.pop(i, None)

    def rebuild_from_storage(self, storage: Storage, run_id: str) -> list[CheckpointRecord]:
        records = list_checkpoints(storage, run_id)
        self.rows = {r.id: r for r in records}
        return records

    def records(self, run_id: str) -> list[CheckpointRecord]:
        del run_id
        return sorted(self.rows.values(), key=lambda r: (r.step, r.tier.value))

    def close(self) -> None:
        self.closed = True


class FakeValidator:
    """No loader process; :class:`FakeFinalizer` gives the verdicts."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeFinalizer:
    """Records the jobs the validator thread hands it; ``fail`` makes ``finalize`` raise."""

    jobs: list[FinalizeJob] = field(default_factory=list)
    last_valid_step: int = -1
    valid: int = 0
    corrupted: int = 0
    report: Any = None
    fail: BaseException | None = None
    threads: list[str] = field(default_factory=list)

    def seed_last_valid_step(self, last_valid_step: int) -> None:
        self.last_valid_step = last_valid_step

    def finalize(self, job: FinalizeJob) -> None:
        self.threads.append(threading.current_thread().name)
        if self.fail is not None:
            raise self.fail
        self.jobs.append(job)
        self.valid += 1
        if not job.lightweight and job.step > self.last_valid_step:
            self.last_valid_step = job.step


@dataclass
class Fakes:
    """The fakes one :func:`make_engine` wired in."""

    storage: MemoryStorage
    catalog: FakeCatalog
    validator: FakeValidator
    finalizer: FakeFinalizer
    wiring: dict[str, Any] = field(default_factory=dict)
    """What the Engine handed the persisting parts (emit, anomalies, store_lock, ...)."""


def make_engine(
    config: AgentConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    distributed: bool = False,
    sharded: bool = False,
    storage: MemoryStorage | None = None,
) -> tuple[Engine, Fakes]:
    """An :class:`Engine` over fakes (``config.work_dir`` holds its decision log)."""
    fakes = Fakes(storage or MemoryStorage(), FakeCatalog(), FakeValidator(), FakeFinalizer())

    def persist(catalog_path: str | Path, **kwargs: Any) -> PersistParts:
        fakes.wiring.update(kwargs, catalog_path=catalog_path)
        index = BlobIndex()
        writer = PersistBuilder(config, storage=fakes.storage).writer(fakes.storage, index)
        return PersistParts(
            storage=fakes.storage,
            index=index,
            writer=writer,
            validator=fakes.validator,  # type: ignore[arg-type]
            catalog=fakes.catalog,  # type: ignore[arg-type]
            finalizer=fakes.finalizer,  # type: ignore[arg-type]
            owns_storage=False,
        )

    ranks = Ranks(rank, world_size, distributed, sharded)
    engine = Engine(config, ranks, None, gc_grace_s=0.0, persist=persist)
    close = engine.close

    def close_once() -> None:
        if engine in _OPEN:
            _OPEN.remove(engine)
            close()

    engine.close = close_once  # type: ignore[method-assign]
    _OPEN.append(engine)
    return engine, fakes


_OPEN: list[Engine] = []


def close_engines() -> None:
    """Close the engines a test left open (its decision log files)."""
    for engine in list(_OPEN):
        engine.close()


class ThreadWorld:
    """``n`` ranks as threads of one process: :meth:`comm` gives each its Comm, whose
    collectives meet at a barrier (a rank that never comes fails the others by timeout)."""

    def __init__(self, n: int, timeout_s: float = 20.0) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        self.slots: list[torch.Tensor | None] = [None] * n

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)

    def run(self, fn: Callable[[int], T]) -> list[T | BaseException]:
        """``fn(rank)`` on every rank at once; each rank's result or exception."""
        out: list[T | BaseException] = [RuntimeError("did not finish")] * self.n

        def one(rank: int) -> None:
            try:
                out[rank] = fn(rank)
            except BaseException as e:
                out[rank] = e

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out


class ThreadComm(Comm):
    """One rank's end of a :class:`ThreadWorld` (the real typed helpers over it)."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        super().__init__(None, rank, world.n)
        self.world = world

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        w = self.world
        w.slots[self.rank] = t.clone()
        w.barrier.wait()
        out = [s.clone() for s in w.slots if s is not None]
        w.barrier.wait()
        return out

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        w = self.world
        if self.rank == src:
            w.slots[src] = t.clone()
        w.barrier.wait()
        if self.rank != src:
            got = w.slots[src]
            assert got is not None
            t.copy_(got)
        w.barrier.wait()

    def _global(self, group_rank: int) -> int:
        return group_rank
