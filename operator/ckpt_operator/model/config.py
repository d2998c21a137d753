"""Operator settings: one dataclass of grouped sub-dataclasses, from flags or env.

Every flag has an environment variable (``CKPT_OPERATOR_<FLAG>``, dashes as
underscores) so the chart can set everything through ``env``; flags win.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_agent.tuning import GC_GRACE_S

__all__ = [
    "IdentityGrant",
    "InjectionConfig",
    "LocalPathGrant",
    "OperatorConfig",
    "RecoveryConfig",
    "RetentionConfig",
    "TenancyConfig",
    "WebhookConfig",
    "parse_config",
    "parse_tenancy",
]

#: A grant whose namespace is this applies to every namespace.
ANY_NAMESPACE = "*"


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
    workers: int = 4
    """Threads for the webhook's own blocking work (API reads on a cache miss, Events);
    separate from reconciliation's, so admission never queues behind it."""
    budget_s: float = 3.0
    """Longest an admission request may take (below the configurations' ``timeoutSeconds``):
    past it an opted-in pod is refused with a message, and the training-operator retries."""


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
    node_pool_labels: tuple[str, ...] = (
        "cloud.google.com/gke-nodepool",
        "eks.amazonaws.com/nodegroup",
        "kubernetes.azure.com/agentpool",
        "karpenter.sh/nodepool",
        "node.kubernetes.io/instance-type",
    )
    """Node labels naming a node's pool, the first present wins: failures and running time
    are kept per pool to refine a run's MTBF (:mod:`ckpt_operator.planners.pools`)."""


@dataclass(frozen=True)
class RetentionConfig:
    """Retention reconciliation."""

    enabled: bool = True
    tick_s: float = 10.0
    """Loop granularity; each policy runs at its own ``retention.reconcileIntervalSeconds``."""
    gc_grace_s: float = GC_GRACE_S
    """Unreferenced blobs younger than this are left alone (a writer may be committing)."""
    budget_s: float = 60.0
    """Longest one policy's pass may work (listing, deleting, blob GC): past it the pass
    stops at the next safe point (between two checkpoints' deletions), reports
    ``RetentionCutShort`` and resumes at its next interval; a slow tenant delays the
    others by at most this."""
    workers: int = 4
    """Policies' passes run at once (each also waits its turn among reconciliation's
    ``--workers`` threads)."""
    max_entries: int = 100_000
    """Storage entries (keys under ``<run>/steps/``) one pass's listings may examine in
    all; a run listed in part gets only its corrupted checkpoints deleted that pass."""
    gc_max_manifest_bytes: int = 8 * 1024 * 1024
    """Largest rank manifest the operator's blob GC parses (~26x its size in memory);
    a run with a larger one gets no blob GC from the operator (``ckpt gc`` can)."""


@dataclass(frozen=True)
class IdentityGrant:
    """The operator may use its own cloud identity for policies of ``namespace`` whose
    bucket is ``bucket`` and whose prefix is ``prefix`` or below it (``""``: the bucket)."""

    namespace: str
    bucket: str
    prefix: str = ""


@dataclass(frozen=True)
class LocalPathGrant:
    """Policies of ``namespace`` may have the operator read/delete under ``path``."""

    namespace: str
    path: str


@dataclass(frozen=True)
class TenancyConfig:
    """What an administrator allows policies to make the operator touch (default: nothing
    but S3 through the policy's own credentials Secret, on AWS's own endpoints)."""

    operator_identity: tuple[IdentityGrant, ...] = ()
    """Where a policy without a credentials Secret may use the operator's identity."""
    local_paths: tuple[LocalPathGrant, ...] = ()
    """Local/shared filesystem paths (mounted into the operator) per namespace."""
    allowed_s3_endpoints: tuple[str, ...] = ()
    """Custom S3 endpoints (``scheme://host[:port]``; ``:*`` any port) a policy may name."""


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
    issue_replica_secrets: bool = False
    """Create each replicating job's Secret ``ckpt-replica-<job>`` (a random key, owned by
    the job) when the webhook admits its first pod (docs/replicas.md). Off: create it by
    hand; the chart's ``rbac.issueReplicaSecrets`` grants the right, bounded."""
    replica_rack_label: str = ""
    """The node label naming a node's rack, for choosing replica peers in other racks
    (docs/replicas.md, "Peers"; empty: racks are not known, only zones and nodes).
    Kubernetes has no standard one."""
    storage_timeout_s: float = 30.0
    """Longest wait for one storage call (opening, listing, claiming, deleting, GC)."""
    verify_timeout_s: float = 3600.0
    """Longest wait for planning a restart (it re-reads every byte of the candidates)."""
    workers: int = 16
    """Threads for reconciliation's blocking work (API calls, storage listing, planning)."""
    api_timeout_s: float = 30.0
    """Longest wait for one Kubernetes API call of the operator's own client."""
    kueue: bool = False
    """Watch Kueue Workloads (``kueue.x-k8s.io``): the priority boost of opted-in jobs and
    the save on eviction (docs/kueue.md). Off: no Workload handler is registered."""
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    webhook: WebhookConfig = field(default_factory=WebhookConfig)
    injection: InjectionConfig = field(default_factory=InjectionConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)


def _env(environ: Mapping[str, str], flag: str) -> str | None:
    value = environ.get("CKPT_OPERATOR_" + flag.upper().replace("-", "_"))
    return value if value not in (None, "") else None


def _entries(doc: dict[str, object], key: str) -> list[dict[str, object]]:
    items = doc.get(key) or []
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError(f"{key} must be a list of objects")
    return items


def _text(item: dict[str, object], key: str, where: str, default: str | None = None) -> str:
    value = item.get(key, default)
    if not isinstance(value, str) or (not value and default is None):
        raise ValueError(f"{where}: {key} must be a non-empty string")
    return value


def parse_tenancy(text: str) -> TenancyConfig:
    """``{"operatorIdentity": [{namespace, bucket, prefix}], "localPaths": [{namespace,
    path}], "allowedS3Endpoints": [url]}`` (the chart's ``tenancy`` value as JSON)."""
    try:
        doc = json.loads(text) if text.strip() else {}
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        identity = tuple(
            IdentityGrant(
                _text(i, "namespace", "operatorIdentity"),
                _text(i, "bucket", "operatorIdentity"),
                _text(i, "prefix", "operatorIdentity", "").strip("/"),
            )
            for i in _entries(doc, "operatorIdentity")
        )
        paths = tuple(
            LocalPathGrant(_text(i, "namespace", "localPaths"), _text(i, "path", "localPaths"))
            for i in _entries(doc, "localPaths")
        )
        endpoints = doc.get("allowedS3Endpoints") or []
        if not isinstance(endpoints, list) or not all(isinstance(e, str) and e for e in endpoints):
            raise ValueError("allowedS3Endpoints must be a list of URLs")
    except ValueError as e:
        raise SystemExit(f"ckpt-operator: bad --tenancy: {e}") from None
    for grant in paths:
        if not grant.path.startswith("/"):
            raise SystemExit(
                f"ckpt-operator: bad --tenancy: localPaths {grant.path!r}: not absolute"
            )
    return TenancyConfig(identity, paths, tuple(endpoints))


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
    a(
        "--verbose",
        "-v",
        action="store_true",
        default=None,
        help="debug logging, plus kopf's per-object INFO lines ('Handler ... succeeded'), "
        "hidden otherwise",
    )
    a(
        "--read-storage-secrets",
        type=_bool,
        help="read S3 credential Secrets named by policies (default true)",
    )
    a(
        "--issue-replica-secrets",
        type=_bool,
        help="create the Secret ckpt-replica-<job> of each job with spec.agent.replicas "
        "(default false: created by hand, docs/replicas.md)",
    )
    a(
        "--replica-rack-label",
        help="node label naming a node's rack: replica peers are chosen in other zones "
        "(topology.kubernetes.io/zone), else other racks, else other nodes (default: none)",
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
    a(
        "--retention-budget",
        type=float,
        help="longest retention pass of one policy, seconds (default 60)",
    )
    a("--retention-workers", type=int, help="policies' retention passes at once (default 4)")
    a(
        "--retention-max-entries",
        type=int,
        help="storage entries one pass may list (default 100000)",
    )
    a(
        "--gc-max-manifest-bytes",
        type=int,
        help="largest rank manifest the blob GC parses (default 8 MiB)",
    )
    a("--storage-timeout", type=float, help="longest wait per storage call, seconds (default 30)")
    a("--verify-timeout", type=float, help="longest restart planning, seconds (default 3600)")
    a("--workers", type=int, help="threads for reconciliation's blocking work (default 16)")
    a("--api-timeout", type=float, help="longest wait per Kubernetes API call (default 30)")
    a("--webhook-workers", type=int, help="threads for the webhook's blocking work (default 4)")
    a(
        "--node-pool-label",
        action="append",
        default=None,
        help="node label naming a node's pool, for the per-pool MTBF (repeatable, first "
        "present wins; default: GKE, EKS, AKS, Karpenter pools, then the instance type)",
    )
    a(
        "--webhook-budget",
        type=float,
        help="longest admission answer, seconds, below the webhooks' timeoutSeconds (default 3)",
    )
    a(
        "--kueue",
        type=_bool,
        nargs="?",
        const=True,
        help="watch Kueue Workloads: priority boost from the at-risk work, save on eviction "
        "(default false; needs Kueue's CRDs and RBAC on workloads.kueue.x-k8s.io)",
    )
    a(
        "--tenancy",
        help="JSON: what policies may make the operator touch (operatorIdentity, localPaths, "
        "allowedS3Endpoints; default: nothing but S3 through a policy's own Secret)",
    )
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

    def words(name: str, flag: str) -> tuple[str, ...]:
        """A repeatable flag's values, else its variable's (separated by commas or spaces)."""
        given = getattr(ns, name)
        if given:
            return tuple(given)
        return tuple((_env(env, flag) or "").replace(",", " ").split())

    def switch(name: str, flag: str, default: bool) -> bool:
        """A ``--x``/``--x=false`` flag, else its variable, else ``default``."""
        given = getattr(ns, name)
        if given is not None:
            return bool(given)
        text = _env(env, flag)
        return _bool(text) if text else default

    d = OperatorConfig()
    namespaces = words("namespace", "namespaces")
    liveness = pick("liveness", "liveness") or d.liveness
    metrics_port = int(pick("metrics_port", "metrics-port") or d.metrics_port)
    log_format = pick("log_format", "log-format") or d.log_format
    if log_format not in ("json", "plain"):
        raise SystemExit(f"ckpt-operator: bad log format {log_format!r} (json or plain)")
    peering = ns.peering or _bool(_env(env, "peering") or "false")
    verbose = bool(ns.verbose) or _bool(_env(env, "verbose") or "false")
    secrets = switch("read_storage_secrets", "read-storage-secrets", True)
    issue_secrets = switch("issue_replica_secrets", "issue-replica-secrets", False)
    cert_dir = pick("webhook_cert_dir", "webhook-cert-dir")
    sans = words("webhook_extra_san", "webhook-extra-sans")
    webhook = WebhookConfig(
        enabled=switch("webhook", "webhook", True),
        listen=pick("webhook_listen", "webhook-listen") or WebhookConfig.listen,
        port=int(pick("webhook_port", "webhook-port") or WebhookConfig.port),
        cert_dir=Path(cert_dir) if cert_dir else None,
        generate_certs=bool(ns.webhook_generate_certs)
        or _bool(_env(env, "webhook-generate-certs") or "false"),
        host=pick("webhook_host", "webhook-host"),
        extra_sans=sans,
        managed=pick("webhook_managed", "webhook-managed"),
        workers=int(pick("webhook_workers", "webhook-workers") or WebhookConfig.workers),
        budget_s=float(pick("webhook_budget", "webhook-budget") or WebhookConfig.budget_s),
    )
    command = pick("sidecar_command", "sidecar-command")
    injection = InjectionConfig(
        agent_image=pick("agent_image", "agent-image") or "",
        sidecar_command=tuple(command.split()) if command else InjectionConfig.sidecar_command,
    )
    retention = RetentionConfig(
        enabled=switch("retention", "retention", True),
        tick_s=float(pick("retention_tick", "retention-tick") or RetentionConfig.tick_s),
        gc_grace_s=float(pick("gc_grace", "gc-grace") or RetentionConfig.gc_grace_s),
        budget_s=float(pick("retention_budget", "retention-budget") or RetentionConfig.budget_s),
        workers=int(pick("retention_workers", "retention-workers") or RetentionConfig.workers),
        max_entries=int(
            pick("retention_max_entries", "retention-max-entries") or RetentionConfig.max_entries
        ),
        gc_max_manifest_bytes=int(
            pick("gc_max_manifest_bytes", "gc-max-manifest-bytes")
            or RetentionConfig.gc_max_manifest_bytes
        ),
    )
    if not (retention.budget_s > 0 and retention.workers >= 1 and retention.max_entries >= 1):
        raise SystemExit(
            "ckpt-operator: --retention-budget must be > 0, --retention-workers and "
            "--retention-max-entries >= 1"
        )
    storage_timeout = float(pick("storage_timeout", "storage-timeout") or d.storage_timeout_s)
    verify_timeout = float(pick("verify_timeout", "verify-timeout") or d.verify_timeout_s)
    if not (storage_timeout > 0 and verify_timeout > 0):
        raise SystemExit("ckpt-operator: --storage-timeout and --verify-timeout must be > 0")
    if peering and namespaces:
        raise SystemExit(
            "ckpt-operator: --peering uses the cluster-wide ClusterKopfPeering; "
            "it cannot be combined with --namespace (run one replica instead)"
        )
    workers = int(pick("workers", "workers") or d.workers)
    api_timeout = float(pick("api_timeout", "api-timeout") or d.api_timeout_s)
    if workers < 1 or webhook.workers < 1 or api_timeout <= 0 or webhook.budget_s <= 0:
        raise SystemExit(
            "ckpt-operator: --workers and --webhook-workers must be >= 1, "
            "--api-timeout and --webhook-budget > 0"
        )
    tenancy = parse_tenancy(pick("tenancy", "tenancy") or "")
    pool_labels = words("node_pool_label", "node-pool-labels")
    recovery = RecoveryConfig(node_pool_labels=pool_labels or RecoveryConfig.node_pool_labels)
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
        issue_replica_secrets=issue_secrets,
        replica_rack_label=(pick("replica_rack_label", "replica-rack-label") or "").strip(),
        storage_timeout_s=storage_timeout,
        verify_timeout_s=verify_timeout,
        workers=workers,
        api_timeout_s=api_timeout,
        kueue=switch("kueue", "kueue", False),
        tenancy=tenancy,
        webhook=webhook,
        injection=injection,
        recovery=recovery,
        retention=retention,
    )
