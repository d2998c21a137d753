"""Prometheus metrics of the operator (one registry per operator instance).

* ``ckpt_operator_restarts_total{action}``: restarts created (resume, rebuild, fresh);
* ``ckpt_operator_recoveries_total{result,reason}``: recovery attempts, ``success``
  (restart created) or ``failure`` (gave up, crash loop, create error); the
  success-rate alert divides these;
* ``ckpt_operator_recovery_success_ratio``: successful recoveries over all recovery
  attempts since this operator started (1 before any);
* ``ckpt_operator_poisoned_checkpoints_total``: checkpoints poisoned by crash loops;
* ``ckpt_operator_failure_to_restart_seconds``: the job's Failed condition →
  restart created, backoff included (histogram);
* ``ckpt_operator_retention_deletions_total``: checkpoints deleted by retention;
* ``ckpt_operator_retention_bytes_deleted_total``: bytes freed (checkpoints + blobs);
* ``ckpt_operator_retention_errors_total``: failed retention passes / deletions;
* ``ckpt_operator_webhook_requests_total{webhook,result}``: admission requests
  (allowed / denied / error);
* ``ckpt_operator_webhook_duration_seconds{webhook}``: admission latency (histogram);
* ``ckpt_operator_injections_total{result}``: pods injected / skipped / already injected / error;
* ``ckpt_operator_save_now_signals_total{reason}``: emergency-checkpoint signals sent;
* ``ckpt_operator_unprotected_pods_total``: opted-in pods found running without the agent
  (admitted while the webhook was bypassed);
* ``ckpt_preemption_saves_total{reason}``: Kueue evictions whose pods were asked for an
  emergency checkpoint (Kueue's eviction reason: ``Preempted``, ``PodsReadyTimeout`` …);
* ``ckpt_preemption_lost_steps``: steps an eviction cost, observed when the Workload is
  admitted again (histogram; docs/kueue.md);
* ``ckpt_priority_boost_writes_total{action}``: writes of a Workload's
  ``kueue.x-k8s.io/priority-boost`` (``write``, ``remove``).

The preemption metrics are named as issue #30 names them (``ckpt_``, not
``ckpt_operator_``): the e2e and dashboards read them by these names.

Label values come from small fixed sets (CamelCase reasons, webhook ids),
never from object names, to keep cardinality bounded.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0, 7200.0)
_LOST_STEP_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 50.0, 100.0, 500.0, 1000.0, 5000.0, 10000.0)
_WEBHOOK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """All operator metrics, registered in :attr:`registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"ckpt_operator_{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(
                f"ckpt_operator_{name}", doc, labels, buckets=buckets, registry=self.registry
            )

        self.restarts = counter("restarts", "Restarts created", "action")
        self.recoveries = counter(
            "recoveries",
            "Recovery attempts by result (success: restart created; failure: gave up, "
            "crash loop or create error)",
            "result",
            "reason",
        )
        self.recovery_success = Gauge(
            "ckpt_operator_recovery_success_ratio",
            "Successful recoveries over all recovery attempts since the operator started "
            "(1 before any)",
            registry=self.registry,
        )
        self.recovery_success.set_function(self._recovery_success_ratio)
        self.poisoned = counter("poisoned_checkpoints", "Checkpoints poisoned by crash loops")
        self.failure_to_restart = histogram(
            "failure_to_restart_seconds",
            "Seconds from a job's Failed condition to its restart being created",
            _LATENCY_BUCKETS,
        )
        self.retention_deletions = counter(
            "retention_deletions", "Checkpoints deleted by retention"
        )
        self.retention_bytes = counter(
            "retention_bytes_deleted",
            "Bytes freed by retention (checkpoints and garbage-collected blobs)",
        )
        self.retention_errors = counter("retention_errors", "Failed retention passes or deletions")
        self.webhook_requests = counter(
            "webhook_requests",
            "Admission requests by webhook and result (allowed, denied, error)",
            "webhook",
            "result",
        )
        self.webhook_duration = histogram(
            "webhook_duration_seconds", "Admission request latency", _WEBHOOK_BUCKETS, "webhook"
        )
        self.injections = counter(
            "injections",
            "Pods seen by the injection webhook (injected, skipped, already)",
            "result",
        )
        self.unprotected_pods = counter(
            "unprotected_pods",
            "Opted-in pods found running without the checkpoint agent (webhook bypassed)",
        )
        self.save_now = counter(
            "save_now_signals", "Emergency-checkpoint signals sent to pods", "reason"
        )
        self.preemption_saves = Counter(
            "ckpt_preemption_saves",
            "Kueue evictions whose pods were asked for an emergency checkpoint, by Kueue's "
            "eviction reason",
            ["reason"],
            registry=self.registry,
        )
        self.preemption_lost_steps = Histogram(
            "ckpt_preemption_lost_steps",
            "Steps an eviction by Kueue cost (newest heartbeat before it minus the resume "
            "checkpoint), observed when the Workload is admitted again",
            buckets=_LOST_STEP_BUCKETS,
            registry=self.registry,
        )
        self.boost_writes = Counter(
            "ckpt_priority_boost_writes",
            "Writes of Workloads' kueue.x-k8s.io/priority-boost annotation (write, remove)",
            ["action"],
            registry=self.registry,
        )

    def _recovery_success_ratio(self) -> float:
        ok = total = 0.0
        for family in self.recoveries.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    total += sample.value
                    ok += sample.value if sample.labels.get("result") == "success" else 0.0
        return ok / total if total else 1.0

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``addr:port`` (a daemon thread)."""
        start_http_server(port, addr=addr, registry=self.registry)
