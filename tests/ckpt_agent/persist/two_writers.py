"""Two writers on one run id, interleaved one storage operation at a time by a seeded
scheduler: the harness of ``test_two_writers.py`` (torch-free: the writer, retention and
blob GC of :mod:`ckpt_agent.persist`, as the engine drives them).

A *zombie* claims generation 1 and saves; a *holder* joins after the zombie's k-th
acknowledged save, claims generation 2 and saves. Each writer, after every
acknowledged save, applies a hostile retention (delete every listed checkpoint except
its own two newest acknowledged ones) and a blob GC with grace 0, both guarded by its
fence, as a single writer's engine does. The zombie's storage records every delete it
makes of something the holder committed (a violation).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from ckpt_agent.decide.retention import RetentionPlan
from ckpt_agent.errors import CheckpointFormatError, FencedError, NotFoundError
from ckpt_agent.format.fence import Fence, WriterRecord, claim
from ckpt_agent.format.layout import COMMIT, blob_key, steps_prefix
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta, CommitManifest, RankManifest
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.persist.housekeeping import apply_retention, gc_blobs
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.storage.base import ObjectInfo, ObjectWriter, Storage

RUN = "run-two"
KEEP = 2


class Lockstep:
    """One storage operation at a time, the writer chosen by a seeded RNG among the writers
    whose threads wait for one (each active writer gets to reach its next operation first;
    a writer busy elsewhere for over 0.2 s is not waited for)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.cond = threading.Condition()
        self.active: set[str] = set()
        self.waiting: dict[str, list[object]] = {}
        self.granted: object | None = None
        self.busy = False
        self.idle_since = time.monotonic()

    def join(self, name: str) -> None:
        with self.cond:
            self.active.add(name)
            self.cond.notify_all()

    def leave(self, name: str) -> None:
        with self.cond:
            self.active.discard(name)
            self.cond.notify_all()

    @contextlib.contextmanager
    def op(self, name: str) -> Iterator[None]:
        token = object()
        with self.cond:
            self.waiting.setdefault(name, []).append(token)
            self.cond.notify_all()
            while self.granted is not token:
                if not self.busy:
                    self._pick()
                if self.granted is not token:
                    self.cond.wait(0.02)
        try:
            yield
        finally:
            with self.cond:
                self.busy = False
                self.granted = None
                self.idle_since = time.monotonic()
                self.cond.notify_all()

    def _pick(self) -> None:
        ready = sorted(n for n, q in self.waiting.items() if q)
        if not ready:
            return
        lagging = any(n not in ready for n in self.active)
        if lagging and time.monotonic() - self.idle_since < 0.2:
            return
        name = self.rng.choice(ready)
        self.granted = self.waiting[name].pop(0)
        self.busy = True
        self.cond.notify_all()


class _Buffered(ObjectWriter):
    def __init__(self, storage: Scheduled, key: str) -> None:
        super().__init__(storage, key)
        self._sched = storage
        self._buf = bytearray()

    def _write(self, data: memoryview) -> None:
        self._buf += data

    def _publish(self) -> None:
        self._sched.write(self.key, bytes(self._buf))

    def _discard(self) -> None:
        self._buf = bytearray()


class Scheduled(Storage):
    """``inner``, each operation one turn of the :class:`Lockstep` (listings whole)."""

    def __init__(self, inner: Storage, lockstep: Lockstep, name: str, world: World) -> None:
        self.inner, self.lockstep, self.name, self.world = inner, lockstep, name, world
        self.url = inner.url
        self.atomic_create = inner.atomic_create

    def open_write(self, key: str) -> ObjectWriter:
        return _Buffered(self, key)

    def write(self, key: str, data: bytes | memoryview) -> None:
        with self.lockstep.op(self.name):
            self.inner.write(key, data)

    def commit(self, key: str, data: bytes) -> None:
        with self.lockstep.op(self.name):
            self.inner.commit(key, data)

    def create_exclusive(self, key: str, data: bytes) -> bool:
        with self.lockstep.op(self.name):
            return self.inner.create_exclusive(key, data)

    def read(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        with self.lockstep.op(self.name):
            return self.inner.read(key, start, length)

    def open_read(self, key: str) -> BinaryIO:
        with self.lockstep.op(self.name):
            return self.inner.open_read(key)

    def stat(self, key: str) -> ObjectInfo:
        with self.lockstep.op(self.name):
            return self.inner.stat(key)

    def list(self, prefix: str = "", *, delimiter: str | None = None) -> Iterator[ObjectInfo]:
        with self.lockstep.op(self.name):
            items = [*self.inner.list(prefix, delimiter=delimiter)]
        return iter(items)

    def delete(self, key: str) -> None:
        with self.lockstep.op(self.name):
            self._audit([key])
            self.inner.delete(key)

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = [*keys]
        with self.lockstep.op(self.name):
            self._audit(keys)
            return self.inner.delete_many(keys)

    def delete_prefix(self, prefix: str) -> int:
        with self.lockstep.op(self.name):
            self._audit([i.key for i in self.inner.list(prefix)])
            return self.inner.delete_prefix(prefix)

    def _audit(self, keys: list[str]) -> None:
        """The zombie deleting what the holder committed: a violation (atomic: this turn)."""
        if self.name != "zombie" or self.world.holder_generation is None:
            return
        hit = set(keys) & holder_committed(self.inner, self.world.holder_generation)
        if hit:
            self.world.violations.extend(sorted(hit))


def holder_committed(storage: Storage, generation: int) -> set[str]:
    """Every key a committed checkpoint of ``generation`` consists of (COMMIT, manifests,
    blobs)."""
    out: set[str] = set()
    prefix = steps_prefix(RUN)
    for info in storage.list(prefix):
        if not info.key.endswith("/" + COMMIT):
            continue
        try:
            commit = CommitManifest.from_bytes(storage.read(info.key), info.key)
        except (NotFoundError, CheckpointFormatError):
            continue
        if commit.meta.generation != generation:
            continue
        folder = info.key[: -len(COMMIT)]
        out.add(info.key)
        for ref in commit.ranks:
            key = folder + ref.key
            out.add(key)
            try:
                manifest = RankManifest.from_bytes(storage.read(key), key)
            except (NotFoundError, CheckpointFormatError):
                continue
            out |= {blob_key(RUN, d) for d in manifest.referenced_blobs()}
    return out


@dataclass
class World:
    holder_generation: int | None = None
    violations: list[str] = field(default_factory=list)
    zombie_claimed: bool = False
    zombie_acked: int = 0
    zombie_progress: threading.Condition = field(default_factory=threading.Condition)


@dataclass
class Outcome:
    acked: list[str] = field(default_factory=list)
    deleted_own: set[str] = field(default_factory=set)
    error: BaseException | None = None
    generation: int = 0


def tensors(name: str, step: int) -> list[TensorSource]:
    """A tensor both writers share (same bytes: same blobs) and one of this save's own."""
    shared = hashlib.sha256(b"frozen").digest() * 512  # 16 KiB
    own = b"".join(hashlib.sha256(f"{name}/{step}/{i}".encode()).digest() for i in range(512))
    return [
        TensorSource("frozen", "uint8", (len(shared),), memoryview(shared)),
        TensorSource("weights", "uint8", (len(own),), memoryview(own)),
    ]


def save(writer: CheckpointWriter, name: str, step: int) -> str:
    meta = CheckpointMeta(run_id=RUN, step=step, tier=Tier.FULL, created_at=time.time())
    written = writer.write_rank(meta, 0, {"who": name, "step": step}, tensors(name, step))
    writer.commit(meta, [written])
    return meta.checkpoint_id


def housekeeping(storage: Storage, fence: Fence, out: Outcome) -> None:
    """Delete everything listed but this writer's two newest acknowledged checkpoints, then
    collect blobs with grace 0 (both guarded by the fence, as the engine does)."""
    keep = set(out.acked[-KEEP:])
    doomed = [r.id for r in list_checkpoints(storage, RUN, include_heartbeat=False)]
    doomed = [c for c in reversed(doomed) if c not in keep]
    plan = RetentionPlan(delete=dict.fromkeys(doomed, "test"), deletion_order=tuple(doomed))
    deleted = apply_retention(storage, RUN, plan, guard=fence.check)
    out.deleted_own |= set(deleted) & set(out.acked)
    gc_blobs(storage, RUN, grace_s=0, guard=fence.check)


def run_writer(
    name: str,
    storage: Storage,
    lockstep: Lockstep,
    world: World,
    steps: list[int],
    out: Outcome,
    *,
    after_zombie_acks: int | None = None,
) -> None:
    if after_zombie_acks is not None:  # the holder: joins once the zombie got that far
        with world.zombie_progress:
            world.zombie_progress.wait_for(
                lambda: world.zombie_claimed and world.zombie_acked >= after_zombie_acks, 30
            )
    lockstep.join(name)
    writer = CheckpointWriter(storage, RUN, chunk_bytes=4096, inline_max_bytes=64)
    try:
        fence = claim(storage, RUN)
        out.generation = fence.generation
        writer.fence = fence
        if after_zombie_acks is not None:
            world.holder_generation = fence.generation
        else:
            with world.zombie_progress:
                world.zombie_claimed = True
                world.zombie_progress.notify_all()
        for step in steps:
            out.acked.append(save(writer, name, step))
            if name == "zombie":
                with world.zombie_progress:
                    world.zombie_acked += 1
                    world.zombie_progress.notify_all()
            housekeeping(storage, fence, out)
    except FencedError as e:
        out.error = e
    finally:
        writer.close()
        lockstep.leave(name)
        if name == "zombie":  # a zombie that stopped early lets the holder start anyway
            with world.zombie_progress:
                world.zombie_claimed, world.zombie_acked = True, 10**6
                world.zombie_progress.notify_all()


def scenario(inner: Storage, seed: int, *, same_steps: bool) -> tuple[Outcome, Outcome, World]:
    """One interleaving; returns (zombie, holder, world) after both writers stopped and the
    zombie tried one more save."""
    rng = random.Random(seed)
    lockstep, world = Lockstep(seed), World()
    zombie_steps = list(range(1, 9)) if same_steps else list(range(1, 17, 2))
    holder_steps = list(range(1, 7)) if same_steps else list(range(2, 14, 2))
    zombie, holder = Outcome(), Outcome()
    zs = Scheduled(inner, lockstep, "zombie", world)
    hs = Scheduled(inner, lockstep, "holder", world)
    threads = [
        threading.Thread(
            target=run_writer, args=("zombie", zs, lockstep, world, zombie_steps, zombie)
        ),
        threading.Thread(
            target=run_writer,
            args=("holder", hs, lockstep, world, holder_steps, holder),
            kwargs={"after_zombie_acks": rng.randrange(0, 4)},
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a writer hung"
    if zombie.error is None:  # it finished before the takeover: its next save is fenced
        lockstep.join("zombie")
        writer = CheckpointWriter(zs, RUN, chunk_bytes=4096, inline_max_bytes=64)
        writer.fence = Fence(zs, RUN, WriterRecord(generation=zombie.generation))
        try:
            save(writer, "zombie", 1000)
        except FencedError as e:
            zombie.error = e
        finally:
            writer.close()
            lockstep.leave("zombie")
    return zombie, holder, world


def surviving_problems(storage: Storage, holder: Outcome) -> list[str]:
    """The holder's acknowledged checkpoints it did not delete itself that are not listed,
    not its own, or do not verify (the project's listing and hash verification)."""
    listed = {r.id for r in list_checkpoints(storage, RUN, include_heartbeat=False)}
    problems = []
    for cid in holder.acked:
        if cid in holder.deleted_own:
            continue
        if cid not in listed:
            problems.append(f"{cid}: gone")
            continue
        raw = storage.read(f"{steps_prefix(RUN)}{cid}/{COMMIT}")
        gen = CommitManifest.from_bytes(raw).meta.generation
        if gen != holder.generation:
            problems.append(f"{cid}: COMMIT of generation {gen}")
        result = verify_hashes(storage, RUN, cid)
        if not result.ok:
            problems.append(f"{cid}: {result.errors[:2]}")
    return problems
