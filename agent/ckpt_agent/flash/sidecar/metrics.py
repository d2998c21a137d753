"""The sidecar's Prometheus metrics: the engine's checkpoint metrics plus its own, and the
peer replication's (read from the :class:`~ckpt_agent.flash.replica.replicator.Replicator`
at each scrape: the replication itself knows nothing of Prometheus)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ckpt_agent.flash.replica.replicator import Replicator
from ckpt_agent.metrics import Metrics

__all__ = ["ReplicationCollector", "SidecarMetrics"]


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

    def watch_replication(self, replicator: Replicator) -> None:
        """Serve ``replicator``'s counters with the sidecar's metrics."""
        self.registry.register(ReplicationCollector(replicator))


class ReplicationCollector(Collector):
    """The replication's metrics, read at scrape time:

    ============================================  ==========================================
    ``ckpt_sidecar_replica_pushes_total{outcome}``  snapshot pushes to a peer: ``pushed``,
                                                  ``failed``, ``superseded`` (a newer one
                                                  came first)
    ``ckpt_sidecar_replica_bytes_sent_total``     chunk bytes pushed (only changed chunks)
    ``ckpt_sidecar_replica_last_pushed_step``     step of the newest snapshot pushed (-1)
    ``ckpt_sidecar_replica_lag_seconds``          its write (trainer) to its push done
    ``ckpt_sidecar_replica_peers``                peers pushed to now
    ``ckpt_sidecar_replica_marks_total{outcome}`` step heartbeat records pushed / failed
    ``ckpt_sidecar_replicas_held``                peers' replicas this node holds
    ``ckpt_sidecar_replicas_held_bytes``          their bytes (the memory they take)
    ``ckpt_sidecar_replica_served_total{what}``   ``stored``, ``fetched``, ``refused``
                                                  (another job, a wrong secret, busy)
    ============================================  ==========================================
    """

    def __init__(self, replicator: Replicator) -> None:
        self.replicator = replicator

    def collect(self) -> Iterator[Metric]:
        rep = self.replicator
        pushes = CounterMetricFamily(
            "ckpt_sidecar_replica_pushes", "Snapshot pushes to a peer", labels=["outcome"]
        )
        for outcome, n in (
            ("pushed", rep.pushed),
            ("failed", rep.failed),
            ("superseded", rep.superseded),
        ):
            pushes.add_metric([outcome], n)
        yield pushes
        yield CounterMetricFamily(
            "ckpt_sidecar_replica_bytes_sent", "Chunk bytes pushed to peers", value=rep.bytes_sent
        )
        last = rep.last
        yield GaugeMetricFamily(
            "ckpt_sidecar_replica_last_pushed_step",
            "Step of the newest snapshot pushed to a peer (-1: none)",
            value=-1 if last is None else last.step,
        )
        lag = rep.last_lag_s
        yield GaugeMetricFamily(
            "ckpt_sidecar_replica_lag_seconds",
            "From the newest pushed snapshot's write to its push done",
            value=float("nan") if lag is None else lag,
        )
        yield GaugeMetricFamily(
            "ckpt_sidecar_replica_peers", "Peers pushed to now", value=len(rep.peers)
        )
        marks = CounterMetricFamily(
            "ckpt_sidecar_replica_marks", "Step heartbeat records pushed", labels=["outcome"]
        )
        marks.add_metric(["pushed"], rep.marks.pushed)
        marks.add_metric(["failed"], rep.marks.failed)
        yield marks
        try:
            held = rep.store.replicas()
        except (OSError, ValueError):  # a scrape never fails on the store
            held = []
        yield GaugeMetricFamily(
            "ckpt_sidecar_replicas_held", "Peers' replicas held on this node", value=len(held)
        )
        yield GaugeMetricFamily(
            "ckpt_sidecar_replicas_held_bytes",
            "Bytes of the peers' replicas held on this node",
            value=sum(r.desc.data_size for r in held),
        )
        if rep.server is not None:
            st = rep.server.stats
            served = CounterMetricFamily(
                "ckpt_sidecar_replica_served", "Requests from peers", labels=["what"]
            )
            for what, n in (
                ("stored", st.stored),
                ("fetched", st.fetched),
                ("refused", st.refused),
            ):
                served.add_metric([what], n)
            yield served
