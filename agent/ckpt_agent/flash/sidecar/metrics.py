"""The sidecar's Prometheus metrics: the engine's checkpoint metrics plus its own."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from ckpt_agent.metrics import Metrics

__all__ = ["SidecarMetrics"]


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
