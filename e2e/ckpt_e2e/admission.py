"""A validating admission webhook served by the test: it can hold a request in flight.

:class:`AdmissionGate` registers a ``ValidatingWebhookConfiguration`` (``clientConfig.url``
on 127.0.0.1, the cluster CA) for CREATEs of PyTorchJobs in one namespace. Requests
for names that match :meth:`AdmissionGate.hold` are held open (the API server waits,
up to ``timeoutSeconds``) until the test :meth:`~AdmissionGate.release`\\ s them with an
allow or a deny. That pins down "the operator's create is on the wire" exactly, to kill
the operator right then.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import re
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any, Self

from .cluster import LocalCluster
from .procs import wait_until


@dataclass
class _Held:
    name: str
    arrived: threading.Event = field(default_factory=threading.Event)
    decided: threading.Event = field(default_factory=threading.Event)
    allowed: bool = True
    message: str = ""


class AdmissionGate:
    """See the module docstring. Use as a context manager."""

    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        *,
        timeout_seconds: int = 30,
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.rule = {
            "apiGroups": ["kubeflow.org"],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pytorchjobs"],
        }
        self.timeout_seconds = timeout_seconds
        self.name = f"ckpt-e2e-gate-{namespace}"[:253]
        self.calls: list[str] = []
        self._patterns: list[re.Pattern[str]] = []
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    def start(self) -> Self:
        assert self.cluster.ca is not None
        pair = self.cluster.ca.serving_cert(f"gate-{self.namespace}", ["127.0.0.1"])
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                allowed, message = gate._decide(review["request"])
                body = json.dumps(
                    {
                        "apiVersion": "admission.k8s.io/v1",
                        "kind": "AdmissionReview",
                        "response": {
                            "uid": review["request"]["uid"],
                            "allowed": allowed,
                            "status": {"message": message, "code": 200 if allowed else 403},
                        },
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(pair.cert), str(pair.key))
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        server.daemon_threads = True
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        self.cluster.apply(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": self.name},
                "webhooks": [
                    {
                        "name": "gate.e2e.ckpt.dev",
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{port}/gate",
                            "caBundle": base64.b64encode(self.cluster.ca.cert_pem).decode(),
                        },
                        "rules": [self.rule],
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": self.namespace}
                        },
                        "sideEffects": "None",
                        "admissionReviewVersions": ["v1"],
                        "failurePolicy": "Fail",
                        "timeoutSeconds": self.timeout_seconds,
                    }
                ],
            }
        )
        self._wait_active()
        return self

    def _wait_active(self) -> None:
        """The configuration takes effect asynchronously: probe with a server dry-run."""
        probe = "ckpt-e2e-gate-probe"
        body = {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": probe, "namespace": self.namespace},
            "spec": {
                "pytorchReplicaSpecs": {
                    "Master": {
                        "replicas": 1,
                        "template": {
                            "spec": {"containers": [{"name": "pytorch", "image": "probe"}]}
                        },
                    }
                }
            },
        }
        path = f"/apis/kubeflow.org/v1/namespaces/{self.namespace}/pytorchjobs?dryRun=All"

        def seen() -> bool:
            with contextlib.suppress(Exception):
                self.cluster.request("POST", path, body)
            return probe in self.calls

        wait_until(seen, 30, "the admission gate consulted by the API server", interval=0.3)

    def _decide(self, request: dict[str, Any]) -> tuple[bool, str]:
        name = str(((request.get("object") or {}).get("metadata") or {}).get("name") or "")
        with self._lock:
            self.calls.append(name)
            held = self._held.get(name)
            if held is None and any(p.fullmatch(name) for p in self._patterns):
                held = self._held[name] = _Held(name)
        if held is None:
            return True, ""
        held.arrived.set()
        held.decided.wait(self.timeout_seconds - 2)
        return held.allowed, held.message

    # ------------------------------------------------------------------ control
    def hold(self, pattern: str) -> None:
        """Hold CREATE requests whose object name fully matches ``pattern`` (a regex)."""
        with self._lock:
            self._patterns.append(re.compile(pattern))

    def stop_holding(self) -> None:
        with self._lock:
            self._patterns.clear()

    def wait_held(self, name: str, timeout: float = 60.0) -> None:
        """Wait until a request for ``name`` is being held."""

        def arrived() -> bool:
            with self._lock:
                held = self._held.get(name)
            return held is not None and held.arrived.is_set()

        self.cluster.wait_for(arrived, timeout=timeout, what=f"a CREATE of {name} held")

    def release(self, name: str, *, allow: bool, message: str = "") -> None:
        with self._lock:
            held = self._held.pop(name)
        held.allowed = allow
        held.message = message or ("allowed by the test" if allow else "denied by the test")
        held.decided.set()

    def close(self) -> None:
        self.stop_holding()
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
        for h in held:
            h.decided.set()
        self.cluster.kubectl(
            "delete", "validatingwebhookconfiguration", self.name, "--ignore-not-found", check=False
        )
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
