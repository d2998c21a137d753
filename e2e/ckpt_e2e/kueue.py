"""Kueue, the real controller manager, on a :class:`LocalCluster` (issue #30).

Opt-in like :mod:`ckpt_e2e.trainer_v2` (only the Kueue scenarios pay for it).
:class:`Kueue` installs, on a running cluster,

* the CRDs as the pinned module ``sigs.k8s.io/kueue`` (``e2e/tools/kueue``) ships them
  (``config/components/crd/bases``, read from the Go module cache: ``tools.module_dir``);
  the bases declare no conversion webhook, so the API server serves the stored
  ``v1beta2`` as is (the harness and the operator use ``v1beta2`` only);
* the controller manager (``cmd/kueue``) as a local process logging in with the admin
  kubeconfig, from a ``Configuration`` file (:func:`manager_config`): leader election off,
  ``manageJobsWithoutQueueName: false`` (only jobs labelled with a queue are Kueue's), the
  ``kubeflow.org/pytorchjob`` and ``trainer.kubeflow.org/trainjob`` integrations, health
  probes and the webhook server on free 127.0.0.1 ports, metrics off, and its internal
  certificate management (cert-controller's rotator, which needs an in-cluster Service and
  Secret) off: the webhook server serves a certificate from the cluster's CA
  (``webhook.certDir``); feature gates :data:`FEATURE_GATES` (``PriorityBoost`` on, the
  visibility API server, MultiKueue and TAS off: nothing here uses them);
* its admission webhooks, from the module's ``config/components/webhook/manifests.yaml``,
  only those for Kueue's own objects and the two enabled integrations (the pod, Job,
  Deployment, ... webhooks would put Kueue on the path of every pod the other components
  create), with ``clientConfig.url`` on 127.0.0.1 and that CA as ``caBundle``.

Kueue quirk worked around: with its internal certificate management off, ``cmd/kueue``
loads a metrics serving certificate from the fixed path ``/etc/kueue/metrics/certs``
(``tls.crt``/``tls.key``, where a cert-manager install mounts it) and exits without one,
even with the metrics server off. The process therefore runs in a private mount namespace
(``unshare --mount``; ``--user --map-root-user`` as well when not root) where ``/etc`` is an
overlay holding that folder with a certificate from the cluster's CA: nothing is written
outside the cluster's workdir and no other process sees it.

Helpers build the queueing objects (:func:`resource_flavor`, :func:`cluster_queue`,
:func:`local_queue`, :func:`workload_priority_class`), apply them (:meth:`Kueue.apply`),
label jobs for a queue (:func:`queue_labels`) and read a job's Workload
(:meth:`Kueue.workload_of`, :func:`workload_condition`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Self

import yaml

from . import tools
from .api import free_port, http_get
from .cluster import LocalCluster
from .errors import ClusterError
from .procs import ManagedProcess, clean_env, record_pid, wait_until
from .trainer_v2 import yaml_docs

KUEUE_MODULE = "sigs.k8s.io/kueue"
BINARY = "kueue"
API_VERSION = "kueue.x-k8s.io/v1beta2"
WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads"

QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
PRIORITY_BOOST_ANNOTATION = "kueue.x-k8s.io/priority-boost"

#: The integrations the harness enables (names as ``pkg/controller/jobs`` registers them).
FRAMEWORKS = ("kubeflow.org/pytorchjob", "trainer.kubeflow.org/trainjob")
#: ``--feature-gates``: the boost on; what would need in-cluster extras off.
FEATURE_GATES = {
    "PriorityBoost": True,
    "VisibilityOnDemand": False,
    "MultiKueue": False,
    "TopologyAwareScheduling": False,
}
#: Resources (besides ``kueue.x-k8s.io``'s own) whose webhooks are registered.
INTEGRATION_RESOURCES = frozenset({"pytorchjobs", "trainjobs"})
#: Where ``cmd/kueue`` reads its metrics certificate when internal cert management is off.
METRICS_CERT_DIR = "/etc/kueue/metrics/certs"

# The wrapper run inside the private mount namespace: $1 a scratch folder, $2 the folder
# with tls.crt/tls.key, the rest the kueue command line.
_OVERLAY_SCRIPT = f"""set -eu
scratch="$1"; certs="$2"; shift 2
mount -t tmpfs -o size=4m,mode=0755 ckpt-e2e-kueue "$scratch"
mkdir "$scratch/upper" "$scratch/work"
mount -t overlay ckpt-e2e-kueue \\
  -o "lowerdir=/etc,upperdir=$scratch/upper,workdir=$scratch/work" /etc
mkdir -p {METRICS_CERT_DIR}
cp "$certs/tls.crt" "$certs/tls.key" {METRICS_CERT_DIR}/
exec "$@"
"""


# --------------------------------------------------------------------------- module files
def kueue_dir() -> Path:
    return tools.module_dir("kueue", KUEUE_MODULE)


def crd_files() -> dict[str, Path]:
    """CRD name -> file, every CRD of ``config/components/crd/bases``."""
    bases = kueue_dir() / "config" / "components" / "crd" / "bases"
    out: dict[str, Path] = {}
    for path in sorted(bases.glob("kueue.x-k8s.io_*.yaml")):
        plural = path.stem.removeprefix("kueue.x-k8s.io_")
        out[f"{plural}.kueue.x-k8s.io"] = path
    if "workloads.kueue.x-k8s.io" not in out:
        raise ClusterError(f"no Kueue CRDs under {bases} (is e2e/tools/kueue pinned right?)")
    return out


def webhook_configurations(url: str, ca_bundle: str) -> Iterator[dict[str, Any]]:
    """Kueue's webhook configurations, pointed at ``url`` (``https://host:port``), with only
    the webhooks for Kueue's objects and :data:`INTEGRATION_RESOURCES`."""
    path = kueue_dir() / "config" / "components" / "webhook" / "manifests.yaml"
    for doc in yaml_docs(path):
        mutating = doc["kind"] == "MutatingWebhookConfiguration"
        doc["metadata"] = {
            "name": f"kueue-{'mutating' if mutating else 'validating'}-webhook-configuration",
            "labels": {"e2e.ckpt.dev/component": "kueue"},
        }
        hooks = []
        for hook in doc["webhooks"]:
            if not _wanted(hook):
                continue
            svc = hook["clientConfig"].pop("service")
            hook["clientConfig"] = {"url": url + svc["path"], "caBundle": ca_bundle}
            hook["timeoutSeconds"] = 10
            hooks.append(hook)
        doc["webhooks"] = hooks
        yield doc


def _wanted(hook: Mapping[str, Any]) -> bool:
    for rule in hook.get("rules") or ():
        groups = set(rule.get("apiGroups") or ())
        resources = set(rule.get("resources") or ())
        if "kueue.x-k8s.io" in groups or resources & INTEGRATION_RESOURCES:
            return True
    return False


def manager_config(health_port: int, webhook_port: int, cert_dir: Path) -> dict[str, Any]:
    """The controller manager's ``Configuration`` (``apis/config/v1beta2``)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "clientConnection": {"qps": 100, "burst": 200},
        "integrations": {"frameworks": list(FRAMEWORKS)},
    }


def feature_gates_flag() -> str:
    return ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())


# --------------------------------------------------------------------------- manifests
def resource_flavor(name: str = "default") -> dict[str, Any]:
    """A ResourceFlavor with no node labels (every node of the cluster)."""
    return {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": name}}


def cluster_queue(
    name: str,
    quota: Mapping[str, str],
    *,
    flavor: str = "default",
    within_cluster_queue: str = "LowerPriority",
) -> dict[str, Any]:
    """A ClusterQueue with ``quota`` (resource -> nominal quota) of one flavor, preempting
    ``within_cluster_queue`` (``Never``, ``LowerPriority``, ``LowerOrNewerEqualPriority``)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": list(quota),
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [{"name": r, "nominalQuota": q} for r, q in quota.items()],
                        }
                    ],
                }
            ],
            "preemption": {"withinClusterQueue": within_cluster_queue},
        },
    }


def local_queue(name: str, cluster_queue_name: str) -> dict[str, Any]:
    """A LocalQueue (apply it in the jobs' namespace) feeding ``cluster_queue_name``."""
    return {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": name},
        "spec": {"clusterQueue": cluster_queue_name},
    }


def workload_priority_class(name: str, value: int) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": name},
        "value": value,
        "description": "ckpt-e2e",
    }


def queue_labels(queue: str, priority_class: str | None = None) -> dict[str, str]:
    """The labels that put a job in LocalQueue ``queue`` (with a WorkloadPriorityClass)."""
    labels = {QUEUE_NAME_LABEL: queue}
    if priority_class:
        labels[PRIORITY_CLASS_LABEL] = priority_class
    return labels


def with_labels(manifest: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, Any]:
    """A copy of a job manifest with ``labels`` added to its metadata."""
    out = json.loads(json.dumps(manifest))
    out["metadata"].setdefault("labels", {}).update(labels)
    return dict(out)


def workload_condition(workload: Mapping[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    """Condition ``ctype`` of a Workload when its status is ``True`` (``Admitted``,
    ``QuotaReserved``, ``Evicted``, ``Preempted``, ``Requeued``, ``Finished``), else None."""
    for c in ((workload or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype and c.get("status") == "True":
            return dict(c)
    return None


# --------------------------------------------------------------------------- the controller
class Kueue:
    """The Kueue controller manager on ``cluster`` (see the module docstring).

    :meth:`start` is idempotent; :meth:`stop` stops the process and removes its webhook
    configurations (the CRDs and queueing objects stay: the cluster is a test cluster).
    """

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.dir = cluster.workdir / "kueue"
        self.proc: ManagedProcess | None = None
        self.ports: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.webhooks: list[tuple[str, str]] = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.running

    @property
    def log_path(self) -> Path:
        return self.cluster.log_dir / "kueue.log"

    def start(self, timeout: float = 120.0) -> Self:
        if self.proc is not None:
            return self
        t0 = time.monotonic()
        binary = tools.binary(BINARY)
        self.timings["binary"] = time.monotonic() - t0
        self._install_crds(timeout)
        cert_dir = self._serving_cert()
        try:
            self._start_manager(binary, cert_dir, timeout)
            self._register_webhooks()
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        for kind, name in self.webhooks:
            self.cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
        self.webhooks.clear()
        if self.proc is not None:
            self.proc.stop()
            self.cluster.procs.pop("kueue", None)
            self.proc = None

    # ------------------------------------------------------------------ setup steps
    def _install_crds(self, timeout: float) -> None:
        t0 = time.monotonic()
        crds = crd_files()
        args = ["apply", "--server-side", "--force-conflicts", "--field-manager=ckpt-e2e"]
        for path in crds.values():
            args += ["-f", str(path)]
        self.cluster.kubectl(*args)  # big CRDs: too big for client-side apply's annotation
        for name in crds:
            self.cluster.wait_crd_established(name, timeout)
        self.timings["crds"] = time.monotonic() - t0

    def _serving_cert(self) -> Path:
        """tls.crt/tls.key from the cluster's CA, for the webhook server and the metrics
        certificate path (see the module docstring)."""
        ca = self.cluster.ca
        assert ca is not None
        pair = ca.serving_cert("kueue-webhook", ["127.0.0.1", "localhost"])
        certs = self.dir / "serving-certs"
        certs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pair.cert, certs / "tls.crt")
        shutil.copyfile(pair.key, certs / "tls.key")
        (certs / "tls.key").chmod(0o600)
        return certs

    def _argv(self, binary: Path, config: Path, cert_dir: Path) -> list[str]:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise ClusterError(
                "Kueue needs `unshare` (util-linux) to run out of cluster: it reads its metrics "
                f"certificate from {METRICS_CERT_DIR} (see ckpt_e2e.kueue); install util-linux"
            )
        scratch = self.dir / "etc-overlay"
        scratch.mkdir(parents=True, exist_ok=True)
        ns = ["--mount", "--propagation", "private"]
        if os.geteuid() != 0:
            ns = ["--user", "--map-root-user", *ns]
        return [
            unshare,
            *ns,
            "sh",
            "-c",
            _OVERLAY_SCRIPT,
            "kueue-overlay",
            str(scratch),
            str(cert_dir),
            str(binary),
            f"--config={config}",
            f"--feature-gates={feature_gates_flag()}",
            "--zap-log-level=2",
        ]

    def _start_manager(self, binary: Path, cert_dir: Path, timeout: float) -> None:
        t0 = time.monotonic()
        health, hook = free_port(), free_port()
        self.ports.update({"health": health, "webhook": hook})
        config = self.dir / "config.yaml"
        config.write_text(yaml.safe_dump(manager_config(health, hook, cert_dir)))
        env = clean_env({"KUBECONFIG": str(self.cluster.kubeconfig)})
        proc = ManagedProcess(
            "kueue",
            self._argv(binary, config, cert_dir),
            self.log_path,
            env=env,
            detached=self.cluster.persistent,
        ).start()
        self.proc = proc
        self.cluster.procs["kueue"] = proc  # check_alive, diagnostics and stop see it too
        record_pid(self.cluster.workdir, proc)

        def alive() -> None:
            if not proc.running:
                raise ClusterError(
                    f"kueue exited rc={proc.poll()} (it runs under `unshare --mount` for its "
                    f"metrics certificate at {METRICS_CERT_DIR}: that needs root or "
                    "unprivileged user namespaces; see ckpt_e2e.kueue):\n" + proc.tail(4000)
                )

        wait_until(
            lambda: http_get(f"http://127.0.0.1:{health}/readyz")[0] == 200,
            timeout,
            "kueue /readyz",
            on_poll=alive,
        )
        self.timings["manager"] = time.monotonic() - t0

    def _register_webhooks(self) -> None:
        ca = self.cluster.ca
        assert ca is not None
        bundle = base64.b64encode(ca.cert_pem).decode()
        url = f"https://127.0.0.1:{self.ports['webhook']}"
        for doc in webhook_configurations(url, bundle):
            self.cluster.apply(doc)
            self.webhooks.append((doc["kind"].lower(), doc["metadata"]["name"]))

    # ------------------------------------------------------------------ objects
    def apply(
        self, manifest: Mapping[str, Any], namespace: str | None = None, timeout: float = 60.0
    ) -> dict[str, Any]:
        """``kubectl apply`` a Kueue object; retried while Kueue's webhooks warm up."""
        self.cluster.wait_for(
            lambda: self.cluster.apply(dict(manifest), namespace=namespace),
            timeout=timeout,
            what=f"{manifest['kind']} {manifest['metadata']['name']} applied",
            interval=1.0,
        )
        return dict(manifest)

    def delete(self, kind: str, name: str, namespace: str | None = None) -> None:
        args = ["delete", kind, name, "--ignore-not-found", "--wait=false"]
        if namespace:
            args += ["-n", namespace]
        self.cluster.kubectl(*args, check=False)

    def workloads(self, namespace: str) -> list[dict[str, Any]]:
        items = self.cluster.request("GET", WORKLOADS.format(namespace=namespace))
        return list(items.get("items") or [])

    def workload_of(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        """The Workload Kueue made for job ``kind``/``name`` (its ownerReference), or None."""
        for wl in self.workloads(namespace):
            for ref in wl["metadata"].get("ownerReferences") or ():
                if ref.get("kind") == kind and ref.get("name") == name:
                    return wl
        return None

    def wait_workload(
        self,
        namespace: str,
        kind: str,
        name: str,
        ctype: str,
        *,
        timeout: float = 60.0,
    ) -> dict[str, Any]:
        """Wait until the job's Workload has condition ``ctype`` True; returns the Workload."""

        def reached() -> dict[str, Any] | None:
            self._check_alive()
            wl = self.workload_of(namespace, kind, name)
            return wl if workload_condition(wl, ctype) else None

        wl = self.cluster.wait_for(
            reached, timeout=timeout, what=f"the Workload of {kind} {namespace}/{name} {ctype}"
        )
        assert isinstance(wl, dict)
        return wl

    def _check_alive(self) -> None:
        if self.proc is None or not self.proc.running:
            tail = self.proc.tail(3000) if self.proc is not None else ""
            raise ClusterError(f"kueue is not running:\n{tail}")
