"""``ckpt-operator``: run the operator (kopf) with the settings from flags/env.

See ``ckpt-operator --help`` and ``docs/operator.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kopf

from ckpt_agent.text import CleanFilter
from ckpt_operator.adapters.certs import write_webhook_certs
from ckpt_operator.adapters.events import KopfEvents
from ckpt_operator.adapters.kube import KubernetesApi
from ckpt_operator.adapters.metrics import Metrics
from ckpt_operator.adapters.sources import StorageSourceFactory
from ckpt_operator.app.handlers import MEMO_KEY, DiffBaseForChanges, make_runtime, register
from ckpt_operator.app.webhook_server import InstrumentedWebhookServer
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import OperatorConfig, parse_config

__all__ = ["build_settings", "configure_logging", "executors", "main", "webhook_server"]

log = logging.getLogger("ckpt_operator")


def webhook_server(cfg: OperatorConfig, metrics: Metrics) -> InstrumentedWebhookServer:
    """The HTTPS admission server: certificate files from ``cert_dir``, or generated now."""
    w = cfg.webhook
    if w.cert_dir is not None:
        cert_dir = w.cert_dir
    else:
        cert_dir = Path(tempfile.mkdtemp(prefix="ckpt-webhook-"))
        sans = [s for s in (w.host, "localhost", "127.0.0.1", *w.extra_sans) if s]
        if w.listen not in ("0.0.0.0", "::"):
            sans.append(w.listen)
        write_webhook_certs(cert_dir, sans)
        log.info("generated a webhook certificate for %s in %s", ", ".join(sans), cert_dir)
    ca = cert_dir / "ca.crt"
    return InstrumentedWebhookServer(
        metrics=metrics,
        addr=w.listen,
        port=w.port,
        host=w.host,
        certfile=cert_dir / "tls.crt",
        pkeyfile=cert_dir / "tls.key",
        cafile=ca if ca.exists() else None,
    )


def build_settings(cfg: OperatorConfig, metrics: Metrics) -> kopf.OperatorSettings:
    """kopf settings: our annotation prefix, quiet Event posting, the webhook server."""
    settings = kopf.OperatorSettings()
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.KOPF_PREFIX)
    settings.persistence.diffbase_storage = DiffBaseForChanges(
        prefix=c.KOPF_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{c.KOPF_PREFIX}/finalizer"
    # Our own Events say what happened; kopf's per-handler "succeeded" Events would be noise.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 600
    settings.watching.client_timeout = 660
    if not cfg.standalone:
        # kopf pauses every operator when peers share a priority: a random one per replica
        # makes exactly one of them active (the highest), the others stand by.
        settings.peering.name = c.PEERING_NAME
        settings.peering.priority = random.randint(1, 2**31 - 1)
        settings.peering.clusterwide = True  # the ClusterKopfPeering (never with --namespace)
        settings.peering.mandatory = True  # never two active operators for lack of a CRD
    if cfg.webhook.enabled:
        settings.admission.server = webhook_server(cfg, metrics)
        settings.admission.managed = cfg.webhook.managed
    return settings


def executors(cfg: OperatorConfig) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """Reconciliation's pool (``--workers``: API calls, storage, planning; also the loop's
    default executor) and the webhook's own (``--webhook-workers``)."""
    return (
        ThreadPoolExecutor(cfg.workers, thread_name_prefix="ckpt-reconcile"),
        ThreadPoolExecutor(cfg.webhook.workers, thread_name_prefix="ckpt-webhook"),
    )


def start_threads(pool: ThreadPoolExecutor, n: int, timeout_s: float = 10.0) -> None:
    """Start all ``n`` threads of ``pool`` now, not as a burst first needs them.

    A thread lives as long as the operator (a pool never stops an idle one): started in
    the middle of a burst, its objects (the thread's own, its locks and queues) land among
    the burst's short-lived ones and pin their memory after the burst is gone (pymalloc
    frees an arena only once nothing in it lives; issue #19). Started here they belong
    to the baseline. Best effort: a pool that does not start them all in time starts the
    rest on demand, as before.
    """
    barrier = threading.Barrier(n)

    def meet() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout_s)

    for future in [pool.submit(meet) for _ in range(n)]:
        future.result()


def _use_default_executor(pool: ThreadPoolExecutor) -> Any:
    async def on_startup(**_: Any) -> None:
        asyncio.get_running_loop().set_default_executor(pool)

    return on_startup


def configure_logging(cfg: OperatorConfig) -> None:
    """kopf's log format and level; without ``--verbose`` kopf's own per-object lines
    below WARNING are dropped.

    kopf logs ``Handler '...' succeeded.`` at INFO for every watch event of every job and
    pod and every admission request: ~30 lines per restart in a burst (issue #19; with
    their formatting and writing a few % of the operator's CPU), none of them news (the
    operator's own log lines and Events say what it did). kopf's warnings and errors
    (failed handlers, retries) stay, and so do they all with ``--verbose``.
    """
    kopf.configure(
        verbose=cfg.verbose,
        log_format=kopf.LogFormat.JSON if cfg.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    # Every record kopf's handler writes through text.CleanFilter: log lines quote stored
    # names, reasons and errors (issue #28), and kopf's formatter is kopf's.
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, CleanFilter) for f in handler.filters):
            handler.addFilter(CleanFilter())
    objects = logging.getLogger("kopf.objects")
    objects.setLevel(logging.NOTSET if cfg.verbose else logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_config(argv)
    configure_logging(cfg)
    reconcile_pool, webhook_pool = executors(cfg)
    start_threads(reconcile_pool, cfg.workers)
    start_threads(webhook_pool, cfg.webhook.workers)
    api = KubernetesApi.from_environment(
        executor=reconcile_pool,
        timeout_s=cfg.api_timeout_s,
        connections=cfg.workers + cfg.webhook.workers,  # both pools share the client
    )
    # the webhook's fallback reads must answer within its budget
    admission_api = api.with_executor(webhook_pool, timeout_s=cfg.webhook.budget_s)
    metrics = Metrics()
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port)
    sources = StorageSourceFactory(
        api.get_secret_data,
        read_secrets=cfg.read_storage_secrets,
        gc_grace_s=cfg.retention.gc_grace_s,
        tenancy=cfg.tenancy,
        timeout_s=cfg.storage_timeout_s,
    )
    events = KopfEvents(post=api.post_event)
    deps = Deps(
        api=api,
        events=events,
        metrics=metrics,
        sources=sources,
        config=cfg,
        admission_api=admission_api,
    )
    registry = register(kopf.OperatorRegistry(), webhooks=cfg.webhook.enabled, kueue=cfg.kueue)
    # storage calls and Events use asyncio's default executor: make it the sized pool
    kopf.on.startup(registry=registry, id="executor")(_use_default_executor(reconcile_pool))
    if not cfg.standalone:

        async def peering_object(**_: Any) -> None:
            await api.ensure_peering(c.PEERING_NAME)

        kopf.on.startup(registry=registry, id="peering")(peering_object)
    # An explicit registry has no login handlers (only kopf's implicit default registry
    # adds them): without this kopf never authenticates ("Ran out of valid credentials").
    # The official client's login: in-cluster service account, else $KUBECONFIG.
    kopf.on.login(registry=registry, id="login")(kopf.login_via_client)
    try:
        kopf.run(
            registry=registry,
            settings=build_settings(cfg, metrics),
            standalone=cfg.standalone,
            clusterwide=not cfg.namespaces,
            namespaces=list(cfg.namespaces),
            liveness_endpoint=cfg.liveness,
            memo=kopf.Memo({MEMO_KEY: make_runtime(deps)}),
        )
    finally:
        sources.close()
        reconcile_pool.shutdown(wait=False, cancel_futures=True)
        webhook_pool.shutdown(wait=False, cancel_futures=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
