"""The admission webhook server: kopf's HTTPS server plus metrics and request fix-ups.

:class:`InstrumentedWebhookServer` is :class:`kopf.WebhookServer` (aiohttp,
TLS, reloads the certificate files when they change — cert-manager or Helm
rotations need no restart) with a wrapper around kopf's admission function
that

* fills ``request.object.metadata.namespace`` from ``request.namespace``
  when the object omits it (pods created by controllers often do), so the
  handlers always know the namespace;
* records ``ckpt_operator_webhook_requests_total`` and
  ``ckpt_operator_webhook_duration_seconds`` per webhook (handler id).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import kopf

from ckpt_operator.adapters.metrics import Metrics

__all__ = ["InstrumentedWebhookServer", "fill_namespace"]


def fill_namespace(request: Any) -> Any:
    """Copy ``request.namespace`` into the object's metadata when missing (in place)."""
    payload = request.get("request") if isinstance(request, dict) else None
    if not isinstance(payload, dict):
        return request
    namespace = payload.get("namespace")
    for key in ("object", "oldObject"):
        obj = payload.get(key)
        if namespace and isinstance(obj, dict):
            meta = obj.setdefault("metadata", {})
            if isinstance(meta, dict) and not meta.get("namespace"):
                meta["namespace"] = namespace
    return request


class InstrumentedWebhookServer(kopf.WebhookServer):
    """kopf's webhook server with metrics (see the module docstring)."""

    def __init__(self, *, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics = metrics

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        metrics = self.metrics

        async def instrumented(
            request: Any,
            *,
            webhook: str | None = None,
            headers: kopf.Headers | None = None,
            sslpeer: kopf.SSLPeer | None = None,
        ) -> Any:
            name = webhook or "unknown"
            t0 = time.perf_counter()
            result = "error"
            try:
                response = await fn(
                    fill_namespace(request), webhook=webhook, headers=headers, sslpeer=sslpeer
                )
                allowed = bool(response.get("response", {}).get("allowed"))
                result = "allowed" if allowed else "denied"
                return response
            finally:
                metrics.webhook_requests.labels(name, result).inc()
                metrics.webhook_duration.labels(name).observe(time.perf_counter() - t0)

        async for config in super().__call__(instrumented):
            yield config
