"""Prometheus metrics, the JSON Lines decision log, and optional TensorBoard scalars.

Every :class:`~ckpt_agent.runtime.checkpointer.Checkpointer` owns one :class:`Metrics` with
its own ``CollectorRegistry`` (tests stay isolated; a process can run several
checkpointers). ``serve(port)`` starts the HTTP exporter on that registry.

=========================================== ==========================================
``ckpt_save_latency_seconds{tier}``          histogram: snapshot → commit (persist time)
``ckpt_stall_seconds{tier}``                 histogram: training-thread stall per save
``ckpt_validation_seconds``                  histogram: validation time per checkpoint
``ckpt_bytes_written_total{tier}``           new bytes written (de-duplicated blobs excluded)
``ckpt_bytes_reused_total{tier}``            bytes referenced from earlier checkpoints
``ckpt_checkpoints_total{tier,status}``      checkpoints by validation outcome
``ckpt_last_valid_step``                     newest valid weights checkpoint's step
``ckpt_persist_errors_total``                failed background persists
``ckpt_heartbeat_errors_total``              failed heartbeat writes
``ckpt_backpressure_total{action}``          saves deferred or waited for (persist busy)
``ckpt_recovery_attempts_total``             checkpoints tried by the ladder
``ckpt_recovery_successes_total``            successful restores
``ckpt_score`` / ``ckpt_interval_steps``     the scheduler's current score and interval
=========================================== ==========================================
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["DecisionLog", "Metrics", "TensorBoard"]

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


class Metrics:
    """The checkpointer's Prometheus metrics (own registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.save_latency = Histogram(
            "ckpt_save_latency_seconds",
            "Seconds from snapshot to commit, per tier",
            ["tier"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.stall = Histogram(
            "ckpt_stall_seconds",
            "Training-thread stall per save (copy into host buffers)",
            ["tier"],
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.validation = Histogram(
            "ckpt_validation_seconds",
            "Seconds to validate one checkpoint",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.bytes_written = Counter(
            "ckpt_bytes_written", "New bytes written to storage", ["tier"], registry=r
        )
        self.bytes_reused = Counter(
            "ckpt_bytes_reused",
            "Bytes referenced from earlier checkpoints (de-duplicated)",
            ["tier"],
            registry=r,
        )
        self.checkpoints = Counter(
            "ckpt_checkpoints", "Checkpoints by validation status", ["tier", "status"], registry=r
        )
        self.last_valid_step = Gauge(
            "ckpt_last_valid_step", "Step of the newest valid weights checkpoint", registry=r
        )
        self.last_valid_step.set(-1)
        self.persist_errors = Counter(
            "ckpt_persist_errors", "Failed background persists", registry=r
        )
        self.heartbeat_errors = Counter(
            "ckpt_heartbeat_errors", "Failed heartbeat writes", registry=r
        )
        self.backpressure = Counter(
            "ckpt_backpressure", "Saves that met a persist still running", ["action"], registry=r
        )
        self.recovery_attempts = Counter(
            "ckpt_recovery_attempts", "Checkpoints tried by the recovery ladder", registry=r
        )
        self.recovery_successes = Counter(
            "ckpt_recovery_successes", "Successful restores", registry=r
        )
        self.score = Gauge("ckpt_score", "Scheduler score", registry=r)
        self.interval = Gauge("ckpt_interval_steps", "Dynamic pulse interval (steps)", registry=r)
        self._server: Any = None

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (0 when absent); for tests and reports."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else float(v)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Start the HTTP exporter (no-op for port 0)."""
        if port <= 0 or self._server is not None:
            return
        self._server = start_http_server(port, addr=addr, registry=self.registry)

    def close(self) -> None:
        srv = self._server
        self._server = None
        if srv is None:
            return
        server = srv[0] if isinstance(srv, tuple) else None
        if server is not None:
            server.shutdown()
            server.server_close()


class DecisionLog:
    """Append-only JSON Lines file (one object per scheduler decision or engine event)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._f: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self.lines = 0

    def write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
        with self._lock:
            if self._f is None:
                return
            self._f.write(line + "\n")
            self.lines += 1
            if self.lines % 64 == 0:
                self._f.flush()

    def flush(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


class TensorBoard:
    """``checkpoint/score`` and ``checkpoint/interval`` scalars, when tensorboard is installed."""

    def __init__(self, logdir: str | Path) -> None:
        self._writer: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        try:
            self._writer = SummaryWriter(log_dir=str(logdir))
        except Exception:  # pragma: no cover - tensorboard present but broken
            log.warning("TensorBoard writer could not start", exc_info=True)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def scalars(self, step: int, score: float, interval: int) -> None:
        if self._writer is not None:
            self._writer.add_scalar("checkpoint/score", score, step)
            self._writer.add_scalar("checkpoint/interval", interval, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
