"""The Kubernetes API, as the handlers use it (the only module that talks to it directly).

:class:`KubeApi` is the interface (unit tests use a fake); :class:`KubernetesApi`
implements it with the official ``kubernetes`` client, run in worker threads.
Objects go in and out as the raw JSON dicts the API server speaks, so the
builders see exactly what a real server returns. HTTP errors are mapped once,
here: 404 → ``None`` or :class:`NotFoundError`, 409 → :class:`ConflictError`, the rest
→ :class:`ApiError` (with the status).

kopf talks to the API server on its own (watches, status patches of the
objects it handles, Events); this client covers the rest: reading the job and
the policy from the webhook, creating restarts, signalling pods, publishing
the policy's ConfigMap.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any, Final, Protocol, cast

from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.model.bodies import continue_token, meta_of

__all__ = [
    "ApiError",
    "ConflictError",
    "KubeApi",
    "KubernetesApi",
    "NotFoundError",
    "ThrottledRefresh",
]

Obj = dict[str, Any]

POLICY_GROUP = "ckpt.dev"
POLICY_VERSION = "v1alpha1"
POLICY_PLURAL = "checkpointpolicies"


class ApiError(Exception):
    """An API call failed; ``status`` is the HTTP status (0: no response)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class NotFoundError(ApiError):
    pass


class ConflictError(ApiError):
    pass


class KubeApi(Protocol):
    """The calls the handlers make (all async, all raw JSON)."""

    # Jobs: a PyTorchJob unless ``kind`` says otherwise (:mod:`ckpt_operator.kinds.registry`).
    async def get_job(
        self, namespace: str, name: str, *, kind: JobKind = PYTORCHJOB
    ) -> Obj | None: ...

    async def list_jobs(self, namespace: str, *, kind: JobKind = PYTORCHJOB) -> list[Obj]: ...

    async def create_job(self, namespace: str, body: Obj, *, kind: JobKind = PYTORCHJOB) -> Obj:
        """Raises :class:`ConflictError` when a job of that name exists."""
        ...

    async def patch_job_annotations(
        self,
        namespace: str,
        name: str,
        annotations: Mapping[str, str | None],
        *,
        kind: JobKind = PYTORCHJOB,
    ) -> Obj | None:
        """The job as patched (None: this client does not say)."""
        ...

    async def patch_job(
        self, namespace: str, name: str, patch: Obj, *, kind: JobKind = PYTORCHJOB
    ) -> Obj | None:
        """JSON merge patch of a job; the job as patched (None: not known)."""
        ...

    async def get_custom(
        self, group: str, version: str, plural: str, namespace: str | None, name: str
    ) -> Obj | None:
        """Any other custom object the operator reads (a JobSet, a Trainer runtime);
        ``namespace`` None: cluster-scoped. None when missing."""
        ...

    async def patch_custom(
        self, group: str, version: str, plural: str, namespace: str, name: str, patch: Obj
    ) -> Obj | None:
        """JSON merge patch of another namespaced custom object (a Kueue Workload's
        annotations); a ``metadata.resourceVersion`` in ``patch`` is a precondition (409 if
        stale). The object as patched (None: not known)."""
        ...

    async def get_policy(self, namespace: str, name: str) -> Obj | None: ...

    async def patch_policy_status(
        self, namespace: str, name: str, status: Obj, *, resource_version: str | None = None
    ) -> None:
        """Merge-patch the status; with ``resource_version`` a precondition (409 if stale)."""
        ...

    async def apply_config_map(self, body: Obj) -> None:
        """Create, or replace the data of, a ConfigMap."""
        ...

    async def create_config_map(self, body: Obj) -> bool:
        """Create a ConfigMap; False when one of that name exists (it is left as it is)."""
        ...

    async def get_node(self, name: str) -> Obj | None:
        """A Node (None when missing)."""
        ...

    async def list_pods(
        self, *, node_name: str | None, label_selector: str, namespace: str | None = None
    ) -> list[Obj]:
        """Pods matching ``label_selector`` (in ``namespace``; None: all namespaces)."""
        ...

    async def patch_pod(self, namespace: str, name: str, patch: Obj) -> None: ...

    async def get_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        """Decoded ``data`` of a Secret (None when missing)."""
        ...

    async def create_secret(self, body: Obj) -> bool:
        """Create a Secret; False when one of that name exists (it is left as it is)."""
        ...


def _error(exc: Exception) -> ApiError:
    status = int(getattr(exc, "status", 0) or 0)
    reason = str(getattr(exc, "reason", "") or exc)
    body = getattr(exc, "body", None)
    if body:
        try:
            reason = str(json.loads(body).get("message") or reason)
        except (ValueError, AttributeError):
            pass
    if status == 404:
        return NotFoundError(status, reason)
    if status == 409:
        return ConflictError(status, reason)
    return ApiError(status, reason)


#: Seconds between two runs of the client's credential refresh (see ThrottledRefresh).
CREDENTIAL_REFRESH_S: Final = 5.0


class ThrottledRefresh:
    """The client's ``refresh_api_key_hook``, run at most once every ``every_s`` seconds.

    The official client runs the hook before every request, and the kubeconfig and
    in-cluster loaders' hook re-applies their whole configuration each time: the host,
    whose setter reads every proxy variable of the environment (tens of µs per call, more
    with a pod's many service variables; ~4 calls per restart, issue #19). The token only
    changes when the in-cluster loader re-reads its file (once a minute) or a kubeconfig
    credential is within 5 minutes of its expiry, so a few seconds late changes nothing.
    The loaders' hook re-installs itself when it runs: this one takes the fresh hook and
    stays in front of it.
    """

    def __init__(
        self,
        hook: Callable[[Any], None],
        *,
        every_s: float = CREDENTIAL_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hook = hook
        self._every_s = every_s
        self._clock = clock
        self._due = -math.inf

    def __call__(self, configuration: Any) -> None:
        now = self._clock()
        if now < self._due:
            return
        self._due = now + self._every_s
        self._hook(configuration)
        fresh = configuration.refresh_api_key_hook
        if fresh is not None and fresh is not self:
            self._hook = fresh
        configuration.refresh_api_key_hook = self


class KubernetesApi:
    """:class:`KubeApi` over the official client (blocking calls in threads).

    ``executor`` runs the blocking calls (None: the loop's default executor); the
    operator gives the webhook and reconciliation separate pools (see ``main.py``).
    Every call gives up after ``timeout_s`` (the client's ``_request_timeout``).
    """

    def __init__(
        self, api_client: Any, *, executor: Executor | None = None, timeout_s: float = 30.0
    ) -> None:
        from kubernetes import client

        self._client = api_client
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)
        self._executor = executor
        self._timeout_s = timeout_s

    @classmethod
    def from_environment(
        cls,
        *,
        executor: Executor | None = None,
        timeout_s: float = 30.0,
        connections: int = 0,
    ) -> KubernetesApi:
        """In-cluster service account, else ``$KUBECONFIG`` / ``~/.kube/config``.

        ``connections``: keep at least that many connections open (the threads that call
        at once); beyond the pool's size every call opens a connection (TLS handshake) and
        drops it (the client's default is 5 per CPU the machine has, not the pod)."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config()  # type: ignore[no-untyped-call]
        settings = client.Configuration.get_default_copy()
        settings.connection_pool_maxsize = max(settings.connection_pool_maxsize or 0, connections)
        if settings.refresh_api_key_hook is not None:
            settings.refresh_api_key_hook = ThrottledRefresh(settings.refresh_api_key_hook)
        return cls(client.ApiClient(settings), executor=executor, timeout_s=timeout_s)

    def with_executor(self, executor: Executor, *, timeout_s: float | None = None) -> KubernetesApi:
        """The same client (connection pool, credentials) on another executor."""
        return KubernetesApi(
            self._client,
            executor=executor,
            timeout_s=self._timeout_s if timeout_s is None else timeout_s,
        )

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        kwargs.setdefault("_request_timeout", self._timeout_s)
        call = functools.partial(fn, *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except ApiException as e:
            raise _error(e) from None

    async def _raw(self, fn: Any, *args: Any, **kwargs: Any) -> Obj:
        resp = await self._call(fn, *args, _preload_content=False, **kwargs)
        return cast(Obj, json.loads(resp.data))

    # ------------------------------------------------------------------ PyTorchJobs
    async def get_job(self, namespace: str, name: str, *, kind: JobKind = PYTORCHJOB) -> Obj | None:
        return await self.get_custom(kind.group, kind.version, kind.plural, namespace, name)

    async def get_custom(
        self, group: str, version: str, plural: str, namespace: str | None, name: str
    ) -> Obj | None:
        try:
            if namespace is None:
                got = await self._call(
                    self._custom.get_cluster_custom_object, group, version, plural, name
                )
            else:
                got = await self._call(
                    self._custom.get_namespaced_custom_object,
                    *(group, version, namespace, plural, name),
                )
            return cast(Obj, got)
        except NotFoundError:
            return None

    async def patch_custom(
        self, group: str, version: str, plural: str, namespace: str, name: str, patch: Obj
    ) -> Obj | None:
        patched = await self._call(
            self._custom.patch_namespaced_custom_object,
            *(group, version, namespace, plural, name, patch),
        )
        return cast(Obj, patched) if isinstance(patched, dict) else None

    async def list_jobs(self, namespace: str, *, kind: JobKind = PYTORCHJOB) -> list[Obj]:
        items: list[Obj] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": 500}
            if token:
                kwargs["_continue"] = token
            page = cast(
                Obj,
                await self._call(
                    self._custom.list_namespaced_custom_object,
                    kind.group,
                    kind.version,
                    namespace,
                    kind.plural,
                    **kwargs,
                ),
            )
            items += page.get("items") or []
            token = continue_token(page)
            if not token:
                return items

    async def create_job(self, namespace: str, body: Obj, *, kind: JobKind = PYTORCHJOB) -> Obj:
        return cast(
            Obj,
            await self._call(
                self._custom.create_namespaced_custom_object,
                kind.group,
                kind.version,
                namespace,
                kind.plural,
                body,
            ),
        )

    async def patch_job_annotations(
        self,
        namespace: str,
        name: str,
        annotations: Mapping[str, str | None],
        *,
        kind: JobKind = PYTORCHJOB,
    ) -> Obj | None:
        return await self.patch_job(
            namespace, name, {"metadata": {"annotations": dict(annotations)}}, kind=kind
        )

    async def patch_job(
        self, namespace: str, name: str, patch: Obj, *, kind: JobKind = PYTORCHJOB
    ) -> Obj | None:
        patched = await self._call(
            self._custom.patch_namespaced_custom_object,
            kind.group,
            kind.version,
            namespace,
            kind.plural,
            name,
            patch,
        )
        return cast(Obj, patched) if isinstance(patched, dict) else None

    # ------------------------------------------------------------------ policies
    async def get_policy(self, namespace: str, name: str) -> Obj | None:
        try:
            return cast(
                Obj,
                await self._call(
                    self._custom.get_namespaced_custom_object,
                    POLICY_GROUP,
                    POLICY_VERSION,
                    namespace,
                    POLICY_PLURAL,
                    name,
                ),
            )
        except NotFoundError:
            return None

    async def patch_policy_status(
        self, namespace: str, name: str, status: Obj, *, resource_version: str | None = None
    ) -> None:
        body: Obj = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        await self._call(
            self._custom.patch_namespaced_custom_object_status,
            POLICY_GROUP,
            POLICY_VERSION,
            namespace,
            POLICY_PLURAL,
            name,
            body,
        )

    # ------------------------------------------------------------------ core
    async def apply_config_map(self, body: Obj) -> None:
        meta = body["metadata"]
        try:
            await self._call(self._core.create_namespaced_config_map, meta["namespace"], body)
        except ConflictError:
            await self._call(
                self._core.patch_namespaced_config_map,
                meta["name"],
                meta["namespace"],
                {"metadata": {"labels": meta.get("labels", {})}, "data": body["data"]},
            )

    async def create_config_map(self, body: Obj) -> bool:
        try:
            await self._raw(
                self._core.create_namespaced_config_map, body["metadata"]["namespace"], body
            )
        except ConflictError:
            return False
        return True

    async def get_node(self, name: str) -> Obj | None:
        try:
            return await self._raw(self._core.read_node, name)
        except NotFoundError:
            return None

    async def list_pods(
        self, *, node_name: str | None, label_selector: str, namespace: str | None = None
    ) -> list[Obj]:
        items: list[Obj] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"label_selector": label_selector, "limit": 500}
            if node_name:
                kwargs["field_selector"] = f"spec.nodeName={node_name}"
            if token:
                kwargs["_continue"] = token
            if namespace:
                page = await self._raw(self._core.list_namespaced_pod, namespace, **kwargs)
            else:
                page = await self._raw(self._core.list_pod_for_all_namespaces, **kwargs)
            for item in page.get("items") or []:
                # list items carry no kind/apiVersion; Events about them need both
                item.setdefault("apiVersion", "v1")
                item.setdefault("kind", "Pod")
                items.append(item)
            token = continue_token(page)
            if not token:
                return items

    async def patch_pod(self, namespace: str, name: str, patch: Obj) -> None:
        await self._call(self._core.patch_namespaced_pod, name, namespace, patch)

    async def ensure_peering(self, name: str) -> None:
        """Create kopf's ``ClusterKopfPeering`` ``name`` unless it exists (leader election)."""
        body = {
            "apiVersion": "kopf.dev/v1",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": name},
        }
        try:
            await self._call(
                self._custom.create_cluster_custom_object,
                "kopf.dev",
                "v1",
                "clusterkopfpeerings",
                body,
            )
        except ConflictError:
            pass

    def post_event(self, body: Obj) -> None:
        """Create a core/v1 Event (blocking; see
        :class:`ckpt_operator.adapters.events.KopfEvents`)."""
        namespace = str(meta_of(body).namespace or "default")
        # the created Event is not decoded (the client's models cost more than the post);
        # a refusal still raises, an answer is read to free its connection
        answer: Any = self._core.create_namespaced_event(
            namespace, cast(Any, body), _request_timeout=self._timeout_s, _preload_content=False
        )
        answer.drain_conn()
        answer.release_conn()

    async def create_secret(self, body: Obj) -> bool:
        try:
            await self._raw(
                self._core.create_namespaced_secret, body["metadata"]["namespace"], body
            )
        except ConflictError:
            return False
        return True

    async def get_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        try:
            secret = await self._raw(self._core.read_namespaced_secret, name, namespace)
        except NotFoundError:
            return None
        return {
            str(k): base64.b64decode(v).decode("utf-8")
            for k, v in (secret.get("data") or {}).items()
        }
