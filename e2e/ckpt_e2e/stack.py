"""The operator on the local control plane: the real chart, the real operator, least privilege.

:func:`install_chart` ``helm upgrade --install``\\ s ``charts/ckpt-operator`` with the real
``helm``: the API server validates and stores everything the chart makes (CRD, RBAC,
ServiceAccount, webhook configurations, the webhook TLS Secret, Services, the
Deployment, whose pod kwok "runs" on a fake node). The only e2e-specific value is
``webhook.url``: the webhook configurations point the API server at
``https://127.0.0.1:<port>`` instead of the in-cluster Service (no pod network here),
and Helm adds ``127.0.0.1`` to the certificate it generates.

kwok runs no containers, so :class:`OperatorProcess` runs the operator as a local
process *in the Deployment's place*:

* its flags are the Deployment's container ``args`` as the API server stored them (so a
  chart/CLI mismatch fails here), with only the listen addresses changed to free
  127.0.0.1 ports (``--liveness``, ``--metrics-port``, plus ``--webhook-listen``);
* ``--webhook-cert-dir`` holds the chart's TLS Secret (``ca.crt``, ``tls.crt``,
  ``tls.key``) written out like the kubelet mounts it, so the API server verifies the
  Helm-generated certificate against the Helm-generated ``caBundle``;
* it authenticates as the chart's ServiceAccount with a token from the TokenRequest API
  (``kubectl create token``), in a kubeconfig: every call it makes is authorized by the
  chart's ClusterRole, nothing more.

With the operator image built (``scripts/build-images.sh``; ``CKPT_E2E_OPERATOR``, see
``ckpt_e2e.image``), the operator runs *from the image* instead of this repository's
virtualenv: ``buildah run --isolation chroot`` starts the image's entry point with the
Deployment's ``args`` (listen addresses changed as above), its ``env``, the pod's
``runAsUser``/``runAsGroup``, its secret and emptyDir volumes at their ``mountPath`` (files
group-owned by ``fsGroup``), and a ServiceAccount token, ``ca.crt`` and ``namespace`` at
``/var/run/secrets/kubernetes.io/serviceaccount`` with ``KUBERNETES_SERVICE_HOST``/``PORT``:
the in-cluster configuration a kubelet gives the pod. The host network is shared (the
webhook and probes listen on 127.0.0.1); of the host's files it sees only its volumes: the
shared checkpoint root (``pvc_dir``) because the chart's values mount it as a real install
would (``storage.extraVolumes``, a ``hostPath`` here), never a pod-only PVC folder.

It can be killed (SIGKILL) and restarted; its log is ``<cluster workdir>/logs/ckpt-operator.log``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import ssl
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml

from .api import free_port, no_proxy_opener, write_kubeconfig
from .cluster import LocalCluster
from .errors import ClusterError
from .image import Container, operator_image
from .podrun import container_run, materialize_secret, service_account_token
from .procs import ManagedProcess, clean_env, wait_until
from .tools import REPO_ROOT

CHART_DIR = REPO_ROOT / "charts" / "ckpt-operator"
DEFAULT_RELEASE = "ckpt"
DEFAULT_NAMESPACE = "ckpt-system"
POLICY_CRD = "checkpointpolicies.ckpt.dev"
#: How the API server words an RBAC refusal (``... is forbidden: User "..." cannot ...``).
RBAC_DENIED = re.compile(r'forbidden: User "[^"]*" cannot')


@dataclass(frozen=True)
class ChartInstall:
    """What ``helm install`` made (names as the chart derives them)."""

    release: str
    namespace: str
    fullname: str
    webhook_port: int
    values: Mapping[str, Any] = field(default_factory=dict)

    @property
    def service_account(self) -> str:
        return self.fullname

    @property
    def sa_user(self) -> str:
        """The ServiceAccount's user name (for ``kubectl auth can-i --as=...``)."""
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"

    @property
    def tls_secret(self) -> str:
        return f"{self.fullname}-webhook-tls"

    @property
    def webhook_url(self) -> str:
        return f"https://127.0.0.1:{self.webhook_port}"


@dataclass
class Stack:
    """The installed chart and the operator process standing in for its Deployment."""

    cluster: LocalCluster
    install: ChartInstall
    operator: OperatorProcess

    @classmethod
    def up(cls, cluster: LocalCluster, values: Mapping[str, Any] | None = None) -> Stack:
        """``helm install`` the chart and start the operator (see the module docstring)."""
        install = install_chart(cluster, values=values)
        operator = OperatorProcess(cluster, install, image=operator_image())
        return cls(cluster, install, operator.start())

    @contextlib.contextmanager
    def upgraded(self, values: Mapping[str, Any], *, expect_arg: str) -> Iterator[None]:
        """The chart upgraded with ``values`` and the operator restarted from it (its
        Deployment then carries ``expect_arg``); both put back afterwards."""
        port = self.install.webhook_port
        install_chart(self.cluster, webhook_port=port, values=values)
        self.operator.restart()
        try:
            assert expect_arg in self.operator.deployment_args(), self.operator.deployment_args()
            yield
        finally:
            install_chart(self.cluster, webhook_port=port)
            self.operator.restart()

    def down(self, uninstall: bool = False) -> None:
        self.operator.stop()
        self.operator.remove_container()
        if uninstall:
            self.cluster.helm(
                "uninstall", self.install.release, "-n", self.install.namespace, check=False
            )


#: The chart's extra volume for the shared checkpoint root (``cluster.pvc_dir``).
SHARED_VOLUME = "shared-checkpoints"


def e2e_values(webhook_port: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Chart values for a local run: webhook URL on 127.0.0.1, readable logs, quick loops."""
    values: dict[str, Any] = {
        "webhook": {"url": f"https://127.0.0.1:{webhook_port}", "port": webhook_port},
        "operator": {
            "logFormat": "plain",
            # storage is a local folder only this machine writes to: no in-flight writers
            # from elsewhere, so unreferenced blobs may go right away
            "gcGraceSeconds": 1,
            "extraArgs": {"retention-tick": 1},
        },
    }
    return _merge(values, extra or {})


def _merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = (
            _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
        )
    return out


def install_chart(
    cluster: LocalCluster,
    *,
    release: str = DEFAULT_RELEASE,
    namespace: str = DEFAULT_NAMESPACE,
    webhook_port: int | None = None,
    values: Mapping[str, Any] | None = None,
    timeout: float = 180.0,
) -> ChartInstall:
    """``helm upgrade --install`` the chart and wait until the Deployment is available."""
    port = webhook_port or free_port()
    # Every namespace's PVC folder lives under pvc_dir, the one storage root the "pods" and
    # the operator share (an NFS-like volume the operator's Deployment mounts, as a real
    # install declares it: storage.extraVolumes); runs are kept apart by their owner
    # records. Folders outside it (Scenario.pvc_storage) the operator never sees. Local
    # MinIO servers listen on 127.0.0.1.
    tenancy = {
        "localPaths": [{"namespace": "*", "path": str(cluster.pvc_dir)}],
        "allowedS3Endpoints": ["http://127.0.0.1:*"],
    }
    storage = {
        "extraVolumes": {
            SHARED_VOLUME: {"hostPath": {"path": str(cluster.pvc_dir), "type": "DirectoryOrCreate"}}
        },
        "extraVolumeMounts": {SHARED_VOLUME: {"mountPath": str(cluster.pvc_dir)}},
    }
    vals = e2e_values(port, _merge({"tenancy": tenancy, "storage": storage}, values or {}))
    if cluster.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        cluster.create_namespace(namespace)
    values_file = cluster.workdir / f"values-{release}.yaml"
    values_file.write_text(yaml.safe_dump(vals, sort_keys=False))
    cluster.helm(
        "upgrade",
        "--install",
        release,
        str(CHART_DIR),
        "--namespace",
        namespace,
        "--values",
        str(values_file),
        "--wait",
        f"--timeout={int(timeout)}s",
        timeout=timeout + 30,
    )
    cluster.wait_crd_established(POLICY_CRD)
    wait_policy_api_served(cluster)
    manifest = cluster.helm("get", "manifest", release, "--namespace", namespace).stdout
    deployments = [
        d
        for d in yaml.safe_load_all(manifest)
        if isinstance(d, dict) and d.get("kind") == "Deployment"
    ]
    if len(deployments) != 1:
        raise ClusterError(f"chart rendered {len(deployments)} Deployments, expected 1")
    fullname = str(deployments[0]["metadata"]["name"])
    return ChartInstall(release, namespace, fullname, port, vals)


def wait_policy_api_served(cluster: LocalCluster, timeout: float = 60.0) -> None:
    """Wait until discovery lists ``checkpointpolicies/status`` and a list succeeds.

    "Established" comes before the API is fully served (a list can still answer 429
    "storage is (re)initializing"); an operator that discovers the API in that window
    may not see the status subresource and its status patches get lost.
    """

    def served() -> bool:
        discovery = cluster.request("GET", "/apis/ckpt.dev/v1alpha1")
        names = {r.get("name") for r in discovery.get("resources") or []}
        if "checkpointpolicies/status" not in names:
            return False
        cluster.request("GET", "/apis/ckpt.dev/v1alpha1/checkpointpolicies?limit=1")
        return True

    cluster.wait_for(served, timeout=timeout, what="the CheckpointPolicy API served")


def service_account_kubeconfig(
    cluster: LocalCluster,
    namespace: str,
    service_account: str,
    path: Path,
    duration: str = "24h",
) -> Path:
    """A kubeconfig authenticating as ``namespace/service_account`` (TokenRequest API)."""
    token = service_account_token(cluster, namespace, service_account, duration)
    assert cluster.ca is not None
    user = f"system:serviceaccount:{namespace}:{service_account}"
    return write_kubeconfig(path, cluster.server, cluster.ca.cert_path, user, {"token": token})


def _replace_flag(args: list[str], flag: str, value: str | None) -> list[str]:
    """Drop ``--flag=...`` from ``args`` and append ``--flag=value`` (unless value is None)."""
    out = [a for a in args if a != flag and not a.startswith(flag + "=")]
    if value is not None:
        out.append(f"{flag}={value}")
    return out


class OperatorProcess:
    """``ckpt-operator`` running locally as the chart's Deployment would (module docstring)."""

    def __init__(
        self,
        cluster: LocalCluster,
        install: ChartInstall,
        *,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 90.0,
        image: str | None = None,
    ) -> None:
        self.cluster = cluster
        self.install = install
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.dir = cluster.workdir / "operator"
        self.tls_dir = self.dir / "tls"
        self.token_path: Path | None = None  # the mounted ServiceAccount token (image mode)
        #: the working container it runs in (None: a local process from this virtualenv)
        self.container = Container(image) if image else None
        self.log_path = cluster.log_dir / "ckpt-operator.log"
        self.process: ManagedProcess | None = None
        self.argv: list[str] = []
        self.health_port = 0
        self.metrics_port = 0
        self.starts = 0

    # ------------------------------------------------------------------ lifecycle
    def pod_spec(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The Deployment's pod spec and its operator container, as the API server stored them."""
        dep = self.cluster.request(
            "GET",
            f"/apis/apps/v1/namespaces/{self.install.namespace}/deployments/{self.install.fullname}",
        )
        pod: dict[str, Any] = dep["spec"]["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == "operator"]
        return pod, container

    def deployment_args(self) -> list[str]:
        """The operator container's args as the API server stored them."""
        return [str(a) for a in self.pod_spec()[1].get("args") or []]

    def _local_args(self, args: list[str]) -> list[str]:
        """Probes and metrics on free 127.0.0.1 ports, the webhook on 127.0.0.1."""
        self.health_port, self.metrics_port = free_port(), free_port()
        args = _replace_flag(args, "--liveness", f"http://127.0.0.1:{self.health_port}/healthz")
        args = _replace_flag(args, "--metrics-port", str(self.metrics_port))
        return _replace_flag(args, "--webhook-listen", "127.0.0.1")

    def _build(self) -> tuple[list[str], dict[str, str]]:
        if self.container is not None:
            return self._build_in_container(self.container), clean_env()
        cert_dir = materialize_secret(
            self.cluster, self.install.namespace, self.install.tls_secret, self.tls_dir
        )
        kubeconfig = service_account_kubeconfig(
            self.cluster,
            self.install.namespace,
            self.install.service_account,
            self.dir / "kubeconfig",
        )
        args = self._local_args(self.deployment_args())
        args = _replace_flag(args, "--webhook-cert-dir", str(cert_dir))
        exe = Path(sys.executable).with_name("ckpt-operator")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt_operator.app.main"]
        env = clean_env({"KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": self.install.namespace})
        return [*cmd, *args, *self.extra_args], env

    def _build_in_container(self, container: Container) -> list[str]:
        """``buildah run`` as a kubelet would start the Deployment's pod (module docstring)."""
        pod, spec = self.pod_spec()
        spec = {**spec, "args": self._local_args([str(a) for a in spec.get("args") or []])}
        run = container_run(
            self.cluster,
            container,
            pod,
            spec,
            namespace=self.install.namespace,
            service_account=self.install.service_account,
            volumes_dir=self.dir / "volumes",
            extra_args=self.extra_args,
        )
        self.tls_dir = run.secret_dirs.get(self.install.tls_secret, self.tls_dir)
        self.token_path = run.token_path
        return run.argv

    def start(self) -> Self:
        """Start it and wait until kopf is healthy and the webhook serves TLS."""
        if self.running:
            return self
        argv, env = self._build()
        self.argv = argv
        self.starts += 1
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"\n===== ckpt-operator start #{self.starts} at {time.strftime('%X')} =====\n")
        self.process = ManagedProcess(
            "ckpt-operator",
            argv,
            self.log_path,
            env=env,
            grace=10.0,
            detached=self.cluster.persistent,
        ).start()
        if self.cluster.persistent:  # ``python -m ckpt_e2e down`` stops it with the rest
            with open(self.cluster.workdir / "pids", "a") as f:
                f.write(f"{self.process.pid} ckpt-operator\n")
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        def alive() -> None:
            self.cluster.check_alive()
            if self.process is None or not self.process.running:
                raise ClusterError(f"ckpt-operator exited:\n{self.tail()}")

        wait_until(
            lambda: self._healthy() and self._webhook_serves(),
            self.startup_timeout,
            "ckpt-operator healthy and serving its webhooks",
            interval=0.3,
            on_poll=alive,
        )

    def _healthy(self) -> bool:
        try:
            opener = no_proxy_opener()
            with opener.open(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return int(r.status) == 200
        except OSError:
            return False

    def _webhook_serves(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.tls_dir / "ca.crt"))
        try:
            with (
                socket.create_connection(("127.0.0.1", self.install.webhook_port), timeout=2) as s,
                ctx.wrap_socket(s, server_hostname="127.0.0.1"),
            ):
                return True
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.running

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL (no cleanup at all: what a node crash or an OOM kill does)."""
        if self.process is None:
            return
        self.process.signal_group(signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.process.wait(timeout=10)
        self.process.stop(grace=0)

    def freeze(self) -> None:
        """SIGSTOP: the process stops mid-flight, its connections stay open."""
        if self.process is not None:
            self.process.signal_group(signal.SIGSTOP)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def release(self) -> None:
        """Leave it running (persistent clusters) and forget it here."""
        if self.process is not None:
            self.process.release()
            self.process = None

    def token_user(self) -> str:
        """Whom the mounted ServiceAccount token authenticates (a TokenReview; image mode)."""
        assert self.token_path is not None, "no mounted token: the operator runs as a process"
        review = self.cluster.request(
            "POST",
            "/apis/authentication.k8s.io/v1/tokenreviews",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": self.token_path.read_text()},
            },
        )
        assert review["status"].get("authenticated"), review["status"]
        return str(review["status"]["user"]["username"])

    def remove_container(self) -> None:
        """Remove the working container it ran in (stop it first)."""
        if self.container is not None:
            self.container.remove()

    def restart(self) -> Self:
        self.stop()
        return self.start()

    # ------------------------------------------------------------------ observation
    def log_offset(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, max_bytes: int = 6000) -> str:
        text = self.log_since(max(0, self.log_offset() - max_bytes))
        return text

    def metrics(self) -> str:
        opener = no_proxy_opener()
        with opener.open(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        total = 0.0
        want = dict(labels or {})
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)", line)
            if m is None or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in want.items()):
                total += float(m.group(3))
        return total

    def forbidden_lines(self, offset: int = 0) -> list[str]:
        """Log lines since ``offset`` where RBAC refused the operator a request.

        (Other 403s, e.g. "namespace is being terminated" while a test namespace is
        deleted, are not about its rights.)
        """
        return [line for line in self.log_since(offset).splitlines() if RBAC_DENIED.search(line)]


def can_i(cluster: LocalCluster, user: str, verb: str, resource: str, *extra: str) -> bool:
    """``kubectl auth can-i VERB RESOURCE --as=USER`` (the admin impersonates ``user``)."""
    res = cluster.kubectl("auth", "can-i", verb, resource, *extra, f"--as={user}", check=False)
    answer = res.stdout.strip()
    if answer not in ("yes", "no"):
        raise ClusterError(f"kubectl auth can-i {verb} {resource}: {res.stdout}{res.stderr}")
    return answer == "yes"


def rules_of(cluster: LocalCluster, user: str, namespace: str | None = None) -> dict[str, set[str]]:
    """``kubectl auth can-i --list`` for ``user`` (in ``namespace``): resource → verbs.

    Resources are ``plural`` (core) or ``plural.group``, subresources ``.../sub``.
    Non-resource URLs and the self-review resources every authenticated user has
    (``selfsubject*reviews``) are left out.
    """
    ns = [f"--namespace={namespace}"] if namespace else []
    out = cluster.kubectl("auth", "can-i", "--list", f"--as={user}", *ns).stdout
    rules: dict[str, set[str]] = {}
    for line in out.splitlines()[1:]:
        if not line.strip() or line[0].isspace():  # header / non-resource URL rows
            continue
        resource = line.split()[0]
        verbs = re.search(r"\[([^\]]*)\]\s*$", line)
        if resource.startswith("selfsubject") or verbs is None:
            continue
        rules.setdefault(resource, set()).update(verbs.group(1).split())
    return rules
