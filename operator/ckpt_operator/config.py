"""Operator settings: one dataclass of grouped sub-dataclasses, from flags or env.

Every flag has an environment variable (``CKPT_OPERATOR_<FLAG>``, dashes as
underscores) so the chart can set everything through ``env``; flags win.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_agent.tuning import GC_GRACE_S

__all__ = [
    "InjectionConfig",
    "OperatorConfig",
    "RecoveryConfig",
    "RetentionConfig",
    "WebhookConfig",
    "parse_config",
]


@dataclass(frozen=True)
class WebhookConfig:
    """The admission webhook server."""

    enabled: bool = True
    """Serve the mutating (pods) and validating (policies) webhooks."""
    listen: str = "0.0.0.0"
    """Address to listen on."""
    port: int = 9443
    """HTTPS port (the chart's webhook Service targets it)."""
    cert_dir: Path | None = None
    """Directory with tls.crt, tls.key and ca.crt (a mounted TLS Secret); re-read on change."""
    generate_certs: bool = False
    """Generate a CA + serving certificate at start (local runs; needs ``host``/SANs)."""
    host: str | None = None
    """Host name/IP the API server uses to reach the webhook (managed mode URL, cert SAN)."""
    extra_sans: tuple[str, ...] = ()
    """More SANs for a generated certificate."""
    managed: str | None = None
    """Let kopf create/patch Mutating/ValidatingWebhookConfigurations of this name
    (local runs; the chart ships static configurations instead)."""


@dataclass(frozen=True)
class InjectionConfig:
    """What the mutating webhook injects besides the policy."""

    agent_image: str = ""
    """Default sidecar image when a policy sets ``spec.agent.sidecar`` without an image."""
    sidecar_command: tuple[str, ...] = ("ckpt", "sidecar")
    """Sidecar entry point."""
    sidecar_cpu_request: str = "100m"
    sidecar_memory_request: str = "256Mi"
    sidecar_memory_limit: str = "2Gi"


@dataclass(frozen=True)
class RecoveryConfig:
    """Auto-resume loop."""

    error_backoff_s: float = 15.0
    """First retry delay after an API/storage error (doubles up to 10 minutes)."""
    policy_missing_retry_s: float = 60.0
    """How often a failed job whose policy is missing is looked at again."""


@dataclass(frozen=True)
class RetentionConfig:
    """Retention reconciliation."""

    enabled: bool = True
    tick_s: float = 10.0
    """Loop granularity; each policy runs at its own ``retention.reconcileIntervalSeconds``."""
    gc_grace_s: float = GC_GRACE_S
    """Unreferenced blobs younger than this are left alone (a writer may be committing)."""


@dataclass(frozen=True)
class OperatorConfig:
    """Everything ``ckpt-operator`` can be told."""

    namespaces: tuple[str, ...] = ()
    """Namespaces to serve (none: cluster-wide)."""
    standalone: bool = True
    """No kopf peering (run one replica; needs no peering CRDs or RBAC)."""
    liveness: str = "http://0.0.0.0:8080/healthz"
    """kopf's health endpoint (the chart's probes)."""
    metrics_port: int = 9090
    """Prometheus port (0: off)."""
    log_format: str = "json"
    """``json`` (structured) or ``plain``."""
    verbose: bool = False
    read_storage_secrets: bool = True
    """Read a policy's S3 credentials Secret to list/verify/delete checkpoints."""
    webhook: WebhookConfig = field(default_factory=WebhookConfig)
    injection: InjectionConfig = field(default_factory=InjectionConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)


def _env(environ: Mapping[str, str], flag: str) -> str | None:
    value = environ.get("CKPT_OPERATOR_" + flag.upper().replace("-", "_"))
    return value if value not in (None, "") else None


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckpt-operator",
        description="Injects the checkpoint agent into PyTorchJob pods, resumes failed jobs "
        "from their last valid checkpoint and applies retention to checkpoint storage.",
    )
    a = p.add_argument
    a(
        "--namespace",
        "-n",
        action="append",
        default=None,
        help="namespace to serve (repeatable; default: all namespaces)",
    )
    a(
        "--peering",
        action="store_true",
        default=None,
        help="use kopf peering (needs kopf's peering CRDs); default: standalone",
    )
    a("--liveness", help="health endpoint URL (default http://0.0.0.0:8080/healthz)")
    a("--metrics-port", type=int, help="Prometheus port, 0 disables (default 9090)")
    a("--log-format", choices=["json", "plain"], help="log format (default json)")
    a("--verbose", "-v", action="store_true", default=None, help="debug logging")
    a(
        "--read-storage-secrets",
        type=_bool,
        help="read S3 credential Secrets named by policies (default true)",
    )
    a("--webhook", type=_bool, help="serve the admission webhooks (default true)")
    a("--webhook-listen", help="listen address (default 0.0.0.0)")
    a("--webhook-port", type=int, help="HTTPS port (default 9443)")
    a("--webhook-cert-dir", type=Path, help="dir with tls.crt, tls.key, ca.crt")
    a(
        "--webhook-generate-certs",
        action="store_true",
        default=None,
        help="generate a CA and serving certificate at start (local runs)",
    )
    a("--webhook-host", help="host/IP the API server reaches the webhook at")
    a("--webhook-extra-san", action="append", default=None, help="extra SAN (repeatable)")
    a("--webhook-managed", help="let kopf manage webhook configurations of this name")
    a("--agent-image", help="default sidecar image")
    a("--sidecar-command", help="sidecar entry point, space separated (default 'ckpt sidecar')")
    a("--retention", type=_bool, help="apply retention to storage (default true)")
    a("--retention-tick", type=float, help="retention loop granularity, seconds")
    a("--gc-grace", type=float, help="blob GC grace period, seconds (default 3600)")
    return p


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> OperatorConfig:
    """Flags (``argv``) over ``CKPT_OPERATOR_*`` variables (``environ``) over defaults."""
    env = os.environ if environ is None else environ
    ns = build_parser().parse_args(list(argv) if argv is not None else None)

    def pick(name: str, flag: str) -> str | None:
        value = getattr(ns, name)
        if value is not None:
            return str(value)
        return _env(env, flag)

    d = OperatorConfig()
    namespaces = tuple(ns.namespace or ()) or tuple(
        n for n in (_env(env, "namespaces") or "").replace(",", " ").split() if n
    )
    liveness = pick("liveness", "liveness") or d.liveness
    metrics_port = int(pick("metrics_port", "metrics-port") or d.metrics_port)
    log_format = pick("log_format", "log-format") or d.log_format
    if log_format not in ("json", "plain"):
        raise SystemExit(f"ckpt-operator: bad log format {log_format!r} (json or plain)")
    peering = ns.peering or _bool(_env(env, "peering") or "false")
    verbose = bool(ns.verbose) or _bool(_env(env, "verbose") or "false")
    secrets = (
        ns.read_storage_secrets
        if ns.read_storage_secrets is not None
        else _bool(_env(env, "read-storage-secrets") or "true")
    )
    cert_dir = pick("webhook_cert_dir", "webhook-cert-dir")
    sans = tuple(ns.webhook_extra_san or ()) or tuple(
        s for s in (_env(env, "webhook-extra-sans") or "").replace(",", " ").split() if s
    )
    webhook = WebhookConfig(
        enabled=ns.webhook if ns.webhook is not None else _bool(_env(env, "webhook") or "true"),
        listen=pick("webhook_listen", "webhook-listen") or WebhookConfig.listen,
        port=int(pick("webhook_port", "webhook-port") or WebhookConfig.port),
        cert_dir=Path(cert_dir) if cert_dir else None,
        generate_certs=bool(ns.webhook_generate_certs)
        or _bool(_env(env, "webhook-generate-certs") or "false"),
        host=pick("webhook_host", "webhook-host"),
        extra_sans=sans,
        managed=pick("webhook_managed", "webhook-managed"),
    )
    command = pick("sidecar_command", "sidecar-command")
    injection = InjectionConfig(
        agent_image=pick("agent_image", "agent-image") or "",
        sidecar_command=tuple(command.split()) if command else InjectionConfig.sidecar_command,
    )
    retention = RetentionConfig(
        enabled=ns.retention
        if ns.retention is not None
        else _bool(_env(env, "retention") or "true"),
        tick_s=float(pick("retention_tick", "retention-tick") or RetentionConfig.tick_s),
        gc_grace_s=float(pick("gc_grace", "gc-grace") or RetentionConfig.gc_grace_s),
    )
    if webhook.enabled and webhook.cert_dir is None and not webhook.generate_certs:
        raise SystemExit(
            "ckpt-operator: the webhook needs a certificate: --webhook-cert-dir DIR "
            "(tls.crt, tls.key, ca.crt) or --webhook-generate-certs; or --webhook=false"
        )
    return OperatorConfig(
        namespaces=namespaces,
        standalone=not peering,
        liveness=liveness,
        metrics_port=metrics_port,
        log_format=log_format,
        verbose=verbose,
        read_storage_secrets=secrets,
        webhook=webhook,
        injection=injection,
        retention=retention,
    )
