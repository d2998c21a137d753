"""Prometheus metrics, their HTTP server, and the JSON Lines decision log.

Every :class:`~ckpt_agent.runtime.checkpointer.Checkpointer` owns one :class:`Metrics` with
its own ``CollectorRegistry`` (tests stay isolated; a process can run several
checkpointers). ``serve(port)`` starts the HTTP exporter on that registry;
:class:`MetricsServer` is that exporter, with optional health endpoints (the
sidecar's ``/healthz``/``/readyz``; the operator can use it too). TensorBoard
scalars live in :mod:`ckpt_agent.runtime.core.tensorboard` (they need torch).

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
``ckpt_backpressure_total{action}``          saves deferred, waited for, memory_deferred
``ckpt_recovery_attempts_total``             checkpoints tried by the ladder
``ckpt_recovery_successes_total``            successful restores
``ckpt_recoveries_total{outcome}``           starts by outcome: resume, fresh, ..., failed
``ckpt_recovery_seconds``                    histogram: time ``start()`` took to restore
``ckpt_io_time_ratio``                       share of wall time the training thread stalled
                                             for checkpoints (since the checkpointer started)
``ckpt_score`` / ``ckpt_interval_steps``     the scheduler's current score and interval
=========================================== ==========================================

**Relay.** In flash mode without the sidecar container, a local persister process
commits, validates and applies retention; it is no scrape target. It publishes its
registry (:func:`snapshot`, into ``persister-metrics.json`` of its shared-memory area)
and the trainer serves it (:meth:`Metrics.relay`): the families both update (checkpoints,
bytes written/reused, validation, last valid step: ``Metrics._persister_collectors``) are
the trainer's own samples plus the persister's, its other families the persister's own
(``ckpt_sidecar_*``, ``ckpt_storage_*``, ``ckpt_gpu_errors``), and the families the
trainer measures itself (save latency, stall, ...) stay the trainer's. One scrape
target per pod, ``ckpt-metrics``. Counts of an earlier persister process of the same
area (one that died and was restarted) are kept, so counters only go down when the
trainer process itself restarts.
"""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, Final

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from ckpt_agent.background import lower_thread_priority

__all__ = [
    "DecisionLog",
    "HealthCheck",
    "Metrics",
    "MetricsServer",
    "snapshot",
]

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
        self.recoveries = Counter(
            "ckpt_recoveries",
            "Checkpointer starts by outcome (resume, fresh, ... or failed)",
            ["outcome"],
            registry=r,
        )
        self.recovery_time = Histogram(
            "ckpt_recovery_seconds",
            "Seconds start() took to find, verify and restore a checkpoint",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self._started = time.monotonic()
        self._stalled_s = 0.0
        self.io_ratio = Gauge(
            "ckpt_io_time_ratio",
            "Share of wall time the training thread stalled for checkpoints",
            registry=r,
        )
        self.io_ratio.set_function(self._io_ratio)
        self.score = Gauge("ckpt_score", "Scheduler score", registry=r)
        self.interval = Gauge("ckpt_interval_steps", "Dynamic pulse interval (steps)", registry=r)
        self._server: MetricsServer | None = None

    def add_stall(self, tier: str, seconds: float) -> None:
        """One save's training-thread stall: the histogram and the IO share of wall time."""
        self.stall.labels(tier=tier).observe(seconds)
        self._stalled_s += max(0.0, seconds)

    def _io_ratio(self) -> float:
        elapsed = time.monotonic() - self._started
        return min(1.0, self._stalled_s / elapsed) if elapsed > 0 else 0.0

    def recovered(self, outcome: str, seconds: float | None = None) -> None:
        """A start's outcome (``failed`` when it raised) and, when it restored, its duration."""
        self.recoveries.labels(outcome=outcome).inc()
        if seconds is not None:
            self.recovery_time.observe(seconds)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (0 when absent); for tests and reports."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else float(v)

    def relay(self, read: Callable[[], bytes | None]) -> None:
        """Serve a persister process's metrics too (module doc); ``read()`` returns its
        newest :func:`snapshot` (None: none yet). Call once."""
        own = {m.name: c for c in self._persister_collectors() for m in c.describe()}
        trainer = {m.name for m in self.registry.collect()}
        for c in own.values():
            self.registry.unregister(c)
        self.registry.register(_Relay(own, trainer, read))

    def _persister_collectors(self) -> list[MetricWrapperBase]:
        return [
            self.checkpoints,
            self.bytes_written,
            self.bytes_reused,
            self.validation,
            self.last_valid_step,
        ]

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Start the HTTP exporter (no-op for port 0). A port another process holds (several
        ranks in one pod: the first serves) is logged, never an error of the training."""
        if port <= 0 or self._server is not None:
            return
        try:
            self._server = MetricsServer(self.registry, port, addr)
        except OSError as e:
            log.warning("metrics server not started on %s:%d: %s", addr, port, e)

    def close(self) -> None:
        srv = self._server
        self._server = None
        if srv is not None:
            srv.close()


_SNAPSHOT_FORMAT: Final = "ckpt-operator.metrics-snapshot"
_TYPES: Final = frozenset({"counter", "gauge", "histogram", "summary", "info", "unknown"})
_ADDITIVE: Final = frozenset({"counter", "histogram", "summary"})
_SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def snapshot(registry: CollectorRegistry, instance: str) -> bytes:
    """A registry's samples as JSON, for a trainer that relays them (:meth:`Metrics.relay`);
    ``instance`` names the process (a new one: a restarted persister)."""
    families = [
        {
            "name": m.name,
            "type": m.type,
            "help": m.documentation,
            "samples": [
                [s.name, s.labels, s.value] for s in m.samples if not s.name.endswith("_created")
            ],
        }
        for m in registry.collect()
    ]
    doc = {"format": _SNAPSHOT_FORMAT, "instance": instance, "families": families}
    return json.dumps(doc, separators=(",", ":")).encode()


def _parse(raw: bytes) -> tuple[str, list[Metric]]:
    """(instance, families) of a :func:`snapshot`; ValueError when it is not one."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("format") != _SNAPSHOT_FORMAT:
        raise ValueError("not a metrics snapshot")
    out = []
    for f in doc["families"]:
        if f["type"] not in _TYPES:
            raise ValueError(f"unknown metric type {f['type']!r}")
        m = Metric(str(f["name"]), str(f["help"]), str(f["type"]))
        for name, labels, value in f["samples"]:
            m.add_sample(str(name), {str(k): str(v) for k, v in labels.items()}, float(value))
        out.append(m)
    return str(doc["instance"]), out


def _key(name: str, labels: dict[str, str]) -> _SampleKey:
    return name, tuple(sorted(labels.items()))


class _Relay:
    """Collector of a relaying trainer (:meth:`Metrics.relay`)."""

    def __init__(
        self, own: dict[str, MetricWrapperBase], trainer: set[str], read: Callable[[], bytes | None]
    ) -> None:
        self._own = own
        self._trainer = trainer
        self._read = read
        self._lock = threading.Lock()
        self._instance = ""
        self._last: list[Metric] = []
        self._base: dict[str, dict[_SampleKey, float]] = {}
        """Additive samples of earlier persister processes, by family."""

    def describe(self) -> list[Metric]:
        return [m for c in self._own.values() for m in c.describe()]

    def _families(self) -> tuple[dict[str, Metric], dict[str, dict[_SampleKey, float]]]:
        """The persister's newest snapshot (the last good one when it cannot be read) and
        the earlier processes' counts (copies: scrapes may run at the same time)."""
        raw = self._read()
        with self._lock:
            if raw is not None:
                try:
                    instance, families = _parse(raw)
                except (ValueError, KeyError, TypeError, AttributeError):
                    log.debug("unreadable persister metrics snapshot", exc_info=True)
                else:
                    if instance != self._instance:
                        self._fold()
                        self._instance = instance
                    self._last = families
            base = {name: dict(b) for name, b in self._base.items()}
            return {m.name: m for m in self._last}, base

    def _fold(self) -> None:
        """A new persister process: keep the counts of the one before (additive families)."""
        for m in self._last:
            if m.type in _ADDITIVE:
                base = self._base.setdefault(m.name, {})
                for s in m.samples:
                    k = _key(s.name, s.labels)
                    base[k] = base.get(k, 0.0) + s.value

    def collect(self) -> Iterator[Metric]:
        relayed, base = self._families()
        for name, collector in self._own.items():
            for m in collector.collect():
                yield _merged(m, relayed.pop(name, None), base.get(name, {}))
        for m in relayed.values():
            if m.name not in self._trainer:
                yield _merged(m, None, base.get(m.name, {}))


def _merged(own: Metric, theirs: Metric | None, base: dict[_SampleKey, float]) -> Metric:
    """``own``'s samples plus ``base`` and the persister's (gauges: the larger value)."""
    values: dict[_SampleKey, tuple[str, dict[str, str], float]] = {}
    add = own.type in _ADDITIVE

    def put(samples: Iterable[tuple[str, dict[str, str], float]]) -> None:
        for name, labels, value in samples:
            k = _key(name, labels)
            if k not in values:
                values[k] = (name, labels, value)
            elif not name.endswith("_created"):
                old = values[k][2]
                values[k] = (name, labels, old + value if add else max(old, value))

    put((s.name, s.labels, s.value) for s in own.samples)
    if add:
        put((k[0], dict(k[1]), v) for k, v in base.items())
    if theirs is not None:
        put((s.name, s.labels, s.value) for s in theirs.samples)
    out = Metric(own.name, own.documentation, own.type)
    for name, labels, value in values.values():
        out.add_sample(name, labels, value)
    return out


#: ``() -> (healthy, details)`` behind ``/healthz`` and ``/readyz`` (503 when not healthy).
HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]

_HEALTH_PATHS = ("/healthz", "/readyz", "/health")


class MetricsServer:
    """``/metrics`` of one registry (and ``/healthz``, ``/readyz`` with ``health``) on a thread.

    Without ``health`` every path serves the metrics (like ``prometheus_client``'s
    exporter); with it, unknown paths are 404. ``port=0`` binds a free port
    (:attr:`port` says which); :meth:`close` stops it.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        addr: str = "0.0.0.0",
        *,
        health: HealthCheck | None = None,
        name: str = "ckpt-metrics-http",
    ) -> None:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics" or (server.health is None and path != "/favicon.ico"):
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in _HEALTH_PATHS and server.health is not None:
                    ok, details = server.health()
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

        class Server(http.server.ThreadingHTTPServer):
            # "::" (IPv6, and IPv4 too where the node allows dual-stack sockets)
            address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

        self.health = health
        self._httpd = Server((addr, port), Handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        threading.Thread(target=self._httpd.serve_forever, name=name, daemon=True).start()

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()


_LOG_QUEUE_MAX = 4096
"""Queued lines at which :meth:`DecisionLog.write` writes them itself (bounded memory)."""


class DecisionLog:
    """Append-only JSON Lines file (one object per scheduler decision or engine event).

    With ``background`` (the training process's log) :meth:`write` only queues the
    object — or a callable returning it, built later — and a thread of its own
    serializes and writes the queue every ``interval`` seconds: the training thread
    pays neither the JSON nor the I/O. :meth:`flush` writes the queue at once (every
    engine event does); lines keep the order of their :meth:`write`.
    """

    def __init__(
        self, path: str | Path, *, background: bool = False, interval: float = 0.5
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._f: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._queue: deque[dict[str, Any] | Callable[[], dict[str, Any]]] = deque()
        self.lines = 0
        self._background = background
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, args=(interval,), name="ckpt-decision-log", daemon=True
            )
            self._thread.start()

    def write(self, obj: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        self._queue.append(obj)
        if not self._background or len(self._queue) >= _LOG_QUEUE_MAX:
            with self._lock:
                self._drain(flush=False)

    def flush(self) -> None:
        with self._lock:
            self._drain(flush=True)

    def _drain(self, *, flush: bool) -> None:
        """Write the queued lines (the lock held)."""
        queue = self._queue
        while queue:
            item = queue.popleft()
            if self._f is None:
                continue
            obj = item() if callable(item) else item
            self._f.write(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str))
            self._f.write("\n")
            self.lines += 1
            if self.lines % 64 == 0:
                self._f.flush()
        if flush and self._f is not None:
            self._f.flush()

    def _run(self, interval: float) -> None:
        lower_thread_priority()
        while not self._stop.wait(interval):
            if self._queue:
                self.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            self._drain(flush=True)
            if self._f is not None:
                self._f.close()
                self._f = None
