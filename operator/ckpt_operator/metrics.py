"""Prometheus metrics of the operator (one registry per operator instance).

* ``ckpt_operator_restarts_total{action}``: restarts created (resume, rebuild, fresh);
* ``ckpt_operator_recoveries_total{result,reason}``: recovery attempts, ``success``
  (restart created) or ``failure`` (gave up, crash loop, create error); the
  success-rate alert divides these;
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
* ``ckpt_operator_save_now_signals_total{reason}``: emergency-checkpoint signals sent.

Label values come from small fixed sets (CamelCase reasons, webhook ids),
never from object names, to keep cardinality bounded.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0, 7200.0)
_WEBHOOK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """All operator metrics, registered in :attr:`registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.restarts = Counter(
            "ckpt_operator_restarts", "Restarts created", ["action"], registry=r
        )
        self.recoveries = Counter(
            "ckpt_operator_recoveries",
            "Recovery attempts by result (success: restart created; failure: gave up, "
            "crash loop or create error)",
            ["result", "reason"],
            registry=r,
        )
        self.poisoned = Counter(
            "ckpt_operator_poisoned_checkpoints", "Checkpoints poisoned by crash loops", registry=r
        )
        self.failure_to_restart = Histogram(
            "ckpt_operator_failure_to_restart_seconds",
            "Seconds from a job's Failed condition to its restart being created",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retention_deletions = Counter(
            "ckpt_operator_retention_deletions", "Checkpoints deleted by retention", registry=r
        )
        self.retention_bytes = Counter(
            "ckpt_operator_retention_bytes_deleted",
            "Bytes freed by retention (checkpoints and garbage-collected blobs)",
            registry=r,
        )
        self.retention_errors = Counter(
            "ckpt_operator_retention_errors", "Failed retention passes or deletions", registry=r
        )
        self.webhook_requests = Counter(
            "ckpt_operator_webhook_requests",
            "Admission requests by webhook and result (allowed, denied, error)",
            ["webhook", "result"],
            registry=r,
        )
        self.webhook_duration = Histogram(
            "ckpt_operator_webhook_duration_seconds",
            "Admission request latency",
            ["webhook"],
            buckets=_WEBHOOK_BUCKETS,
            registry=r,
        )
        self.injections = Counter(
            "ckpt_operator_injections",
            "Pods seen by the injection webhook (injected, skipped, already)",
            ["result"],
            registry=r,
        )
        self.save_now = Counter(
            "ckpt_operator_save_now_signals",
            "Emergency-checkpoint signals sent to pods",
            ["reason"],
            registry=r,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` on ``addr:port`` (a daemon thread)."""
        start_http_server(port, addr=addr, registry=self.registry)
