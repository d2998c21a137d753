"""A thin client for the local API server: raw REST, kubectl/helm, kubeconfig files.

Everything here talks to 127.0.0.1, so every HTTP call ignores proxy variables.
:class:`KubeClient` is the admin's access (a client certificate in ``system:masters``);
:class:`ckpt_e2e.cluster.LocalCluster` is one. :func:`kubeconfig_yaml` /
:func:`write_kubeconfig` are the one place a kubeconfig is built, for a client
certificate or a bearer token.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from . import tools
from .errors import ApiError, ClusterError, CommandError
from .procs import clean_env, wait_until

CONTEXT = "ckpt-e2e"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def no_proxy_opener(ctx: ssl.SSLContext | None = None) -> urllib.request.OpenerDirector:
    """A urllib opener that ignores proxy variables (everything here is on 127.0.0.1)."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if ctx is not None:
        handlers.append(urllib.request.HTTPSHandler(context=ctx))
    return urllib.request.build_opener(*handlers)


def http_get(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 3.0) -> tuple[int, str]:
    """``(status, body)`` of a GET; an HTTP error status is returned, not raised."""
    try:
        with no_proxy_opener(ctx).open(url, timeout=timeout) as r:
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")


def insecure_ctx() -> ssl.SSLContext:
    """TLS without verification (health endpoints serving self-signed certificates)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def kubeconfig_yaml(server: str, ca_cert: Path, user: str, credentials: Mapping[str, str]) -> str:
    """A kubeconfig for ``server`` as ``user``; ``credentials`` is the user entry
    (``client-certificate`` + ``client-key``, or ``token``)."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {"server": server, "certificate-authority": str(ca_cert)},
            }
        ],
        "users": [{"name": user, "user": dict(credentials)}],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": user}}],
        "current-context": CONTEXT,
    }
    return yaml.safe_dump(cfg, sort_keys=False)


def write_kubeconfig(
    path: Path, server: str, ca_cert: Path, user: str, credentials: Mapping[str, str]
) -> Path:
    """Write :func:`kubeconfig_yaml` to ``path`` (mode 0600); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kubeconfig_yaml(server, ca_cert, user, credentials))
    path.chmod(0o600)
    return path


def cert_credentials(cert: Path, key: Path) -> dict[str, str]:
    """The kubeconfig user entry of a client certificate."""
    return {"client-certificate": str(cert), "client-key": str(key)}


class KubeClient:
    """The admin's access to one API server (see the module docstring).

    ``connect()`` sets the server URL and the TLS context of raw requests once the server
    is up; ``kubectl``/``helm`` use the kubeconfig file. :meth:`check_alive` is the hook
    every wait polls (a no-op here; the cluster raises when a component died).
    """

    def __init__(self, kubeconfig: Path, helm_home: Path) -> None:
        self.kubeconfig = kubeconfig
        self.helm_home = helm_home
        self._server = ""
        self._api_opener = no_proxy_opener()
        self._api_client: Any = None

    @property
    def server(self) -> str:
        if not self._server:
            raise ClusterError("the API server has not been started")
        return self._server

    def connect(self, server: str, ctx: ssl.SSLContext) -> None:
        """Send raw requests to ``server`` with ``ctx`` (CA and client certificate)."""
        self._server = server
        self._api_opener = no_proxy_opener(ctx)

    def check_alive(self) -> None:
        """Raise ClusterError when the cluster behind this client died (hook)."""

    def close(self) -> None:
        """Close the ``kubernetes`` client of :meth:`api_client`, if one was made."""
        if self._api_client is not None:
            with contextlib.suppress(Exception):
                self._api_client.close()
            self._api_client = None

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a client process: KUBECONFIG set, proxies unset."""
        return clean_env({"KUBECONFIG": str(self.kubeconfig), **(extra or {})})

    def _run(
        self,
        argv: list[str],
        *,
        input: str | None,
        check: bool,
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        try:
            res = subprocess.run(
                argv,
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.env(env),
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise ClusterError(f"{' '.join(argv)} timed out after {timeout}s") from e
        if check and res.returncode != 0:
            raise CommandError(argv, res)
        return res

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl (built from k8s.io/kubernetes) against this cluster."""
        return self._run(
            [str(tools.binary("kubectl")), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            check=check,
            timeout=timeout,
        )

    def drain(self, node: str) -> subprocess.CompletedProcess[str]:
        """``kubectl drain`` ``node``: its pods are evicted (SIGTERM, their grace period)."""
        return self.kubectl(
            "drain",
            node,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=90s",
            timeout=120,
        )

    def helm(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 300.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real helm (built from helm.sh/helm/v3) with its state under ``helm_home``."""
        helm_env = {
            "HELM_CACHE_HOME": str(self.helm_home / "cache"),
            "HELM_CONFIG_HOME": str(self.helm_home / "config"),
            "HELM_DATA_HOME": str(self.helm_home / "data"),
        }
        return self._run(
            [str(tools.binary("helm")), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            check=check,
            timeout=timeout,
            env=helm_env,
        )

    def get_json(self, *args: str) -> dict[str, Any]:
        """``kubectl get ARGS -o json`` parsed."""
        out = self.kubectl("get", *args, "-o", "json").stdout
        data: dict[str, Any] = json.loads(out)
        return data

    def apply(self, manifest: str | Mapping[str, Any], namespace: str | None = None) -> str:
        """``kubectl apply -f -`` of a YAML string or one object; returns kubectl's output."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = [f"--namespace={namespace}"] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=text).stdout

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """A raw API request as the admin (e.g. ``request("GET", "/api/v1/nodes")``).

        ``body`` is JSON-encoded; PATCH defaults to a JSON merge patch. Raises ApiError
        (with ``.status``, e.g. 404) for an HTTP error status.
        """
        if method == "PATCH" and content_type == "application/json":
            content_type = "application/merge-patch+json"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={"Content-Type": content_type, "Accept": "application/json"},
        )
        try:
            with self._api_opener.open(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise ApiError(method, path, e.code, e.read().decode(errors="replace")) from None
        out: dict[str, Any] = json.loads(raw) if raw else {}
        return out

    def watch(self, path: str, *, timeout: float = 3600.0) -> Iterator[dict[str, Any]]:
        """The watch events of a list ``path`` (``{"type": ..., "object": ...}``), from
        now on, until the server ends the stream or ``timeout`` seconds pass."""
        sep = "&" if "?" in path else "?"
        req = urllib.request.Request(
            f"{self.server}{path}{sep}watch=1&timeoutSeconds={int(timeout)}",
            headers={"Accept": "application/json"},
        )
        with self._api_opener.open(req, timeout=timeout + 30) as r:
            for line in r:
                if line.strip():
                    yield json.loads(line)

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this cluster (admin), closed by close()."""
        if self._api_client is None:
            from kubernetes import config

            self._api_client = config.new_client_from_config(  # type: ignore[no-untyped-call,unused-ignore]
                config_file=str(self.kubeconfig)
            )
        return self._api_client

    def wait_for(
        self,
        predicate: Callable[[], Any],
        timeout: float = 60.0,
        what: str = "condition",
        interval: float = 0.5,
    ) -> Any:
        """Poll ``predicate`` (exceptions count as "not yet"); fail fast if a component died."""
        return wait_until(predicate, timeout, what, interval=interval, on_poll=self.check_alive)
