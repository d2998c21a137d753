"""Bring up the components of a local control plane and keep track of them.

:class:`ControlPlane` makes the PKI, resolves the pinned binaries (``ckpt_e2e.tools``),
starts each component on free 127.0.0.1 ports and waits until it is ready, in order:
etcd, kube-apiserver (then the admin kubeconfig), kube-controller-manager,
kube-scheduler, the PyTorchJob CRD and the training-operator, kwok and its fake Nodes.
What the components are and why they run with these flags: ``ckpt_e2e.cluster``.
It reaches the API server through a :class:`ckpt_e2e.api.KubeClient` (the cluster).
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import pki, tools
from .api import KubeClient, cert_credentials, free_port, http_get, insecure_ctx, write_kubeconfig
from .errors import ClusterError
from .procs import ManagedProcess, clean_env, record_pid, wait_until

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.1/16"
STAGES_FILE = Path(__file__).parent / "data" / "kwok-stages.yaml"
ADMIN_USER = "kubernetes-admin"


@dataclass(frozen=True)
class ClusterOptions:
    """Which components run, and how (see ``LocalCluster``'s arguments)."""

    scheduler: bool = True
    controller_manager: bool = True
    kwok: bool = True
    training_operator: bool = True
    nodes: int = 1
    verbosity: int = 1
    startup_timeout: float = 120.0


class ControlPlane:
    """The component processes of one cluster under ``workdir`` (see the module docstring).

    ``persistent``: start the components detached (they may outlive this process).
    """

    def __init__(
        self, workdir: Path, options: ClusterOptions, client: KubeClient, *, persistent: bool
    ) -> None:
        self.workdir = workdir
        self.options = options
        self.client = client
        self.persistent = persistent
        self.pki_dir = workdir / "pki"
        self.log_dir = workdir / "logs"
        self.procs: dict[str, ManagedProcess] = {}
        self.bin: dict[str, Path] = {}
        self.ports: dict[str, int] = {}
        self.node_names: list[str] = []
        self.timings: dict[str, float] = {}
        self.ca: pki.CertificateAuthority | None = None
        self.admin: pki.CertPair | None = None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def start(self) -> None:
        """Start every component (see the module docstring) and wait until each is ready."""
        t0 = time.monotonic()
        opts = self.options
        self._resolve_binaries()
        self.timings["binaries"] = time.monotonic() - t0
        self._make_pki()
        self._start_etcd()
        self._start_apiserver()
        if opts.controller_manager:
            self._start_controller_manager()
        if opts.scheduler:
            self._start_scheduler()
        if opts.training_operator:
            self._install_pytorchjob_crd()
            self._start_training_operator()
        if opts.kwok:
            self._start_kwok()
            for i in range(opts.nodes):
                self.create_node(f"kwok-node-{i}")
        if opts.controller_manager:
            # The ServiceAccount admission plugin rejects pods until "default" exists.
            self.wait_default_service_account("default")

    def stop(self) -> None:
        """Stop every component, in reverse start order."""
        for name in reversed(list(self.procs)):
            self.procs[name].stop()

    def release(self) -> None:
        """Leave the components running and forget them here."""
        for p in self.procs.values():
            p.release()
        self.procs.clear()

    def check_alive(self) -> None:
        """Raise ClusterError if a component process has exited."""
        dead = [n for n, p in self.procs.items() if not p.running]
        if dead:
            raise ClusterError(
                f"component(s) exited: {', '.join(f'{n} rc={self.procs[n].poll()}' for n in dead)}"
                f"\n{self.diagnostics(dead)}"
            )

    def diagnostics(self, names: Sequence[str] | None = None, max_bytes: int = 4000) -> str:
        """Tails of the component logs (all, or ``names``)."""
        out = []
        for n, p in self.procs.items():
            if names is None or n in names:
                out.append(f"===== {n} ({p!r}) log {p.log_path} =====\n{p.tail(max_bytes)}")
        return "\n".join(out)

    # ------------------------------------------------------------------ preparation
    def _resolve_binaries(self) -> None:
        opts = self.options
        names = ["etcd", "kube-apiserver", "kubectl"]
        if opts.controller_manager:
            names.append("kube-controller-manager")
        if opts.scheduler:
            names.append("kube-scheduler")
        if opts.kwok:
            names.append("kwok")
        if opts.training_operator:
            names.append("training-operator.v1")
        self.bin = {n: tools.binary(n) for n in names}

    def _make_pki(self) -> None:
        self.ca = pki.CertificateAuthority(self.pki_dir)
        self.apiserver_cert = self.ca.serving_cert(
            "apiserver",
            [
                "127.0.0.1",
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
                "10.96.0.1",
            ],
        )
        self.admin = self.ca.client_cert("admin", ADMIN_USER, ["system:masters"])
        # Front proxy (aggregation layer / requestheader auth), as kubeadm sets it up; without
        # it every component logs "missing content for CA bundle ... requestheader".
        self.front_proxy_ca = pki.CertificateAuthority(
            self.pki_dir, "ckpt-e2e-front-proxy-ca", filename="front-proxy-ca"
        )
        self.front_proxy_client = self.front_proxy_ca.client_cert(
            "front-proxy-client", "front-proxy-client"
        )
        self.sa_keys = pki.service_account_keys(self.pki_dir)

    def _spawn(
        self, name: str, argv: Sequence[str | os.PathLike[str]], **kw: Any
    ) -> ManagedProcess:
        p = ManagedProcess(
            name, argv, self.log_dir / f"{name}.log", detached=self.persistent, **kw
        ).start()
        self.procs[name] = p
        record_pid(self.workdir, p)
        return p

    def _wait(self, what: str, predicate: Callable[[], object], component: str) -> None:
        t0 = time.monotonic()

        def alive() -> None:
            p = self.procs.get(component)
            if p is not None and not p.running:
                raise ClusterError(f"{component} exited rc={p.poll()} while waiting for {what}")

        wait_until(predicate, self.options.startup_timeout, what, on_poll=alive)
        self.timings[component] = time.monotonic() - t0

    # ------------------------------------------------------------------ components
    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.ports["etcd"] = client
        url_c, url_p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        self._spawn(
            "etcd",
            [
                self.bin["etcd"],
                "--name=ckpt-e2e",
                f"--data-dir={self.workdir / 'etcd-data'}",
                f"--listen-client-urls={url_c}",
                f"--advertise-client-urls={url_c}",
                f"--listen-peer-urls={url_p}",
                f"--initial-advertise-peer-urls={url_p}",
                f"--initial-cluster=ckpt-e2e={url_p}",
                "--unsafe-no-fsync=true",
                "--auto-compaction-retention=1",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
        )
        self._wait(
            "etcd /health",
            lambda: http_get(f"{url_c}/health")[1].find('"health":"true"') >= 0,
            "etcd",
        )

    def _start_apiserver(self) -> None:
        assert self.ca is not None and self.admin is not None
        port = free_port()
        self.ports["apiserver"] = port
        self._spawn(
            "kube-apiserver",
            [
                self.bin["kube-apiserver"],
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                f"--cert-dir={self.workdir / 'apiserver'}",
                f"--tls-cert-file={self.apiserver_cert.cert}",
                f"--tls-private-key-file={self.apiserver_cert.key}",
                f"--client-ca-file={self.ca.cert_path}",
                f"--secure-port={port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=MutatingAdmissionWebhook,ValidatingAdmissionWebhook",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.sa_keys.cert}",
                f"--service-account-signing-key-file={self.sa_keys.key}",
                f"--requestheader-client-ca-file={self.front_proxy_ca.cert_path}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={self.front_proxy_client.cert}",
                f"--proxy-client-key-file={self.front_proxy_client.key}",
                "--profiling=false",
                f"--v={self.options.verbosity}",
            ],
        )
        ctx = ssl.create_default_context(cafile=str(self.ca.cert_path))
        ctx.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        self.client.connect(self.server, ctx)
        self._wait(
            "kube-apiserver /readyz",
            lambda: http_get(f"{self.server}/readyz", ctx)[0] == 200,
            "kube-apiserver",
        )
        write_kubeconfig(
            self.client.kubeconfig,
            self.server,
            self.ca.cert_path,
            ADMIN_USER,
            cert_credentials(self.admin.cert, self.admin.key),
        )

    def _start_secured(self, name: str, probe: str, flags: Sequence[str]) -> None:
        """Start a component that logs in with the admin kubeconfig and serves HTTPS on a
        free port (self-signed under ``<workdir>/<name>``); wait until ``probe`` is 200."""
        port = free_port()
        self.ports[name] = port
        self._spawn(
            name,
            [
                self.bin[name],
                f"--kubeconfig={self.client.kubeconfig}",
                f"--authentication-kubeconfig={self.client.kubeconfig}",
                f"--authorization-kubeconfig={self.client.kubeconfig}",
                "--bind-address=127.0.0.1",
                "--leader-elect=false",
                f"--v={self.options.verbosity}",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / name.removeprefix('kube-')}",
                *flags,
            ],
        )
        ctx = insecure_ctx()
        self._wait(
            f"{name} {probe}",
            lambda: http_get(f"https://127.0.0.1:{port}{probe}", ctx)[0] == 200,
            name,
        )

    def _start_controller_manager(self) -> None:
        assert self.ca is not None
        self._start_secured(
            "kube-controller-manager",
            "/healthz",
            [
                "--controllers=*",
                f"--root-ca-file={self.ca.cert_path}",
                f"--service-account-private-key-file={self.sa_keys.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--use-service-account-credentials=false",
                "--kube-api-qps=100",
                "--kube-api-burst=200",
            ],
        )

    def _start_scheduler(self) -> None:
        self._start_secured("kube-scheduler", "/readyz", [])

    def _install_pytorchjob_crd(self) -> None:
        crd = tools.pytorchjob_crd()
        # ~600 KB: too big for client-side apply's last-applied annotation.
        self.client.kubectl("apply", "--server-side", "--field-manager=ckpt-e2e", "-f", str(crd))
        # (not "kubectl wait": it errors out while .status.conditions is still empty)
        self.wait_crd_established("pytorchjobs.kubeflow.org")

    def wait_crd_established(self, name: str, timeout: float | None = None) -> None:
        """Wait until CustomResourceDefinition ``name`` is Established (served)."""

        def established() -> bool:
            crd = self.client.request(
                "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            )
            conds = (crd.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

        wait_until(
            established,
            timeout or self.options.startup_timeout,
            f"CRD {name} Established",
            on_poll=self.check_alive,
        )

    def _start_training_operator(self) -> None:
        metrics, probe = free_port(), free_port()
        self.ports["training-operator"] = probe
        self._spawn(
            "training-operator",
            [
                self.bin["training-operator.v1"],
                "--enable-scheme=pytorchjob",
                f"--metrics-bind-address=127.0.0.1:{metrics}",
                f"--health-probe-bind-address=127.0.0.1:{probe}",
                f"--monitoring-port={free_port()}",
                "--leader-elect=false",
            ],
            env=clean_env({"KUBECONFIG": str(self.client.kubeconfig)}),
        )
        self._wait(
            "training-operator /readyz",
            lambda: http_get(f"http://127.0.0.1:{probe}/readyz")[0] == 200,
            "training-operator",
        )

    def _start_kwok(self) -> None:
        cfg = self.workdir / "kwok-stages.yaml"
        shutil.copyfile(STAGES_FILE, cfg)
        self._spawn(
            "kwok",
            [
                self.bin["kwok"],
                f"--kubeconfig={self.client.kubeconfig}",
                f"--config={cfg}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                "--node-ip=127.0.0.1",
                f"--cidr={POD_CIDR}",
                "--node-lease-duration-seconds=40",
                "-v=INFO",
            ],
        )

    # ------------------------------------------------------------------ API objects
    def create_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        pod_cidr: str | None = None,
        taints: Sequence[Mapping[str, str]] = (),
    ) -> dict[str, Any]:
        """Create a kwok-managed fake Node and wait until kwok reports it Ready.

        ``pod_cidr``: the range kwok gives its pods IPs from (default: kwok's ``--cidr``).
        A loopback range (``127.x.y.0/24``) makes each local pod reachable at its own pod IP
        on this machine, as in a cluster (:mod:`ckpt_e2e.localpod`). ``taints``: keep
        other tests' pods off it."""
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    **(labels or {}),
                },
            },
            "spec": {
                **({} if pod_cidr is None else {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]}),
                **({"taints": [dict(t) for t in taints]} if taints else {}),
            },
            "status": {
                "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "110"},
                "capacity": {"cpu": "64", "memory": "256Gi", "pods": "110"},
            },
        }
        self.client.kubectl("create", "-f", "-", input=json.dumps(node))
        t0 = time.monotonic()

        def ready() -> bool:
            obj = self.client.get_json("node", name)
            conds = obj.get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        wait_until(
            ready,
            self.options.startup_timeout,
            f"kwok node {name} Ready",
            on_poll=self.check_alive,
        )
        self.timings.setdefault("kwok", time.monotonic() - t0)
        self.node_names.append(name)
        return self.client.get_json("node", name)

    def wait_default_service_account(self, namespace: str) -> None:
        """Wait until the controller-manager made ServiceAccount ``namespace/default``."""
        wait_until(
            lambda: (
                self.client.kubectl(
                    "get", "serviceaccount", "default", "-n", namespace, check=False
                ).returncode
                == 0
            ),
            self.options.startup_timeout,
            f"ServiceAccount {namespace}/default",
            interval=0.3,
            on_poll=self.check_alive,
        )
