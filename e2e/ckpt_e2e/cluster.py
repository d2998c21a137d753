"""A real, local Kubernetes control plane built from pinned Go modules.

``LocalCluster`` starts, all on 127.0.0.1 with free ports and all state in one folder:

* etcd (3.6, ``--unsafe-no-fsync``),
* kube-apiserver 1.34 with RBAC (``Node,RBAC``) and the admission webhooks enabled, a
  serving certificate and an admin client certificate (group ``system:masters``) made at
  start, service-account signing keys,
* kube-controller-manager (garbage collection, namespace deletion, service accounts and
  their tokens, Jobs, node lifecycle, ...),
* kube-scheduler (optional: without it, pods must set ``spec.nodeName``),
* kwok, which plays the kubelet for fake Nodes the harness creates (annotation
  ``kwok.x-k8s.io/node=fake``): pods bound to them become Running and stay so until the
  harness ends them (see ``ckpt_e2e.localpod``),
* the Kubeflow training-operator (PyTorchJob only), after installing its PyTorchJob CRD.

The real ``kubectl`` and ``helm`` binaries are used through :meth:`LocalCluster.kubectl`
and :meth:`LocalCluster.helm`. Components use the admin identity. Everything is torn down
by :meth:`LocalCluster.stop` / the context manager, and as a last resort by an ``atexit``
hook and a parent-death signal (see ``ckpt_e2e.procs``). Logs of each component are in
``<workdir>/logs``; :meth:`LocalCluster.diagnostics` returns their tails.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from . import pki, tools
from .procs import ManagedProcess, clean_env, install_signal_handlers, wait_until

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.1/16"
STAGES_FILE = Path(__file__).parent / "data" / "kwok-stages.yaml"


class ClusterError(RuntimeError):
    """The local cluster failed to start or a client command failed."""


class ApiError(ClusterError):
    """The API server answered a request made by :meth:`LocalCluster.request` with an error."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:2000]}")


class CommandError(ClusterError):
    """``kubectl``/``helm`` exited non-zero."""

    def __init__(self, argv: Sequence[str], result: subprocess.CompletedProcess[str]) -> None:
        self.argv = list(argv)
        self.result = result
        super().__init__(
            f"{' '.join(self.argv)} exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _opener(ctx: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    """A urllib opener that ignores proxy variables (everything here is on 127.0.0.1)."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if ctx is not None:
        handlers.append(urllib.request.HTTPSHandler(context=ctx))
    return urllib.request.build_opener(*handlers)


def _http_get(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with _opener(ctx).open(url, timeout=timeout) as r:
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")


def _insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def stop_workdir(workdir: Path, grace: float = 10.0) -> list[str]:
    """Stop the processes a (persistent) cluster recorded in ``workdir/pids``."""
    pids_file = Path(workdir) / "pids"
    stopped: list[str] = []
    if not pids_file.exists():
        return stopped
    entries = [line.split(maxsplit=1) for line in pids_file.read_text().splitlines() if line]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        for pid, _name in reversed(entries):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pid_alive(int(p)) for p, _ in entries):
            time.sleep(0.2)
    stopped = [f"{name} (pid {pid})" for pid, name in entries]
    pids_file.unlink()
    return stopped


def _pid_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class LocalCluster:
    """Local control plane; use as a context manager or call :meth:`start`/:meth:`stop`.

    Args:
        workdir: folder for all state (PKI, etcd data, logs, kubeconfig); a new temp dir when
            None. A temp dir is removed on a clean stop and kept after a failure.
        scheduler: run kube-scheduler (else pods need ``spec.nodeName``).
        controller_manager: run kube-controller-manager.
        kwok: run kwok and create ``nodes`` fake Nodes.
        training_operator: install the PyTorchJob CRD and run the Kubeflow training-operator.
        nodes: number of kwok Nodes (``kwok-node-0`` ...).
        verbosity: klog ``--v`` for the Kubernetes components.
        startup_timeout: bound for each readiness wait, in seconds.
        keep_workdir: never delete ``workdir`` (also via ``CKPT_E2E_KEEP_WORKDIR=1``).
        persistent: the components may outlive this Python process (no parent-death signal,
            no atexit kill); :meth:`release` leaves them running, and
            ``python -m ckpt_e2e down WORKDIR`` (or :func:`stop_workdir`) stops them later
            using ``WORKDIR/pids``. Implies keep_workdir.
    """

    def __init__(
        self,
        workdir: Path | str | None = None,
        *,
        scheduler: bool = True,
        controller_manager: bool = True,
        kwok: bool = True,
        training_operator: bool = True,
        nodes: int = 1,
        verbosity: int = 1,
        startup_timeout: float = 120.0,
        keep_workdir: bool = False,
        persistent: bool = False,
    ) -> None:
        self.persistent = persistent
        self._own_workdir = workdir is None
        self.workdir = (
            Path(tempfile.mkdtemp(prefix="ckpt-e2e-")) if workdir is None else Path(workdir)
        ).resolve()
        self.with_scheduler = scheduler
        self.with_controller_manager = controller_manager
        self.with_kwok = kwok
        self.with_training_operator = training_operator
        self.node_count = nodes if kwok else 0
        self.verbosity = verbosity
        self.startup_timeout = startup_timeout
        self.keep_workdir = (
            keep_workdir or persistent or os.environ.get("CKPT_E2E_KEEP_WORKDIR") == "1"
        )

        self.pki_dir = self.workdir / "pki"
        self.log_dir = self.workdir / "logs"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.helm_home = self.workdir / "helm"
        self.pods_dir = self.workdir / "pods"
        self.pvc_dir = self.workdir / "pvc"
        self.ca: pki.CertificateAuthority | None = None
        self.admin: pki.CertPair | None = None
        self.procs: dict[str, ManagedProcess] = {}
        self.bin: dict[str, Path] = {}
        self._api_ctx: ssl.SSLContext | None = None
        self._api_opener = _opener(None)
        self.ports: dict[str, int] = {}
        self.node_names: list[str] = []
        self._api_client: Any = None
        self._failed = False
        self._started = False
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self._failed = True
        self.stop()

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def start(self) -> Self:
        """Start every component and wait until each is ready. Raises ClusterError."""
        if self._started:
            return self
        self._started = True
        install_signal_handlers()
        t0 = time.monotonic()
        try:
            self._resolve_binaries()
            self.timings["binaries"] = time.monotonic() - t0
            self._make_pki()
            self._start_etcd()
            self._start_apiserver()
            self._write_kubeconfig()
            if self.with_controller_manager:
                self._start_controller_manager()
            if self.with_scheduler:
                self._start_scheduler()
            if self.with_training_operator:
                self._install_pytorchjob_crd()
                self._start_training_operator()
            if self.with_kwok:
                self._start_kwok()
                for i in range(self.node_count):
                    self.create_node(f"kwok-node-{i}")
            if self.with_controller_manager:
                # The ServiceAccount admission plugin rejects pods until "default" exists.
                self._wait_default_service_account("default")
        except BaseException as e:
            self._failed = True
            diag = self.diagnostics()
            self.stop()
            if isinstance(e, ClusterError | TimeoutError | tools.ToolError):
                raise ClusterError(f"{e}\n{diag}\n(workdir: {self.workdir})") from e
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Stop all components (reverse start order) and remove a temp workdir."""
        if self._api_client is not None:
            with contextlib.suppress(Exception):
                self._api_client.close()
            self._api_client = None
        for name in reversed(list(self.procs)):
            self.procs[name].stop()
        if self._own_workdir and not self.keep_workdir and not self._failed:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def release(self) -> None:
        """Leave the components running (``persistent`` clusters) and forget them here."""
        if self._api_client is not None:
            with contextlib.suppress(Exception):
                self._api_client.close()
            self._api_client = None
        for p in self.procs.values():
            p.release()
        self.procs.clear()

    def mark_failed(self) -> None:
        """Keep the workdir (logs) when the cluster is stopped later."""
        self._failed = True

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

    # ------------------------------------------------------------------ components
    def _resolve_binaries(self) -> None:
        names = ["etcd", "kube-apiserver", "kubectl"]
        if self.with_controller_manager:
            names.append("kube-controller-manager")
        if self.with_scheduler:
            names.append("kube-scheduler")
        if self.with_kwok:
            names.append("kwok")
        if self.with_training_operator:
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
        self.admin = self.ca.client_cert("admin", "kubernetes-admin", ["system:masters"])
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
        with open(self.workdir / "pids", "a") as f:
            f.write(f"{p.pid} {name}\n")
        return p

    def _wait(self, what: str, predicate: Any, component: str) -> None:
        t0 = time.monotonic()

        def alive() -> None:
            p = self.procs.get(component)
            if p is not None and not p.running:
                raise ClusterError(f"{component} exited rc={p.poll()} while waiting for {what}")

        wait_until(predicate, self.startup_timeout, what, on_poll=alive)
        self.timings[component] = time.monotonic() - t0

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
            lambda: _http_get(f"{url_c}/health")[1].find('"health":"true"') >= 0,
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
                f"--v={self.verbosity}",
            ],
        )
        ctx = ssl.create_default_context(cafile=str(self.ca.cert_path))
        ctx.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        self._api_ctx = ctx
        self._api_opener = _opener(ctx)
        self._wait(
            "kube-apiserver /readyz",
            lambda: _http_get(f"{self.server}/readyz", ctx)[0] == 200,
            "kube-apiserver",
        )

    def _write_kubeconfig(self) -> None:
        assert self.ca is not None and self.admin is not None
        self.kubeconfig.write_text(
            self.kubeconfig_yaml(self.admin.cert, self.admin.key, user="kubernetes-admin")
        )
        self.kubeconfig.chmod(0o600)

    def kubeconfig_yaml(self, cert: Path, key: Path, user: str) -> str:
        """A kubeconfig for this cluster that authenticates with a client certificate."""
        assert self.ca is not None
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "ckpt-e2e",
                    "cluster": {
                        "server": self.server,
                        "certificate-authority": str(self.ca.cert_path),
                    },
                }
            ],
            "users": [
                {"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}
            ],
            "contexts": [{"name": "ckpt-e2e", "context": {"cluster": "ckpt-e2e", "user": user}}],
            "current-context": "ckpt-e2e",
        }
        return yaml.safe_dump(cfg, sort_keys=False)

    def kubeconfig_for(self, user: str, groups: Sequence[str] = ()) -> Path:
        """Issue a client certificate for ``user``/``groups`` and write a kubeconfig for it."""
        assert self.ca is not None
        safe = "".join(c if c.isalnum() else "-" for c in user)
        pair = self.ca.client_cert(f"user-{safe}", user, list(groups))
        path = self.workdir / f"kubeconfig-{safe}"
        path.write_text(self.kubeconfig_yaml(pair.cert, pair.key, user=user))
        path.chmod(0o600)
        return path

    def _component_auth_flags(self) -> list[str]:
        return [
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            f"--v={self.verbosity}",
        ]

    def _start_controller_manager(self) -> None:
        assert self.ca is not None
        port = free_port()
        self.ports["kube-controller-manager"] = port
        self._spawn(
            "kube-controller-manager",
            [
                self.bin["kube-controller-manager"],
                *self._component_auth_flags(),
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'controller-manager'}",
                "--controllers=*",
                f"--root-ca-file={self.ca.cert_path}",
                f"--service-account-private-key-file={self.sa_keys.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--use-service-account-credentials=false",
                "--kube-api-qps=100",
                "--kube-api-burst=200",
            ],
        )
        ctx = _insecure_ctx()
        self._wait(
            "kube-controller-manager /healthz",
            lambda: _http_get(f"https://127.0.0.1:{port}/healthz", ctx)[0] == 200,
            "kube-controller-manager",
        )

    def _start_scheduler(self) -> None:
        port = free_port()
        self.ports["kube-scheduler"] = port
        self._spawn(
            "kube-scheduler",
            [
                self.bin["kube-scheduler"],
                *self._component_auth_flags(),
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'scheduler'}",
            ],
        )
        ctx = _insecure_ctx()
        self._wait(
            "kube-scheduler /readyz",
            lambda: _http_get(f"https://127.0.0.1:{port}/readyz", ctx)[0] == 200,
            "kube-scheduler",
        )

    def _install_pytorchjob_crd(self) -> None:
        crd = tools.pytorchjob_crd()
        # ~600 KB: too big for client-side apply's last-applied annotation.
        self.kubectl("apply", "--server-side", "--field-manager=ckpt-e2e", "-f", str(crd))
        # (not "kubectl wait": it errors out while .status.conditions is still empty)
        self.wait_crd_established("pytorchjobs.kubeflow.org")

    def wait_crd_established(self, name: str, timeout: float | None = None) -> None:
        """Wait until CustomResourceDefinition ``name`` is Established (served)."""

        def established() -> bool:
            crd = self.request(
                "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
            )
            conds = (crd.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

        wait_until(
            established,
            timeout or self.startup_timeout,
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
            env=clean_env({"KUBECONFIG": str(self.kubeconfig)}),
        )
        self._wait(
            "training-operator /readyz",
            lambda: _http_get(f"http://127.0.0.1:{probe}/readyz")[0] == 200,
            "training-operator",
        )

    def _start_kwok(self) -> None:
        cfg = self.workdir / "kwok-stages.yaml"
        shutil.copyfile(STAGES_FILE, cfg)
        self._spawn(
            "kwok",
            [
                self.bin["kwok"],
                f"--kubeconfig={self.kubeconfig}",
                f"--config={cfg}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                "--node-ip=127.0.0.1",
                f"--cidr={POD_CIDR}",
                "--node-lease-duration-seconds=40",
                "-v=INFO",
            ],
        )

    def create_node(self, name: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Create a kwok-managed fake Node and wait until kwok reports it Ready."""
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
            "spec": {},
            "status": {
                "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "110"},
                "capacity": {"cpu": "64", "memory": "256Gi", "pods": "110"},
            },
        }
        self.kubectl("create", "-f", "-", input=json.dumps(node))
        t0 = time.monotonic()

        def ready() -> bool:
            obj = self.get_json("node", name)
            conds = obj.get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        wait_until(ready, self.startup_timeout, f"kwok node {name} Ready", on_poll=self.check_alive)
        self.timings.setdefault("kwok", time.monotonic() - t0)
        self.node_names.append(name)
        return self.get_json("node", name)

    # ------------------------------------------------------------------ clients
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
        kubectl = self.bin.get("kubectl") or tools.binary("kubectl")
        return self._run(
            [str(kubectl), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            check=check,
            timeout=timeout,
        )

    def helm(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 300.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run the real helm (built from helm.sh/helm/v3) with its state under the workdir."""
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

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this cluster (admin), closed by stop()."""
        if self._api_client is None:
            from kubernetes import config

            self._api_client = config.new_client_from_config(  # type: ignore[no-untyped-call,unused-ignore]
                config_file=str(self.kubeconfig)
            )
        return self._api_client

    def create_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> str:
        """Create a namespace and wait until its ``default`` ServiceAccount exists."""
        obj = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": dict(labels or {})},
        }
        self.kubectl("create", "-f", "-", input=json.dumps(obj))
        if self.with_controller_manager:
            self._wait_default_service_account(name)
        return name

    def delete_namespace(self, name: str, wait: bool = False, timeout: float = 120.0) -> None:
        """Delete a namespace (the controller-manager empties it)."""
        self.kubectl(
            "delete",
            "namespace",
            name,
            "--ignore-not-found",
            f"--wait={'true' if wait else 'false'}",
            f"--timeout={int(timeout)}s",
            timeout=timeout + 10,
        )

    def _wait_default_service_account(self, namespace: str) -> None:
        wait_until(
            lambda: (
                self.kubectl(
                    "get", "serviceaccount", "default", "-n", namespace, check=False
                ).returncode
                == 0
            ),
            self.startup_timeout,
            f"ServiceAccount {namespace}/default",
            interval=0.3,
            on_poll=self.check_alive,
        )

    def wait_for(
        self,
        predicate: Any,
        timeout: float = 60.0,
        what: str = "condition",
        interval: float = 0.5,
    ) -> Any:
        """Poll ``predicate`` (exceptions count as "not yet"); fail fast if a component died."""
        return wait_until(predicate, timeout, what, interval=interval, on_poll=self.check_alive)

    # ------------------------------------------------------------------ storage
    def create_pvc(
        self, namespace: str, name: str, size: str = "10Gi", timeout: float = 60.0
    ) -> Path:
        """Create PVC ``namespace/name`` bound to a hostPath PV on a local folder; returns it.

        The PV (``<namespace>-<name>``, storageClassName "") is pre-bound to the claim, the
        controller-manager's PV binder binds them, and the scheduler then accepts pods that
        mount the claim. LocalPod runs map the claim's mounts to the same folder, so "pods",
        the operator and tests share it like a ReadWriteMany volume.
        """
        path = self.pvc_dir / namespace / name
        path.mkdir(parents=True, exist_ok=True)
        pv_name = f"{namespace}-{name}"[:253]
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name, "labels": {"e2e.ckpt.dev/local": "true"}},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadWriteMany", "ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                "claimRef": {"namespace": namespace, "name": name},
            },
        }
        pvc = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": size}},
            },
        }
        self.request("POST", "/api/v1/persistentvolumes", pv)
        self.request("POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", pvc)
        if self.with_controller_manager:
            self.wait_for(
                lambda: (
                    self.request(
                        "GET", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}"
                    )
                    .get("status", {})
                    .get("phase")
                    == "Bound"
                ),
                timeout=timeout,
                what=f"PVC {namespace}/{name} Bound",
            )
        return path

    # ------------------------------------------------------------------ pods
    def set_pod_exit(
        self,
        namespace: str,
        name: str,
        exit_code: int,
        *,
        container: str | None = None,
        reason: str | None = None,
        message: str | None = None,
    ) -> dict[str, Any]:
        """Report that a pod's container exited with ``exit_code`` (see ckpt_e2e.localpod)."""
        from .localpod import report_container_exit

        return report_container_exit(
            self, namespace, name, exit_code, container=container, reason=reason, message=message
        )
