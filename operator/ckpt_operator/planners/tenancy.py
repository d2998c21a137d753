"""Tenancy: what a policy may make the operator touch, and whose run a run is (pure).

The operator acts for every namespace with one identity and, often, one set of
mounted volumes. A CheckpointPolicy is written by a tenant, so everything it
names is checked here before any storage is opened:

* a local path must lie under a path the administrator granted to the
  policy's namespace (``tenancy.localPaths``);
* a custom S3 endpoint must be one the administrator allowed
  (``tenancy.allowedS3Endpoints``): no request, signed or not, ever goes to a
  URL a tenant picked (server-side request forgery);
* the operator's own cloud identity (no credentials Secret) is used only for
  the namespace/bucket/prefix the administrator granted
  (``tenancy.operatorIdentity``).

And a run belongs to the namespace recorded in its ``OWNER.json``
(:mod:`ckpt_agent.format.owner`): the operator never lists, deletes or
restarts from a run owned by another namespace.

Storage error text that reaches a status or an Event goes through
:func:`summarize_error`: one line, bounded, no control characters, never a
response body.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from ckpt_agent.policy import CheckpointPolicySpec, StorageType
from ckpt_operator.model.config import ANY_NAMESPACE, TenancyConfig

__all__ = [
    "MAX_ERROR_CHARS",
    "endpoint_allowed",
    "owner_refusal",
    "path_under",
    "storage_refusal",
    "summarize_error",
]

#: Longest error summary written into a status or an Event.
MAX_ERROR_CHARS = 200

_DEFAULT_PORTS = {"http": 80, "https": 443}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def _endpoint(url: str) -> tuple[str, str, str] | None:
    """``(scheme, host, port)`` of an endpoint URL; port ``*`` allowed; None if malformed."""
    any_port = url.endswith(":*")
    try:
        parts = urlsplit(url[:-2] if any_port else url)
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in _DEFAULT_PORTS or not host or parts.username or parts.password:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return None
    if any_port:
        return scheme, host, "*"
    return scheme, host, str(port if port is not None else _DEFAULT_PORTS[scheme])


def endpoint_allowed(endpoint: str, allowed: Sequence[str]) -> bool:
    """Whether ``endpoint`` is one of ``allowed`` (scheme, host and port; ``host:*``: any
    port). An endpoint with a path, a query or credentials is never allowed."""
    want = _endpoint(endpoint)
    if want is None or want[2] == "*":
        return False
    for entry in allowed:
        have = _endpoint(entry)
        if have is not None and have[:2] == want[:2] and have[2] in ("*", want[2]):
            return True
    return False


def path_under(path: str, root: str) -> bool:
    """Whether absolute ``path`` is ``root`` or below it (after normalisation: no ``..``)."""
    if not path.startswith("/") or not root.startswith("/"):
        return False
    p, r = posixpath.normpath(path), posixpath.normpath(root)
    return p == r or p.startswith(r.rstrip("/") + "/")


def _prefix_under(prefix: str, root: str) -> bool:
    p, r = prefix.strip("/"), root.strip("/")
    return not r or p == r or p.startswith(r + "/")


def _for(grant_namespace: str, namespace: str) -> bool:
    return grant_namespace in (ANY_NAMESPACE, namespace)


def storage_refusal(
    namespace: str,
    spec: CheckpointPolicySpec,
    tenancy: TenancyConfig,
    *,
    operator_identity: bool,
) -> str | None:
    """Why the operator must not open the storage a policy of ``namespace`` names (None: ok).

    ``operator_identity``: the operator would use its own credentials (the policy
    names no credentials Secret, or the operator reads no Secrets).
    """
    storage = spec.storage
    if storage.type == StorageType.LOCAL:
        path = storage.local.path
        if any(
            _for(g.namespace, namespace) and path_under(path, g.path) for g in tenancy.local_paths
        ):
            return None
        return (
            f"local path {path} is not granted to namespace {namespace}: an administrator "
            "lists it in the chart's tenancy.localPaths (the operator does not touch it)"
        )
    s3 = storage.s3
    assert s3 is not None
    if s3.endpoint and not endpoint_allowed(s3.endpoint, tenancy.allowed_s3_endpoints):
        return (
            f"S3 endpoint {s3.endpoint!r} is not allowed: an administrator lists it in the "
            "chart's tenancy.allowedS3Endpoints (no request was sent to it)"
        )
    if operator_identity and not any(
        _for(g.namespace, namespace)
        and g.bucket == s3.bucket
        and _prefix_under(s3.prefix, g.prefix)
        for g in tenancy.operator_identity
    ):
        return (
            f"bucket {s3.bucket}/{s3.prefix} needs credentials: name a Secret in "
            "spec.storage.s3.credentialsSecret, or an administrator grants namespace "
            f"{namespace} the operator's own identity (chart value tenancy.operatorIdentity)"
        )
    return None


def owner_refusal(run_id: str, owner_namespace: str, namespace: str) -> str | None:
    """Why a job or policy of ``namespace`` may not use run ``run_id`` (None: it may)."""
    if owner_namespace == namespace:
        return None
    return (
        f"run {run_id} belongs to namespace {owner_namespace}, not {namespace}: its "
        "checkpoints are not listed, deleted or restarted from here; give the job its own "
        f"run id (remove or change its ckpt.dev/run-id annotation)"
    )


def summarize_error(error: BaseException, limit: int = MAX_ERROR_CHARS) -> str:
    """``"<ErrorClass>: <first line of the message>"`` through the one sanitizer
    (:func:`ckpt_agent.text.clean`: control and bidi characters spelled out, at most
    ``limit`` characters): what may reach a status or an Event (never a response body, which
    follows the first line)."""
    from ckpt_agent.text import clean

    text = str(error).strip()
    first = text.split("\n", 1)[0].strip() if text else ""
    return clean(f"{type(error).__name__}: {first or 'no details'}", limit)
