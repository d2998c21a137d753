"""System health for the sidecar: storage write latency, GPU errors, published to the trainer.

:class:`HealthMonitor` probes storage (:class:`StorageProbe`), reads GPU error
counts (:class:`GpuHealth`, through NVML when there is one), sets the gauges and
publishes the signals in ``health.json`` for the trainer's scheduler.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from ckpt_agent.errors import StorageError
from ckpt_agent.flash.protocol import write_health
from ckpt_agent.flash.sidecar.metrics import SidecarMetrics
from ckpt_agent.records import Json
from ckpt_agent.storage.base import Storage

__all__ = ["GpuHealth", "HealthMonitor", "StorageProbe"]

log = logging.getLogger(__name__)


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


class HealthMonitor:
    """Samples storage latency and GPU errors; publishes them (gauges, ``health.json``)."""

    def __init__(
        self, storage: Storage, run_id: str, shm_dir: Path, metrics: SidecarMetrics
    ) -> None:
        self.run_id = run_id
        self.shm_dir = shm_dir
        self.metrics = metrics
        self.probe = StorageProbe(storage, run_id)
        self.gpu = GpuHealth()
        self._gpu_base: int | None = None
        self.gpu_total: int | None = None
        """GPU errors since the sidecar started (None: not measured)."""

    def sample(self) -> dict[str, Json]:
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
            self.gpu_total = gpu - self._gpu_base
            self.metrics.gpu_errors.set(self.gpu_total)
        signals: dict[str, Json] = {
            "write_latency_ms": self.probe.last_ms,
            "probe_error": self.probe.last_error,
            "gpu_errors_total": self.gpu_total,
            "gpus": self.gpu.devices,
            "sidecar_pid": os.getpid(),
        }
        try:
            write_health(self.shm_dir, self.run_id, signals)
        except OSError as e:
            log.warning("could not publish health signals: %s", e)
        return signals

    def details(self) -> dict[str, Json]:
        """The last probe's and GPU reading's results (for ``/healthz``)."""
        return {
            "storage_ok": self.probe.last_error is None,
            "write_latency_ms": self.probe.last_ms,
            "probe_error": self.probe.last_error,
            "gpu_errors": self.gpu_total,
            "gpu_devices": self.gpu.devices,
            "nvml": self.gpu.available,
        }

    def close(self) -> None:
        self.gpu.close()
