"""The sidecar itself: :class:`Sidecar`, its loop, and one pass over the pending snapshots.

Everything is built from the :class:`~ckpt_agent.policy.agent_config.AgentConfig`
by :class:`~ckpt_agent.persist.builder.PersistBuilder` (storage with the
policy's S3 options, writer, validator, catalog, finalize pipeline); the jobs
live next to this module: :mod:`.discovery` (areas, liveness), :mod:`.persisting`
(rank parts), :mod:`.commit` (the coordinator's commit), :mod:`.health`
(probes), :mod:`.drain` (SIGTERM, save-now), :mod:`.rehydration` (a restarted trainer's
snapshot from a peer's replica); the HTTP endpoints are a
:class:`~ckpt_agent.metrics.MetricsServer`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from ckpt_agent.errors import ReplicaError, ServeError
from ckpt_agent.flash.protocol import Descriptor, PersistedMark, atomic_write
from ckpt_agent.flash.replica.rehydrate import advertise
from ckpt_agent.flash.replica.replicator import Replicator
from ckpt_agent.flash.sidecar.commit import Coordinator, Superseded
from ckpt_agent.flash.sidecar.discovery import Areas, AreaState
from ckpt_agent.flash.sidecar.drain import Drain
from ckpt_agent.flash.sidecar.health import HealthMonitor
from ckpt_agent.flash.sidecar.metrics import SidecarMetrics
from ckpt_agent.flash.sidecar.options import SidecarOptions
from ckpt_agent.flash.sidecar.persisting import Handled, PartWriter
from ckpt_agent.flash.sidecar.rehydration import Rehydration
from ckpt_agent.flash.sidecar.step_marks import StepMarkRelay
from ckpt_agent.metrics import DecisionLog, MetricsServer, snapshot
from ckpt_agent.persist.builder import PersistBuilder
from ckpt_agent.persist.catalog import Catalog
from ckpt_agent.persist.finalize import anomalies_from_records
from ckpt_agent.persist.validate import Validator
from ckpt_agent.persist.writer import BlobIndex, CheckpointWriter, WrittenCheckpoint
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import Json
from ckpt_agent.storage.base import Storage
from ckpt_agent.text import clean

__all__ = ["Sidecar", "run_sidecar"]

log = logging.getLogger(__name__)


class Sidecar:
    """Persists shared-memory snapshots of one run (see :mod:`ckpt_agent.flash.sidecar`)."""

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
        work = Path(config.work_dir or self.shm_dir / self.run_id / ".sidecar-work")
        work.mkdir(parents=True, exist_ok=True)
        self.work_dir = work
        self.metrics = SidecarMetrics()
        self.events = DecisionLog(work / "sidecar.jsonl")
        ranks = self.options.ranks
        suffix = "" if not ranks else "." + "-".join(f"rank{r}" for r in ranks)
        self.parts = PersistBuilder(config, storage=storage).build(
            work / f"catalog.sidecar{suffix}.sqlite",  # one per persister
            metrics=self.metrics,
            emit=self._event,
            anomalies=anomalies_from_records(config.tiers.pulse.base_interval),
            tolerate_retention_errors=True,
        )
        self.part_writer = PartWriter(self.run_id, self.parts.writer, config.retention)
        self.coordinator = Coordinator(
            self.run_id,
            self.parts,
            self.part_writer,
            self.metrics,
            commit_timeout_s=self.options.commit_timeout_s,
        )
        self.areas = Areas(self.shm_dir, self.run_id, self.metrics, self._event, ranks=ranks)
        self.monitor = HealthMonitor(self.parts.storage, self.run_id, self.shm_dir, self.metrics)
        self.drain = Drain(
            self.options.grace_s, self.metrics, self._event, signal_file=config.signal_file
        )
        self._server: MetricsServer | None = None
        self._instance = secrets.token_hex(8)
        self._loop_beat = 0.0
        self._started = time.monotonic()
        self.persisted = 0
        self.failed = 0
        self.part_writer.seed(self.parts.storage)
        self.replicator = self._replicator()  # last: its threads start now
        self.rehydration = Rehydration(self.replicator, self._event)
        self.step_marks = StepMarkRelay(self.replicator) if self.replicator else None
        try:  # a trainer asks for a replica only from a sidecar that answers
            advertise(self.shm_dir, self.run_id)
        except OSError as e:
            log.warning("cannot advertise rehydration in %s: %s", self.shm_dir, clean(e))

    # ------------------------------------------------------------------ parts

    @property
    def storage(self) -> Storage:
        return self.parts.storage

    @property
    def writer(self) -> CheckpointWriter:
        return self.parts.writer

    @property
    def index(self) -> BlobIndex:
        return self.parts.index

    @property
    def validator(self) -> Validator:
        return self.parts.validator

    @property
    def catalog(self) -> Catalog:
        return self.parts.catalog

    def _event(self, event: str, **fields: Any) -> None:
        self.events.write({"event": event, "time": time.time(), **fields})
        self.events.flush()

    def _replicator(self) -> Replicator | None:
        """Peer replication (off by default). A setup that fails (no secret, port taken) is
        reported and the sidecar persists without it: checkpoints never wait for peers."""
        if self.options.replicas is None:
            return None
        try:
            replicator = Replicator(self.options.replicas, self.shm_dir, self.run_id)
        except (OSError, ValueError, ReplicaError) as e:
            log.error("peer replication is off: %s", clean(e))
            self._event("replication_off", error=str(e))
            return None
        self.metrics.watch_replication(replicator)
        return replicator

    # ------------------------------------------------------------------ one pass

    def pending(self) -> list[tuple[int, Descriptor]]:
        """Areas with a complete snapshot not handled yet (newest per area)."""
        return self.areas.pending()

    def run_once(self) -> int:
        """Discover areas, answer a restarted trainer's request for a replica, and persist
        every pending snapshot once; returns how many were persisted."""
        self.areas.discover()
        self.rehydration.poll(self.areas)
        if self.step_marks is not None:
            self.step_marks.poll(self.areas)
        done = 0
        # other ranks' parts first: rank 0's commit waits for them
        for rank, desc in sorted(self.pending(), key=lambda x: x[0] == 0):
            st = self.areas[rank]
            trigger = None
            if not st.alive and st.seen_alive:
                trigger = "trainer_death"
            elif self.drain.draining:
                trigger = "sigterm"
            if self._persist_area(st, desc, trigger):
                done += 1
        self.drain.poll_signal()
        return done

    def _record_memory_only(self, st: AreaState, desc: Descriptor) -> bool:
        """A memory-tier snapshot or a just-in-time save: hashes recorded, replicated, never
        written to storage."""
        reader = st.reader
        t0 = time.perf_counter()
        if not self.part_writer.record_only(reader, desc):
            return False
        st.handled_seq = desc.seq
        seconds = time.perf_counter() - t0
        self._event(
            "jit_recorded" if desc.jit else "memory_recorded",
            rank=desc.rank,
            seq=desc.seq,
            step=desc.step,
            seconds=round(seconds, 6),
        )
        self.metrics.snapshots.labels(outcome="recorded").inc()
        reader.mark(
            PersistedMark(
                seq=desc.seq,
                step=desc.step,
                checkpoint_id=desc.checkpoint_id,
                ok=True,
                error="",
                manifest_hash=None,
                committed=False,
                persist_s=seconds,
                size_bytes=0,
                time=time.time(),
            )
        )
        if self.replicator is not None:
            self.replicator.offer(reader, desc)
        return True

    def _persist_area(self, st: AreaState, desc: Descriptor, trigger: str | None) -> bool:
        if desc.memory_only:
            return self._record_memory_only(st, desc)
        reader = st.reader
        t0 = time.perf_counter()
        handled: Handled | None = None
        error = ""
        try:
            handled = self.part_writer.write_part(reader, desc)
        except Exception as e:  # storage down, bad descriptor: report it, keep serving
            error = f"{type(e).__name__}: {e}"
            log.error(
                "persisting %s of rank %d failed: %s", desc.checkpoint_id, desc.rank, clean(e)
            )
        if handled is None and not error:
            return False  # torn or overwritten meanwhile: nothing to do (a newer one comes)
        st.handled_seq = desc.seq
        committed: WrittenCheckpoint | None = None
        if handled is not None and desc.rank == 0:
            try:
                committed = self.coordinator.commit(
                    handled,
                    persist_others=self._persist_others,
                    abort=self.drain.stopping,
                    newer=functools.partial(self._newer_own, st, desc),
                )
            except Superseded as e:
                # as if this sidecar had skipped it like the other ranks did: no mark (the
                # newer snapshot's settles it for the trainer), the newer one persists next
                log.info("%s", clean(e))
                self._event(
                    "superseded", rank=0, seq=desc.seq, checkpoint=desc.checkpoint_id, why=str(e)
                )
                return True
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                log.error("committing %s failed: %s", desc.checkpoint_id, clean(e))
        seconds = time.perf_counter() - t0
        ok = handled is not None and not error
        try:
            self._count(desc, ok, trigger)
            self._event(
                "persisted" if ok else "persist_failed",
                rank=desc.rank,
                seq=desc.seq,
                checkpoint=desc.checkpoint_id,
                step=desc.step,
                tier=desc.tier,
                committed=committed is not None,
                manifest_hash=None if committed is None else committed.manifest_hash,
                seconds=round(seconds, 6),
                trigger=trigger,
                error=error or None,
                **({} if committed is None else committed.byte_counts()),
            )
        finally:  # last: what the trainer's wait() returns on, once log and counts say it
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
        if self.replicator is not None:  # persisted or not: a background push, never waited for
            self.replicator.offer(reader, desc)
        if handled is not None and committed is not None:
            self.coordinator.after_commit(handled, committed)
        return True

    def _count(self, desc: Descriptor, ok: bool, trigger: str | None) -> None:
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

    def _newer_own(self, st: AreaState, desc: Descriptor) -> str | None:
        """The checkpoint id of ``st``'s newest complete snapshot when newer than ``desc``."""
        latest = st.reader.latest()
        return latest.checkpoint_id if latest is not None and latest.seq > desc.seq else None

    def _persist_others(self) -> bool:
        """Persist pending snapshots of the areas other than rank 0's; True if any was."""
        self.areas.discover()
        done = False
        for rank, desc in self.pending():
            if rank != 0:
                done = self._persist_area(self.areas[rank], desc, None) or done
        return done

    # ------------------------------------------------------------------ health and HTTP

    def sample_health(self) -> dict[str, Json]:
        """Probe storage, read GPU errors, publish them for the trainer; returns the signals."""
        return self.monitor.sample()

    def health(self) -> tuple[bool, dict[str, Json]]:
        """(healthy, details) for ``/healthz``: the loop runs (and the last probe's result)."""
        beat_age = time.monotonic() - self._loop_beat if self._loop_beat else None
        healthy = beat_age is not None and beat_age < max(30.0, 20 * self.options.poll_s)
        return healthy, {
            "healthy": healthy,
            "loop_age_s": beat_age,
            **self.monitor.details(),
            "persisted": self.persisted,
            "failed": self.failed,
            "areas": self.areas.summary(),
            "draining": self.drain.draining,
            "replicas": None if self.replicator is None else self.replicator.summary(),
        }

    def publish_metrics(self) -> None:
        """The metrics, into every area served (``persister-metrics.json``), for a trainer
        with a local persister to serve (:meth:`ckpt_agent.metrics.Metrics.relay`). The
        sidecar container serves its own port instead: nothing reads the file there."""
        if not self.options.exit_with_trainer:
            return
        data = snapshot(self.metrics.registry, self._instance)
        for st in self.areas:
            if st.claimed:
                with contextlib.suppress(OSError):
                    atomic_write(st.reader.metrics_path, data)

    def serve_http(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics, /healthz, /readyz; returns the bound port (0: pick one)."""
        self._server = MetricsServer(
            self.metrics.registry, port, addr, health=self.health, name="ckpt-sidecar-http"
        )
        return self._server.port

    # ------------------------------------------------------------------ signals

    def request_drain(self, reason: str) -> None:
        """Persist what is pending now and stop within the grace period (SIGTERM)."""
        self.drain.request(reason)

    def install_signal_handlers(self) -> None:
        self.drain.install_signal_handlers()

    # ------------------------------------------------------------------ main loop

    def _done_local(self) -> bool:
        """Local mode: every trainer seen is dead and nothing is pending."""
        waited_out = time.monotonic() - self._started > self.options.wait_for_trainer_s
        if not len(self.areas):
            return waited_out
        if self.areas.any_alive() or self.pending():
            return False
        # a trainer was here (it created its lock) and is gone, or never came
        return self.areas.trainer_was_here() or waited_out

    def _should_stop(self, until: Callable[[], bool] | None) -> bool:
        if self.drain.draining:
            if not self.areas.any_alive() and not self.pending():
                return True
            if self.drain.time_left() <= 0:
                return True
        elif self.options.exit_with_trainer and self._done_local():
            return True
        return until is not None and until()

    def run(self, *, until: Callable[[], bool] | None = None) -> int:
        """The loop; returns the exit code (0)."""
        port = self.options.metrics_port
        if port is None:
            port = self.config.metrics_port
        if port:
            addr = self.config.metrics_addr
            try:
                self.serve_http(port, addr)
            except OSError as e:
                raise ServeError(
                    f"cannot serve the sidecar's /metrics and /healthz on {addr}:{port}: "
                    f"{e.strerror or e} (another process on the port? set CKPT_METRICS_PORT, "
                    "or CKPT_METRICS_ADDR to this pod's own address)"
                ) from None
        self._event(
            "start",
            pid=os.getpid(),
            run_id=self.run_id,
            shm_dir=str(self.shm_dir),
            nvml=self.monitor.gpu.available,
        )
        next_probe = 0.0
        try:
            while True:
                self._loop_beat = time.monotonic()
                self.metrics.healthy.set(1)
                probe = time.monotonic() >= next_probe
                if probe:
                    self.sample_health()
                    next_probe = time.monotonic() + self.options.probe_every_s
                if self.run_once() or probe:
                    self.publish_metrics()
                if self._should_stop(until):
                    break
                self.drain.stop.wait(self.options.poll_s)
                if self.drain.stopping():
                    break
        finally:
            self.metrics.healthy.set(0)
            self.publish_metrics()
            self._event(
                "stop",
                persisted=self.persisted,
                failed=self.failed,
                drain=self.drain.reason or None,
            )
        return 0

    def close(self) -> None:
        if self.replicator is not None:
            self.replicator.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        self.areas.release()
        self.monitor.close()
        self.events.close()
        self.parts.close()


def run_sidecar(config: AgentConfig, options: SidecarOptions | None = None) -> int:
    """Run a sidecar until it is done or drained (SIGTERM/SIGINT handled); the exit code.

    A signal that arrives while the sidecar is still being built (its log exists, its
    catalog and storage are being opened: seconds on a loaded node) is kept and starts
    the drain once it is built, instead of killing the process with nothing persisted."""
    early: list[str] = []

    def keep(signum: int, frame: FrameType | None) -> None:
        del frame
        early.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, keep)
    signal.signal(signal.SIGINT, keep)
    sidecar = Sidecar(config, options)
    sidecar.install_signal_handlers()
    for reason in early:
        sidecar.request_drain(reason)
    try:
        return sidecar.run()
    finally:
        sidecar.close()
