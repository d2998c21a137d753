"""Tenancy: what a policy may make the operator touch, and whose run a run is (pure).

The operator acts for every namespace with one identity and, often, one set of
mounted volumes. A CheckpointPolicy is written by a tenant, so everything it
names is checked here before any storage is opened:

* a local path must lie under a path the administrator granted to the
  policy's namespace (``tenancy.localPaths``): as written (:func:`storage_refusal`,
  no I/O) and as the kernel will open it (:func:`resolved_refusal`, over the facts
  :func:`ckpt_operator.adapters.sources.resolve_path` gathered): no symbolic link on the
  way may lead outside the namespace's grants, and the storage is then opened from
  the grant (:func:`grant_anchor`) without following links;
* a custom S3 endpoint must be one the administrator allowed
  (``tenancy.allowedS3Endpoints``): no request, signed or not, ever goes to a
  URL a tenant picked (server-side request forgery);
* the operator's own cloud identity (no credentials Secret) is used only for
  the namespace/bucket/prefix the administrator granted
  (``tenancy.operatorIdentity``).

And a run belongs to the namespace recorded in its ``OWNER.json``
(:mod:`ckpt_agent.format.owner`): the operator never lists, deletes or
restarts from a run owned by another namespace, and never claims a run: one
with checkpoints but no owner record (a legacy run) is left alone
(:func:`unclaimed_refusal`) until an administrator claims it (``ckpt claim``).

Storage error text that reaches a status or an Event goes through
:func:`summarize_error`: one line, bounded, no control characters, never a
response body.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from ckpt_agent.policy import CheckpointPolicySpec, StorageType
from ckpt_operator.model.config import ANY_NAMESPACE, TenancyConfig

__all__ = [
    "MAX_ERROR_CHARS",
    "PathLink",
    "ResolvedPath",
    "endpoint_allowed",
    "grant_anchor",
    "granted_paths",
    "owner_refusal",
    "path_under",
    "resolved_refusal",
    "storage_refusal",
    "summarize_error",
    "unclaimed_refusal",
]

#: Longest error summary written into a status or an Event.
MAX_ERROR_CHARS = 200

_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class PathLink:
    """A symbolic link met on a written path."""

    path: str
    """The link itself: the written path up to and including it."""
    target: str
    """What the link says (``readlink``)."""
    resolved: str
    """Where it leads (``realpath`` of :attr:`path`)."""


@dataclass(frozen=True)
class ResolvedPath:
    """A written absolute path, the path storage opens for it (``..`` removed as text, then
    links resolved, as :class:`~ckpt_agent.storage.fs.LocalStorage` does), the links met."""

    written: str
    resolved: str
    links: tuple[PathLink, ...] = ()


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


def granted_paths(namespace: str, tenancy: TenancyConfig) -> list[str]:
    """The local paths granted to ``namespace`` (as the administrator wrote them)."""
    return [g.path for g in tenancy.local_paths if _for(g.namespace, namespace)]


def resolved_refusal(namespace: str, path: ResolvedPath, grants: Sequence[str]) -> str | None:
    """Why the operator must not open local ``path`` for ``namespace`` as the kernel resolves
    it (None: it may). ``grants``: the namespace's granted paths, resolved.

    Refused: a symbolic link on the way that leads outside every grant (even when a
    ``..`` after it climbs back in), or a resolved path outside every grant.
    """
    for link in path.links:
        if not any(path_under(link.resolved, g) for g in grants):
            return (
                f"local path {path.written!r} leaves the paths granted to namespace "
                f"{namespace} through the symbolic link {link.path!r}, which points to "
                f"{link.target!r} (resolved: {link.resolved!r}); the operator does not follow "
                "it and touches nothing there. Point spec.storage.local.path at a real folder "
                "inside the grant, or have whoever can write the volume remove the link"
            )
    if grant_anchor(path, grants) is None:
        return (
            f"local path {path.written!r} resolves to {path.resolved!r}, which is not under a "
            f"path granted to namespace {namespace} (tenancy.localPaths): the operator does "
            "not touch it"
        )
    return None


def grant_anchor(path: ResolvedPath, grants: Sequence[str]) -> str | None:
    """The outermost resolved grant holding ``path``'s resolved path (None: none does):
    where the storage is opened from without following links."""
    holding = [g for g in grants if path_under(path.resolved, g)]
    return min(holding, key=len) if holding else None


def unclaimed_refusal(run_id: str, namespace: str, checkpoints: int) -> str | None:
    """Why the operator leaves run ``run_id`` alone although no namespace owns it (None:
    it has no checkpoints: a new run, which its writer claims at start)."""
    if checkpoints <= 0:
        return None
    return (
        f"run {run_id} has {checkpoints} checkpoint(s) but no owner record (OWNER.json: "
        "written before owner records existed, or by a trainer outside Kubernetes): the "
        "operator neither deletes nor restarts from it. An administrator who knows whose "
        f"it is claims it: ckpt claim --storage <url> --run-id {run_id} --namespace "
        f"{namespace}"
    )


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
