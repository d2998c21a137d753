"""The persisting agent: turns shared-memory snapshots into committed, validated checkpoints.

Runs as the pod's native sidecar container (``ckpt sidecar``, injected by the
operator with the same ``CKPT_*`` environment and mounts as the trainer) or,
for a local run, as a subprocess the :class:`~ckpt_agent.runtime.checkpointer.Checkpointer`
starts (``python -m ckpt_agent.flash.sidecar --exit-with-trainer``). Torch-free: it
starts in a fraction of a second and never unpickles anything.

What it does, in a loop (every ``--poll-s``):

* for every rank area under ``$CKPT_SHM_DIR/<run>/`` (:mod:`ckpt_agent.flash.shm`):
  takes the newest complete snapshot not handled yet (never a half-written
  one), writes it as that rank's part — chunk, de-duplicate, compress, hash,
  write — records its chunk hashes next to it (for in-place restarts), and
  releases the slot;
* the coordinator (the sidecar serving rank 0) waits until every rank's part
  of that checkpoint is in storage with the same save token, verifies each
  one against its hash, publishes ``COMMIT``, validates every rank (load
  check, shapes), records the verdict, updates the catalog, applies
  retention and collects unreferenced blobs;
* tells the trainer what happened (``persisted.json``: the commit hash or the
  error), so its scheduler and its ``wait``/``save_now`` see the result;
* watches each trainer's liveness (a lock the trainer holds for its life):
  when a trainer dies, its newest complete snapshot is persisted (it was
  already being handled; death never loses it);
* probes storage write latency and reads GPU error counts through NVML (when
  ``pynvml`` and a GPU are there; otherwise healthy), publishes them for the
  trainer's scheduler (``health.json``) and as Prometheus metrics, and serves
  ``/metrics``, ``/healthz`` and ``/readyz`` on ``CKPT_METRICS_PORT``.

SIGTERM (eviction, drain) starts an *emergency drain*: every complete
snapshot not yet persisted is persisted now, newest first, waiting for a
still-running trainer's final snapshot, and the process exits before the
grace period (``--grace-s``, default 25 s) ends. The operator's save-now
signal file, when it changes, makes the sidecar log the request and flush
whatever complete snapshot is pending (the trainer takes the new snapshot).
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from ckpt_agent.decide.retention import classify, plan_retention
from ckpt_agent.flash.shm import (
    Descriptor,
    PersistedMark,
    ShmArea,
    ShmReader,
    chunk_hashes,
    write_health,
)
from ckpt_agent.format.manifest import (
    CheckpointFormatError,
    CheckpointMeta,
    RankManifest,
    RankRef,
    library_versions,
    list_checkpoints,
    rank_manifest_key,
    sha256_hex,
)
from ckpt_agent.format.shuffle import NUMPY_SHUFFLER
from ckpt_agent.metrics import DecisionLog, Metrics
from ckpt_agent.persist.catalog import Catalog
from ckpt_agent.persist.housekeeping import ManifestCache, apply_retention, gc_blobs
from ckpt_agent.persist.validate import ValidationOutcome, Validator
from ckpt_agent.persist.writer import (
    BlobIndex,
    CheckpointWriter,
    CodecPolicy,
    TensorSource,
    WrittenCheckpoint,
    WrittenRank,
)
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import AnomalyEvent, CheckpointStatus, RetentionClass, rank_name
from ckpt_agent.storage import StorageOptions, open_storage
from ckpt_agent.storage.base import NotFoundError, Storage, StorageError

__all__ = ["GpuHealth", "Sidecar", "SidecarOptions", "StorageProbe", "main"]

log = logging.getLogger(__name__)

Json = Any
ENV_GRACE = "CKPT_GRACE_S"
#: Seconds the coordinator waits for the other ranks' parts before giving up on a checkpoint.
DEFAULT_COMMIT_TIMEOUT_S = 300.0


# --------------------------------------------------------------------------- system health


class GpuHealth:
    """GPU error counts through NVML (uncorrected ECC + critical XID events).

    ``None`` from :meth:`sample` means "not measured" (no ``pynvml``, no GPU,
    NVML unavailable): the scheduler treats it as healthy.
    """

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._events: Any = None
        self._xid = 0
        self.error: str | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            n = int(pynvml.nvmlDeviceGetCount())
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self._nvml = pynvml
        except Exception as e:  # no library, no driver, no device: not measured
            self.error = f"{type(e).__name__}: {e}"
            return
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for h in self._handles:
                with contextlib.suppress(Exception):
                    pynvml.nvmlDeviceRegisterEvents(
                        h, pynvml.nvmlEventTypeXidCriticalError, self._events
                    )
        except Exception:
            self._events = None

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    @property
    def devices(self) -> int:
        return len(self._handles)

    def sample(self) -> int | None:
        """Total GPU errors seen so far (ECC uncorrected, volatile + XID critical events)."""
        if not self.available:
            return None
        nv = self._nvml
        total = 0
        for h in self._handles:
            with contextlib.suppress(Exception):
                total += int(
                    nv.nvmlDeviceGetTotalEccErrors(
                        h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                    )
                )
        if self._events is not None:
            while True:
                try:
                    nv.nvmlEventSetWait_v2(self._events, 0)
                except Exception:  # NVMLError_Timeout: no (more) event
                    break
                self._xid += 1
        return total + self._xid

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                if self._events is not None:
                    self._nvml.nvmlEventSetFree(self._events)
                self._nvml.nvmlShutdown()
            self._nvml = None


class StorageProbe:
    """Times a small durable write (+ delete) to storage: the write-latency signal."""

    def __init__(self, storage: Storage, run_id: str, *, size: int = 4096) -> None:
        self.storage = storage
        host = socket.gethostname().replace("/", "_")[:64] or "host"
        self.key = f"{run_id}/health/probe-{host}-{os.getpid()}.bin"
        self.payload = os.urandom(size)
        self.last_ms: float | None = None
        self.last_error: str | None = None
        self.last_time = 0.0

    def run(self) -> float | None:
        t0 = time.perf_counter()
        try:
            self.storage.commit(self.key, self.payload)
            ms = (time.perf_counter() - t0) * 1000.0
            self.storage.delete(self.key)
        except (StorageError, OSError) as e:
            self.last_error = f"{type(e).__name__}: {e}"
            self.last_time = time.time()
            return None
        self.last_ms = ms
        self.last_error = None
        self.last_time = time.time()
        return ms


# --------------------------------------------------------------------------- metrics


class SidecarMetrics(Metrics):
    """The engine's checkpoint metrics plus the sidecar's own."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.snapshots = Counter(
            "ckpt_sidecar_snapshots",
            "Shared-memory snapshots handled, by outcome",
            ["outcome"],
            registry=r,
        )
        self.persist_seconds = Histogram(
            "ckpt_sidecar_persist_seconds",
            "Seconds from the snapshot (trainer) to its part in storage",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.last_persisted_step = Gauge(
            "ckpt_sidecar_last_persisted_step",
            "Newest step persisted from shared memory",
            registry=r,
        )
        self.last_persisted_step.set(-1)
        self.trainer_alive = Gauge(
            "ckpt_sidecar_trainer_alive",
            "1 while the rank's trainer holds its lock",
            ["rank"],
            registry=r,
        )
        self.trainer_deaths = Counter(
            "ckpt_sidecar_trainer_deaths", "Trainer processes seen dying", registry=r
        )
        self.emergency = Counter(
            "ckpt_sidecar_emergency_saves",
            "Snapshots persisted because of an emergency",
            ["trigger"],
            registry=r,
        )
        self.write_latency = Gauge(
            "ckpt_storage_write_latency_seconds", "Latest storage write-latency probe", registry=r
        )
        self.probe_errors = Counter(
            "ckpt_storage_probe_errors", "Failed storage write-latency probes", registry=r
        )
        self.gpu_errors = Gauge(
            "ckpt_gpu_errors", "GPU errors seen through NVML since the sidecar started", registry=r
        )
        self.healthy = Gauge("ckpt_sidecar_healthy", "1 while the sidecar loop runs", registry=r)


# --------------------------------------------------------------------------- options


@dataclass
class SidecarOptions:
    """How the sidecar runs (command-line flags)."""

    poll_s: float = 0.02
    grace_s: float = 25.0
    probe_every_s: float = 10.0
    commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S
    exit_with_trainer: bool = False
    """Local mode: exit once every trainer seen is dead and nothing is left to persist."""
    wait_for_trainer_s: float = 120.0
    """Local mode: give up when no trainer appeared within this time."""
    metrics_port: int | None = None
    """None: the config's port; 0: no HTTP server."""
    ranks: tuple[int, ...] | None = None
    """Serve only these ranks (default: every area that appears)."""


@dataclass
class _AreaState:
    reader: ShmReader
    claimed: bool = False
    seen_alive: bool = False
    alive: bool = False
    handled_seq: int = 0


@dataclass
class _Handled:
    desc: Descriptor
    written: WrittenRank
    persist_s: float
    token: str


# --------------------------------------------------------------------------- the sidecar


class Sidecar:
    """Persists shared-memory snapshots of one run (see the module doc)."""

    def __init__(
        self,
        config: AgentConfig,
        options: SidecarOptions | None = None,
        *,
        storage: Storage | None = None,
    ) -> None:
        if not config.shm_dir:
            raise ValueError("the sidecar needs a shared-memory directory (CKPT_SHM_DIR)")
        self.config = config
        self.options = options or SidecarOptions()
        self.run_id = config.run_id
        self.shm_dir = Path(config.shm_dir)
        self._own_storage = storage is None
        self.storage = storage or open_storage(config.storage_url, StorageOptions.from_env())
        work = Path(config.work_dir or self.shm_dir / self.run_id / ".sidecar-work")
        work.mkdir(parents=True, exist_ok=True)
        self.work_dir = work
        self.metrics = SidecarMetrics()
        self.events = DecisionLog(work / "sidecar.jsonl")
        ranks = self.options.ranks
        suffix = "" if not ranks else "." + "-".join(f"rank{r}" for r in ranks)
        self.catalog = Catalog(work / f"catalog.sidecar{suffix}.sqlite")  # one per persister
        comp = config.compression
        self.index = BlobIndex()
        self.writer = CheckpointWriter(
            self.storage,
            self.run_id,
            codec=CodecPolicy.from_spec(comp),
            index=self.index,
            shuffler=NUMPY_SHUFFLER,
        )
        self.validator = Validator(self.storage, self.run_id, config.validation)
        self.probe = StorageProbe(self.storage, self.run_id)
        self.gpu = GpuHealth()
        self._gpu_base: int | None = None
        self._gpu_total: int | None = None
        self._areas: dict[int, _AreaState] = {}
        self._gc_cache = ManifestCache()
        self._last_commit: tuple[int, str] | None = None
        self._stop = threading.Event()
        self._drain_deadline: float | None = None
        self._drain_reason = ""
        self._server: http.server.ThreadingHTTPServer | None = None
        self._loop_beat = 0.0
        self._started = time.monotonic()
        self._signal_seen: bytes | None = None
        self.persisted = 0
        self.failed = 0
        self._seed_index()

    # ------------------------------------------------------------------ setup

    def _seed_index(self) -> None:
        """Know the blobs of the newest committed checkpoint (de-duplication across restarts)."""
        try:
            records = [
                r
                for r in list_checkpoints(self.storage, self.run_id, include_heartbeat=False)
                if r.manifest_hash and r.status != CheckpointStatus.CORRUPTED
            ]
        except (StorageError, CheckpointFormatError):
            return
        if not records:
            return
        newest = records[-1]
        self._last_commit = (newest.step, newest.manifest_hash or "")
        from ckpt_agent.format.manifest import read_commit, read_rank_manifest

        with contextlib.suppress(StorageError, CheckpointFormatError, LookupError, ValueError):
            committed = read_commit(self.storage, self.run_id, newest.id)
            for ref in committed.commit.ranks:
                self.index.seed(read_rank_manifest(self.storage, self.run_id, committed, ref.rank))

    def _event(self, event: str, **fields: Any) -> None:
        self.events.write({"event": event, "time": time.time(), **fields})
        self.events.flush()

    # ------------------------------------------------------------------ areas

    def _discover(self) -> None:
        wanted = self.options.ranks
        ranks = set(ShmArea.ranks(self.shm_dir, self.run_id))
        if wanted is not None:
            ranks = set(wanted)
        for r in sorted(ranks):
            if r not in self._areas:
                reader = ShmReader(self.shm_dir, self.run_id, r)
                state = _AreaState(reader=reader)
                mark = reader.persisted()
                state.handled_seq = mark.seq if mark is not None else 0
                self._areas[r] = state
        for r, st in self._areas.items():
            if not st.claimed:
                st.claimed = st.reader.claim()
                if st.claimed:
                    self._event("serving", rank=r)
            alive = st.reader.trainer_alive()
            if alive and not st.alive:
                self._event("trainer_up", rank=r)
            if st.alive and not alive:
                self.metrics.trainer_deaths.inc()
                self._event("trainer_died", rank=r)
                log.warning("trainer of rank %d died: persisting its newest complete snapshot", r)
            st.alive = alive
            st.seen_alive = st.seen_alive or alive
            self.metrics.trainer_alive.labels(rank=str(r)).set(1 if alive else 0)

    def pending(self) -> list[tuple[int, Descriptor]]:
        """Areas with a complete snapshot not handled yet (newest per area)."""
        out = []
        for r, st in sorted(self._areas.items()):
            if not st.claimed:
                continue
            d = st.reader.latest()
            if d is not None and d.seq > st.handled_seq:
                out.append((r, d))
        return out

    # ------------------------------------------------------------------ one pass

    def run_once(self) -> int:
        """Discover areas and persist every pending snapshot once; returns how many."""
        self._discover()
        done = 0
        # other ranks' parts first: rank 0's commit waits for them
        for rank, desc in sorted(self.pending(), key=lambda x: x[0] == 0):
            st = self._areas[rank]
            trigger = None
            if not st.alive and st.seen_alive:
                trigger = "trainer_death"
            elif self._drain_deadline is not None:
                trigger = "sigterm"
            if self._persist_area(st, desc, trigger):
                done += 1
        self._poll_signal()
        return done

    def _persist_area(self, st: _AreaState, desc: Descriptor, trigger: str | None) -> bool:
        reader = st.reader
        t0 = time.perf_counter()
        handled: _Handled | None = None
        error = ""
        try:
            handled = self._write_part(reader, desc)
        except Exception as e:  # storage down, bad descriptor: report it, keep serving
            error = f"{type(e).__name__}: {e}"
            log.error("persisting %s of rank %d failed: %s", desc.checkpoint_id, desc.rank, e)
        if handled is None and not error:
            return False  # torn or overwritten meanwhile: nothing to do (a newer one comes)
        st.handled_seq = desc.seq
        committed: WrittenCheckpoint | None = None
        if handled is not None and desc.rank == 0:
            try:
                committed = self._commit(handled)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                log.error("committing %s failed: %s", desc.checkpoint_id, e)
        seconds = time.perf_counter() - t0
        ok = handled is not None and not error
        reader.mark(
            PersistedMark(
                seq=desc.seq,
                step=desc.step,
                checkpoint_id=desc.checkpoint_id,
                ok=ok,
                error=error,
                manifest_hash=None if committed is None else committed.manifest_hash,
                committed=committed is not None,
                persist_s=seconds,
                size_bytes=0 if committed is None else committed.size_bytes,
                time=time.time(),
            )
        )
        if ok:
            self.persisted += 1
            self.metrics.snapshots.labels(outcome="persisted").inc()
            self.metrics.persist_seconds.observe(max(0.0, time.time() - desc.created_at))
            self.metrics.last_persisted_step.set(desc.step)
            if trigger is not None:
                self.metrics.emergency.labels(trigger=trigger).inc()
        else:
            self.failed += 1
            self.metrics.snapshots.labels(outcome="failed").inc()
            self.metrics.persist_errors.inc()
        self._event(
            "persisted" if ok else "persist_failed",
            rank=desc.rank,
            seq=desc.seq,
            checkpoint=desc.checkpoint_id,
            step=desc.step,
            committed=committed is not None,
            manifest_hash=None if committed is None else committed.manifest_hash,
            seconds=round(seconds, 6),
            trigger=trigger,
            error=error or None,
        )
        if committed is not None:
            self._after_commit(handled, committed)  # type: ignore[arg-type]
        return True

    def _meta(self, desc: Descriptor) -> CheckpointMeta:
        m = desc.meta
        score = float(m.get("score", 0.0))
        rc_raw = m.get("retention_class")
        prev = m.get("prev_hash")
        resume_step = int(m.get("resume_step", -1))
        last = self._last_commit
        if last is not None and resume_step <= last[0] < desc.step and last[1]:
            prev = last[1]  # this sidecar committed something newer on the same branch
        versions = m.get("versions")
        return CheckpointMeta(
            run_id=self.run_id,
            step=desc.step,
            tier=desc.tier,
            world_size=desc.world_size,
            created_at=desc.created_at,
            score=score,
            components={str(k): float(v) for k, v in dict(m.get("components") or {}).items()},
            retention_class=RetentionClass(rc_raw)
            if rc_raw
            else classify(score, self.config.retention),
            reason=str(m.get("reason") or ""),
            anomaly=m.get("anomaly"),
            lightweight=bool(m.get("lightweight", False)),
            approximate=bool(m.get("approximate", False)),
            emergency=bool(m.get("emergency", False)),
            prev_hash=str(prev) if prev else None,
            sections=tuple(desc.tree),
            versions=dict(versions) if isinstance(versions, dict) else library_versions(),
        )

    def _write_part(self, reader: ShmReader, desc: Descriptor) -> _Handled | None:
        t0 = time.perf_counter()
        with reader.open(desc) as snap:
            if snap is None:
                return None
            meta = self._meta(desc)
            sources = [
                TensorSource(name, t.dtype, t.shape, snap.tensor(name))
                for name, t in desc.tensors.items()
            ]
            files = {name: bytes(snap.file(name)) for name in desc.files}
            try:
                written = self.writer.write_rank(meta, desc.rank, desc.tree, sources, files)
            except BaseException:
                self._record_hashes(reader, desc, snap_views=sources)
                raise
            self._record_hashes(reader, desc, written=written.manifest)
            del sources
        token = str(desc.meta.get("token") or "")
        return _Handled(desc, written, time.perf_counter() - t0, token)

    def _record_hashes(
        self,
        reader: ShmReader,
        desc: Descriptor,
        *,
        written: RankManifest | None = None,
        snap_views: Sequence[TensorSource] = (),
    ) -> None:
        """Chunk hashes of the snapshot (for an in-place restart that loads it from memory)."""
        try:
            out: dict[str, list[str]] = {}
            if written is not None:
                for name, t in written.tensors.items():
                    if t.inline is not None:
                        out[name] = [t.inline_sha256 or ""]
                    else:
                        out[name] = [written.blobs[c].raw_sha256 for c in t.chunks] or [
                            sha256_hex(b"")
                        ]
            else:
                for src in snap_views:
                    out[src.name] = chunk_hashes(src.data)
            if written is not None and self.writer.chunk_bytes != 16 * 1024 * 1024:
                return  # hashes only comparable at the standard chunk size
            reader.write_hashes(desc, out)
        except (OSError, ValueError):
            log.warning("could not record the hashes of %s", desc.checkpoint_id, exc_info=True)

    # ------------------------------------------------------------------ commit (coordinator)

    def _commit(self, own: _Handled) -> WrittenCheckpoint:
        desc = own.desc
        meta = self._meta(desc)
        ckpt_id = desc.checkpoint_id
        parts: dict[int, WrittenRank] = {0: own.written}
        deadline = time.monotonic() + self.options.commit_timeout_s
        delay = 0.01
        while len(parts) < desc.world_size:
            for r in range(1, desc.world_size):
                if r in parts:
                    continue
                part = self._read_part(ckpt_id, r, own.token)
                if part is not None:
                    parts[r] = part
            if len(parts) >= desc.world_size:
                break
            # The other ranks' parts may be ours to write (one sidecar serves every rank of
            # its pod): keep persisting them while waiting, or this would wait for itself.
            if self._persist_others():
                continue
            if time.monotonic() >= deadline or (self._stop.is_set() and not self._draining):
                missing = sorted(set(range(desc.world_size)) - set(parts))
                raise TimeoutError(
                    f"{ckpt_id}: the parts of rank(s) {missing} did not appear in storage "
                    f"within {self.options.commit_timeout_s:g} s: not committed"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        from ckpt_agent.format.parts import verify_part

        for r, p in parts.items():
            verify_part(self.storage, self.run_id, ckpt_id, p.ref)
            if p.manifest.meta.world_size != desc.world_size:
                raise CheckpointFormatError(f"{ckpt_id}: rank {r}'s part has another world size")
        return self.writer.commit(meta, [parts[r] for r in sorted(parts)])

    def _persist_others(self) -> bool:
        """Persist pending snapshots of the areas other than rank 0's; True if any was."""
        self._discover()
        done = False
        for rank, desc in self.pending():
            if rank != 0:
                done = self._persist_area(self._areas[rank], desc, None) or done
        return done

    def _read_part(self, ckpt_id: str, rank: int, token: str) -> WrittenRank | None:
        key = rank_manifest_key(self.run_id, ckpt_id, rank)
        try:
            raw = self.storage.read(key)
        except NotFoundError:
            return None
        try:
            m = RankManifest.from_bytes(raw, key)
        except CheckpointFormatError:
            return None  # another writer's partial view (never: manifests are atomic)
        progress = m.state.get("progress") if isinstance(m.state, dict) else None
        if token and (not isinstance(progress, dict) or progress.get("token") != token):
            return None  # a stale part of an earlier attempt at the same id
        ref = RankRef(
            rank=rank, key=f"{rank_name(rank)}.json", sha256=sha256_hex(raw), size=len(raw)
        )
        stats = m.stats
        return WrittenRank(
            manifest=m,
            ref=ref,
            bytes_new=int(stats.get("bytes_new", 0)) + len(raw),
            bytes_reused=int(stats.get("bytes_reused", 0)),
            blobs_new=int(stats.get("blobs_new", 0)),
            blobs_reused=int(stats.get("blobs_reused", 0)),
            raw_bytes=int(stats.get("raw_bytes", 0)),
        )

    def _after_commit(self, own: _Handled, committed: WrittenCheckpoint) -> None:
        desc = own.desc
        self._last_commit = (desc.step, committed.manifest_hash)
        tier = desc.tier.value
        self.metrics.save_latency.labels(tier=tier).observe(max(0.0, time.time() - desc.created_at))
        self.metrics.bytes_written.labels(tier=tier).inc(committed.size_bytes)
        record = committed.commit.record(committed.manifest_hash, CheckpointStatus.PENDING)
        record = replace(record, size_bytes=committed.size_bytes)
        self.catalog.upsert(
            self.run_id, record, timings={"stall_s": desc.stall_s, "persist_s": own.persist_s}
        )
        outcome = self._validate(desc, committed)
        self.catalog.set_status(
            self.run_id,
            outcome.checkpoint_id,
            outcome.status,
            outcome.reason,
            validate_s=outcome.duration_s,
        )
        self.metrics.validation.observe(outcome.duration_s)
        self.metrics.checkpoints.labels(tier=tier, status=outcome.status.value).inc()
        if outcome.valid and not bool(desc.meta.get("lightweight")):
            self.metrics.last_valid_step.set(desc.step)
        self._event(
            "validated" if outcome.valid else "corrupted",
            checkpoint=outcome.checkpoint_id,
            status=outcome.status.value,
            reason=outcome.reason or None,
            seconds=round(outcome.duration_s, 6),
        )
        try:
            self._retention(desc.world_size)
        except (StorageError, CheckpointFormatError) as e:
            log.warning("retention after %s failed: %s", desc.checkpoint_id, e)

    def _validate(self, desc: Descriptor, committed: WrittenCheckpoint) -> ValidationOutcome:
        """Load-check every rank's part (shapes against the snapshot for rank 0)."""
        ckpt_id = desc.checkpoint_id
        expected = {name: (t.dtype, t.shape) for name, t in desc.tensors.items()}
        total = ValidationOutcome(checkpoint_id=ckpt_id, status=CheckpointStatus.VALID)
        for ref in committed.commit.ranks:
            o = self.validator.validate(
                ckpt_id, expected if ref.rank == desc.rank else None, rank=ref.rank
            )
            total.duration_s += o.duration_s
            total.manifest_hash = o.manifest_hash or total.manifest_hash
            total.checks = sorted(set(total.checks) | set(o.checks))
            total.bad_blobs.extend(o.bad_blobs)
            if not o.valid and total.valid:
                total.status = o.status
                total.reason = f"rank {ref.rank}: {o.reason}"
        if total.manifest_hash and total.manifest_hash != committed.manifest_hash:
            total.status = CheckpointStatus.CORRUPTED
            total.reason = "the COMMIT changed after it was written"
        try:
            self.validator.record(total)
        except StorageError as e:
            log.warning("could not record the verdict on %s: %s", ckpt_id, e)
        if total.bad_blobs:
            self.index.forget(total.bad_blobs)
        return total

    def _retention(self, world_size: int) -> None:
        records = list_checkpoints(self.storage, self.run_id)
        pulse = self.config.tiers.pulse.base_interval
        anomalies = [
            AnomalyEvent(step=r.step, kind=r.anomaly, resolved_step=r.step + pulse)
            for r in records
            if r.anomaly
        ]
        plan = plan_retention(records, self.config.retention, anomalies, time.time())
        deleted = apply_retention(self.storage, self.run_id, plan)
        grace = 0.0 if world_size == 1 else 3600.0
        gc = gc_blobs(self.storage, self.run_id, grace_s=grace, cache=self._gc_cache)
        if gc.deleted:
            self.index.forget(gc.deleted)
        for cid in deleted:
            self.catalog.set_status(
                self.run_id,
                cid,
                CheckpointStatus.EXPIRED,
                f"deleted by retention: {plan.delete.get(cid, '')}",
            )
        if deleted or gc.deleted:
            self._event(
                "retention",
                deleted=deleted,
                blobs_deleted=len(gc.deleted),
                bytes_freed=gc.freed_bytes,
            )

    # ------------------------------------------------------------------ health

    def sample_health(self) -> dict[str, Json]:
        """Probe storage, read GPU errors, publish them for the trainer; returns the signals."""
        ms = self.probe.run()
        if ms is None:
            self.metrics.probe_errors.inc()
        else:
            self.metrics.write_latency.set(ms / 1000.0)
        gpu = self.gpu.sample()
        if gpu is not None:
            if self._gpu_base is None:
                self._gpu_base = gpu
            self._gpu_total = gpu - self._gpu_base
            self.metrics.gpu_errors.set(self._gpu_total)
        signals: dict[str, Json] = {
            "write_latency_ms": self.probe.last_ms,
            "probe_error": self.probe.last_error,
            "gpu_errors_total": self._gpu_total,
            "gpus": self.gpu.devices,
            "sidecar_pid": os.getpid(),
        }
        try:
            write_health(self.shm_dir, self.run_id, signals)
        except OSError as e:
            log.warning("could not publish health signals: %s", e)
        return signals

    def health(self) -> tuple[bool, dict[str, Json]]:
        """(healthy, details) for ``/healthz``: the loop runs (and the last probe's result)."""
        beat_age = time.monotonic() - self._loop_beat if self._loop_beat else None
        healthy = beat_age is not None and beat_age < max(30.0, 20 * self.options.poll_s)
        return healthy, {
            "healthy": healthy,
            "loop_age_s": beat_age,
            "storage_ok": self.probe.last_error is None,
            "write_latency_ms": self.probe.last_ms,
            "probe_error": self.probe.last_error,
            "gpu_errors": self._gpu_total,
            "gpu_devices": self.gpu.devices,
            "nvml": self.gpu.available,
            "persisted": self.persisted,
            "failed": self.failed,
            "areas": {
                str(r): {"trainer_alive": st.alive, "handled_seq": st.handled_seq}
                for r, st in self._areas.items()
            },
            "draining": self._drain_deadline is not None,
        }

    def serve_http(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics, /healthz, /readyz; returns the bound port (0: pick one)."""
        sidecar = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body = generate_latest(sidecar.metrics.registry)
                    self._send(200, body, CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/readyz", "/health"):
                    ok, details = sidecar.health()
                    body = json.dumps(details, sort_keys=True, default=str).encode()
                    self._send(200 if ok else 503, body, "application/json")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                del format, args

        srv = http.server.ThreadingHTTPServer((addr, port), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, name="ckpt-sidecar-http", daemon=True).start()
        self._server = srv
        return int(srv.server_address[1])

    # ------------------------------------------------------------------ signals

    @property
    def _draining(self) -> bool:
        return self._drain_deadline is not None

    def request_drain(self, reason: str) -> None:
        """Persist what is pending now and stop within the grace period (SIGTERM)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.options.grace_s
            self._drain_reason = reason
            self._event("drain", reason=reason, grace_s=self.options.grace_s)
        self._stop.set()

    def _poll_signal(self) -> None:
        path = self.config.signal_file
        if not path:
            return
        try:
            content = Path(path).read_bytes()
        except OSError:
            return
        if self._signal_seen is None:
            self._signal_seen = content
            return
        if content != self._signal_seen:
            self._signal_seen = content
            if content.strip():
                self._event("signal", request=content.decode(errors="replace").strip()[:200])
                self.metrics.emergency.labels(trigger="signal").inc()

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, frame: FrameType | None) -> None:
            del frame
            self.request_drain(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    # ------------------------------------------------------------------ main loop

    def _done_local(self) -> bool:
        """Local mode: every trainer seen is dead and nothing is pending."""
        if not self._areas:
            return time.monotonic() - self._started > self.options.wait_for_trainer_s
        if any(st.alive for st in self._areas.values()):
            return False
        if self.pending():
            return False
        # a trainer was here (it created its lock) and is gone, or never came
        was_here = any(
            st.seen_alive or (st.reader.dir / "trainer.lock").exists()
            for st in self._areas.values()
        )
        return was_here or time.monotonic() - self._started > self.options.wait_for_trainer_s

    def run(self, *, until: Callable[[], bool] | None = None) -> int:
        """The loop; returns the exit code (0)."""
        port = self.options.metrics_port
        if port is None:
            port = self.config.metrics_port
        if port:
            self.serve_http(port)
        self._event(
            "start",
            pid=os.getpid(),
            run_id=self.run_id,
            shm_dir=str(self.shm_dir),
            nvml=self.gpu.available,
        )
        next_probe = 0.0
        try:
            while True:
                self._loop_beat = time.monotonic()
                self.metrics.healthy.set(1)
                if time.monotonic() >= next_probe:
                    self.sample_health()
                    next_probe = time.monotonic() + self.options.probe_every_s
                self.run_once()
                if self._drain_deadline is not None:
                    alive = any(st.alive for st in self._areas.values())
                    left = self._drain_deadline - time.monotonic()
                    if (not alive and not self.pending()) or left <= 0:
                        break
                elif self.options.exit_with_trainer and self._done_local():
                    break
                if until is not None and until():
                    break
                self._stop.wait(self.options.poll_s)
                if self._stop.is_set() and self._drain_deadline is None:
                    break
        finally:
            self.metrics.healthy.set(0)
            self._event(
                "stop",
                persisted=self.persisted,
                failed=self.failed,
                drain=self._drain_reason or None,
            )
        return 0

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for st in self._areas.values():
            st.reader.release()
        self.validator.close()
        self.writer.close()
        self.gpu.close()
        self.events.close()
        self.catalog.close()
        if self._own_storage:
            self.storage.close()


# --------------------------------------------------------------------------- entry point


@dataclass
class _Args:
    config: AgentConfig
    options: SidecarOptions = field(default_factory=SidecarOptions)


def parse_args(argv: Sequence[str] | None = None) -> _Args:
    p = argparse.ArgumentParser(
        prog="ckpt sidecar",
        description="Persist shared-memory snapshots of a training run (flash checkpoints).",
    )
    p.add_argument("--config", help="agent config JSON (default: $CKPT_CONFIG + CKPT_* env)")
    p.add_argument("--shm-dir", help="shared-memory directory (default: $CKPT_SHM_DIR)")
    p.add_argument("--run-id")
    p.add_argument("--storage")
    p.add_argument("--poll-s", type=float, default=0.02)
    p.add_argument("--grace-s", type=float, default=None, help="SIGTERM drain deadline")
    p.add_argument("--probe-every-s", type=float, default=10.0)
    p.add_argument("--commit-timeout-s", type=float, default=DEFAULT_COMMIT_TIMEOUT_S)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--rank", type=int, action="append", help="serve only this rank (repeatable)")
    p.add_argument(
        "--exit-with-trainer",
        action="store_true",
        help="local mode: exit once the trainer is gone and everything is persisted",
    )
    p.add_argument("--wait-for-trainer-s", type=float, default=120.0)
    a = p.parse_args(argv)
    if a.config:
        config = AgentConfig.from_json(Path(a.config).read_text())
    else:
        config = AgentConfig.from_env()
    updates: dict[str, Any] = {}
    if a.shm_dir:
        updates["shm_dir"] = a.shm_dir
    if a.run_id:
        updates["run_id"] = a.run_id
    if a.storage:
        url = a.storage
        updates["storage_url"] = "file://" + url if url.startswith("/") else url
    if updates:
        config = config.model_copy(update=updates)
    grace = a.grace_s
    if grace is None:
        raw = os.environ.get(ENV_GRACE, "").strip()
        grace = float(raw) if raw else 25.0
    return _Args(
        config=config,
        options=SidecarOptions(
            poll_s=a.poll_s,
            grace_s=grace,
            probe_every_s=a.probe_every_s,
            commit_timeout_s=a.commit_timeout_s,
            exit_with_trainer=a.exit_with_trainer,
            wait_for_trainer_s=a.wait_for_trainer_s,
            metrics_port=a.metrics_port,
            ranks=tuple(a.rank) if a.rank else None,
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``ckpt sidecar`` / ``python -m ckpt_agent.flash.sidecar``."""
    logging.basicConfig(
        level=os.environ.get("CKPT_LOG_LEVEL", "INFO"),
        format="%(asctime)s ckpt-sidecar %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    args = parse_args(argv)
    if not args.config.shm_dir:
        sys.stderr.write("ckpt sidecar: no shared-memory directory (set CKPT_SHM_DIR)\n")
        return 2
    sidecar = Sidecar(args.config, args.options)
    sidecar.install_signal_handlers()
    try:
        return sidecar.run()
    finally:
        sidecar.close()


if __name__ == "__main__":
    raise SystemExit(main())
