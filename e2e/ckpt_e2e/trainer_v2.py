"""Kubeflow Trainer v2 and JobSet, the real controllers, on a :class:`LocalCluster`.

Opt-in (the PyTorchJob scenarios never pay for it): :class:`TrainerV2` installs, on a
running cluster,

* the CRDs as the pinned Go modules ship them: ``jobsets.jobset.x-k8s.io``
  (``sigs.k8s.io/jobset`` ``config/components/crd/bases``) and ``trainjobs``,
  ``trainingruntimes``, ``clustertrainingruntimes`` of ``trainer.kubeflow.org``
  (``github.com/kubeflow/trainer/v2`` ``manifests/base/crds``), read from the Go module
  cache (``ckpt_e2e.tools.module_dir``);
* the JobSet controller (``e2e/tools/jobset``) and the Trainer controller manager
  (``e2e/tools/trainer``) as local processes logging in with the admin kubeconfig, each
  from a ``Configuration`` file: no leader election, metrics off, health probes and the
  webhook server on free 127.0.0.1 ports, and their own certificate management
  (cert-controller's rotator, which needs an in-cluster Service and Secret) switched off:
  the webhook servers serve a certificate from the cluster's CA instead (JobSet:
  ``webhook.certDir``; Trainer has no such field, so ``TMPDIR`` points controller-runtime's
  default ``$TMPDIR/k8s-webhook-server/serving-certs`` at it);
* their admission webhooks, from the modules' own ``manifests.yaml`` (plus the
  ``objectSelector`` patches their kustomizations add), with ``clientConfig.url`` on
  127.0.0.1 and that CA as ``caBundle`` instead of an in-cluster Service;
* the torch ``ClusterTrainingRuntime`` (:func:`torch_runtime`): upstream's
  ``torch-distributed`` with the example trainer's "image", ``restartPolicy: Never`` and
  ``backoffLimit: 0`` (a failed pod fails its Job at once) and a JobSet
  ``failurePolicy.maxRestarts``, so a crashed trainer comes back as a JobSet restart
  attempt (every Job, hence every pod, recreated; label ``jobset.sigs.k8s.io/restart-attempt``).

The chain TrainJob → JobSet (Trainer) → Jobs (JobSet) → Pods (kube-controller-manager's
Job controller) → kwok node runs unchanged; the pods run locally through
``ckpt_e2e.kubelet.PodRunner(job_label=JOBSET_NAME_LABEL, container="node")``.
TrainJob manifests and waits: ``ckpt_e2e.trainjob``.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import yaml

from . import tools
from .api import free_port, http_get
from .cluster import LocalCluster
from .errors import ClusterError
from .procs import ManagedProcess, clean_env, record_pid, wait_until
from .training import IMAGE

JOBSET_MODULE = "sigs.k8s.io/jobset"
TRAINER_MODULE = "github.com/kubeflow/trainer/v2"
RUNTIME_NAME = "torch-distributed"
#: the replicated job (and container) of the torch runtime that runs the trainer
NODE = "node"
#: JobSet's restart budget in the default runtime: above the policies' (recovery.maxRestarts),
#: so the operator's budget is what ends a crash loop
DEFAULT_MAX_RESTARTS = 5

JOBSET_WEBHOOK_SELECTOR = {
    "matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]
}
TRAINER_WEBHOOK_SELECTOR = {
    "matchExpressions": [
        {
            "key": "trainer.kubeflow.org/webhook-validation",
            "operator": "NotIn",
            "values": ["disabled"],
        }
    ]
}


# --------------------------------------------------------------------------- module files
def jobset_dir() -> Path:
    return tools.module_dir("jobset", JOBSET_MODULE)


def trainer_dir() -> Path:
    return tools.module_dir("trainer", TRAINER_MODULE)


def crd_files() -> dict[str, Path]:
    """CRD name -> file, JobSet's first (the Trainer controller watches JobSets)."""
    crds = trainer_dir() / "manifests" / "base" / "crds"
    jobsets = jobset_dir() / "config" / "components" / "crd" / "bases"
    out = {"jobsets.jobset.x-k8s.io": jobsets / "jobset.x-k8s.io_jobsets.yaml"}
    for plural in ("trainjobs", "trainingruntimes", "clustertrainingruntimes"):
        out[f"{plural}.trainer.kubeflow.org"] = crds / f"trainer.kubeflow.org_{plural}.yaml"
    return out


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    """The documents of a YAML file (libyaml's loader when there: the CRDs are ~3 MB)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [d for d in yaml.load_all(path.read_text(), Loader=loader) if d]


def webhook_configurations(
    jobset_url: str, trainer_url: str, ca_bundle: str
) -> Iterator[dict[str, Any]]:
    """Both projects' webhook configurations, pointed at ``*_url`` (``https://host:port``)."""
    sources = (
        (
            "jobset",
            jobset_dir() / "config" / "components" / "webhook" / "manifests.yaml",
            jobset_url,
        ),
        (
            "trainer",
            trainer_dir() / "manifests" / "base" / "webhook" / "manifests.yaml",
            trainer_url,
        ),
    )
    for project, path, url in sources:
        for doc in yaml_docs(path):
            kind = doc["kind"]
            doc["metadata"] = {
                "name": _webhook_configuration_name(project, kind),
                "labels": {"e2e.ckpt.dev/component": project},
            }
            for hook in doc["webhooks"]:
                svc = hook["clientConfig"].pop("service")
                hook["clientConfig"] = {"url": url + svc["path"], "caBundle": ca_bundle}
                hook["timeoutSeconds"] = 10
                _add_selector(project, hook)
            yield doc


def _webhook_configuration_name(project: str, kind: str) -> str:
    """The names the projects' kustomizations give them (Trainer's cert manager uses them)."""
    mutating = kind == "MutatingWebhookConfiguration"
    if project == "trainer":
        return "defaulter.trainer.kubeflow.org" if mutating else "validator.trainer.kubeflow.org"
    return f"jobset-{'mutating' if mutating else 'validating'}-webhook-configuration"


def _add_selector(project: str, hook: dict[str, Any]) -> None:
    """The ``objectSelector`` patches of the kustomizations (config/components/webhook/patches
    in JobSet: pod webhooks only for JobSet pods; manifests/base/webhook in Trainer)."""
    resources = {r for rule in hook.get("rules") or () for r in rule.get("resources") or ()}
    if project == "jobset" and resources == {"pods"}:
        hook["objectSelector"] = JOBSET_WEBHOOK_SELECTOR
    elif project == "trainer" and resources & {"clustertrainingruntimes", "trainingruntimes"}:
        hook["objectSelector"] = TRAINER_WEBHOOK_SELECTOR


def torch_runtime(
    name: str = RUNTIME_NAME,
    *,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    termination_grace_seconds: int = 30,
) -> dict[str, Any]:
    """Upstream's torch ``ClusterTrainingRuntime`` (manifests/base/runtimes), for local pods.

    Changed: the name, the image (never pulled: the harness runs the pods), the pods'
    ``restartPolicy: Never`` and the Jobs' ``backoffLimit: 0`` (a failed trainer fails its
    Job, and JobSet's ``failurePolicy`` restarts the whole JobSet, at most
    ``max_restarts`` times), and the grace period a deleted pod gets.
    """
    path = trainer_dir() / "manifests" / "base" / "runtimes" / "torch_distributed.yaml"
    (rt,) = yaml_docs(path)
    rt["metadata"]["name"] = name
    jobset_spec = rt["spec"]["template"]["spec"]
    jobset_spec["failurePolicy"] = {"maxRestarts": max_restarts}
    (node,) = [r for r in jobset_spec["replicatedJobs"] if r["name"] == NODE]
    job_spec = node["template"]["spec"]
    job_spec["backoffLimit"] = 0
    pod_spec = job_spec["template"]["spec"]
    pod_spec["restartPolicy"] = "Never"
    pod_spec["terminationGracePeriodSeconds"] = termination_grace_seconds
    for ctr in pod_spec["containers"]:
        ctr["image"] = IMAGE
    return dict(rt)


# --------------------------------------------------------------------------- the controllers
class TrainerV2:
    """JobSet and the Trainer v2 controller manager on ``cluster`` (see the module docstring).

    :meth:`start` is idempotent; :meth:`stop` stops both controllers and removes their
    webhook configurations (the CRDs and runtimes stay: the cluster is a test cluster).
    """

    def __init__(self, cluster: LocalCluster, *, max_restarts: int = DEFAULT_MAX_RESTARTS) -> None:
        self.cluster = cluster
        self.max_restarts = max_restarts
        self.dir = cluster.workdir / "trainer-v2"
        self.procs: dict[str, ManagedProcess] = {}
        self.ports: dict[str, int] = {}
        self.timings: dict[str, float] = {}
        self.webhooks: list[tuple[str, str]] = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 120.0) -> Self:
        if self.procs:
            return self
        t0 = time.monotonic()
        binaries = {n: tools.binary(n) for n in ("jobset", "trainer-controller-manager")}
        self.timings["binaries"] = time.monotonic() - t0
        self._install_crds(timeout)
        cert_dir = self._serving_cert()
        try:
            self._start_jobset(binaries["jobset"], cert_dir, timeout)
            self._start_trainer(binaries["trainer-controller-manager"], cert_dir, timeout)
            self._register_webhooks()
            self.apply_runtime(torch_runtime(max_restarts=self.max_restarts), timeout)
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        for kind, name in self.webhooks:
            self.cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
        self.webhooks.clear()
        for name in reversed(list(self.procs)):
            self.procs.pop(name).stop()
            self.cluster.procs.pop(name, None)

    @property
    def running(self) -> bool:
        return bool(self.procs) and all(p.running for p in self.procs.values())

    # ------------------------------------------------------------------ setup steps
    def _install_crds(self, timeout: float) -> None:
        t0 = time.monotonic()
        crds = crd_files()
        args = ["apply", "--server-side", "--field-manager=ckpt-e2e"]
        for path in crds.values():
            args += ["-f", str(path)]
        self.cluster.kubectl(*args)  # ~3 MB: too big for client-side apply's annotation
        for name in crds:
            self.cluster.wait_crd_established(name, timeout)
        self.timings["crds"] = time.monotonic() - t0

    def _serving_cert(self) -> Path:
        """tls.crt/tls.key for both webhook servers, from the cluster's CA."""
        ca = self.cluster.ca
        assert ca is not None
        pair = ca.serving_cert("trainer-v2-webhooks", ["127.0.0.1", "localhost"])
        certs = self.dir / "tmp" / "k8s-webhook-server" / "serving-certs"
        certs.mkdir(parents=True, exist_ok=True)
        (certs / "tls.crt").write_bytes(pair.cert.read_bytes())
        (certs / "tls.key").write_bytes(pair.key.read_bytes())
        (certs / "tls.key").chmod(0o600)
        return certs

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        log = self.cluster.log_dir / f"{name}.log"
        p = ManagedProcess(name, argv, log, env=env, detached=self.cluster.persistent).start()
        self.procs[name] = p
        self.cluster.procs[name] = p  # check_alive, diagnostics and stop see it too
        record_pid(self.cluster.workdir, p)
        return p

    def _wait_ready(self, name: str, timeout: float) -> None:
        t0 = time.monotonic()
        port = self.ports[f"{name}-health"]
        proc = self.procs[name]

        def alive() -> None:
            if not proc.running:
                raise ClusterError(f"{name} exited rc={proc.poll()}:\n{proc.tail(4000)}")

        wait_until(
            lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200,
            timeout,
            f"{name} /readyz",
            on_poll=alive,
        )
        self.timings[name] = time.monotonic() - t0

    def _start_jobset(self, binary: Path, cert_dir: Path, timeout: float) -> None:
        health, hook = free_port(), free_port()
        self.ports.update({"jobset-controller-health": health, "jobset-webhook": hook})
        config = {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": hook, "host": "127.0.0.1", "certDir": str(cert_dir)},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
            "clientConnection": {"qps": 100, "burst": 200},
        }
        path = self.dir / "jobset-config.yaml"
        path.write_text(yaml.safe_dump(config))
        env = clean_env({"KUBECONFIG": str(self.cluster.kubeconfig)})
        argv = [str(binary), f"--config={path}", "--metrics-bind-address=0", "--zap-devel=false"]
        self._spawn("jobset-controller", argv, env)
        self._wait_ready("jobset-controller", timeout)

    def _start_trainer(self, binary: Path, cert_dir: Path, timeout: float) -> None:
        health, hook = free_port(), free_port()
        self.ports.update({"trainer-controller-health": health, "trainer-webhook": hook})
        config = {
            "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
            "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "certManagement": {"enable": False},
            "webhook": {"port": hook, "host": "127.0.0.1"},
            "metrics": {"bindAddress": "0", "secureServing": False},
            "health": {
                "healthProbeBindAddress": f"127.0.0.1:{health}",
                "readinessEndpointName": "readyz",
                "livenessEndpointName": "healthz",
            },
            "clientConnection": {"qps": 100, "burst": 200},
        }
        path = self.dir / "trainer-config.yaml"
        path.write_text(yaml.safe_dump(config))
        # controller-runtime's default CertDir is $TMPDIR/k8s-webhook-server/serving-certs
        env = clean_env(
            {"KUBECONFIG": str(self.cluster.kubeconfig), "TMPDIR": str(cert_dir.parents[1])}
        )
        self._spawn("trainer-controller", [str(binary), f"--config={path}"], env)
        self._wait_ready("trainer-controller", timeout)

    def _register_webhooks(self) -> None:
        ca = self.cluster.ca
        assert ca is not None
        bundle = base64.b64encode(ca.cert_pem).decode()
        for doc in webhook_configurations(
            f"https://127.0.0.1:{self.ports['jobset-webhook']}",
            f"https://127.0.0.1:{self.ports['trainer-webhook']}",
            bundle,
        ):
            self.cluster.apply(doc)
            self.webhooks.append((doc["kind"].lower(), doc["metadata"]["name"]))

    def apply_runtime(self, runtime: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """``kubectl apply`` a (Cluster)TrainingRuntime; retried while the webhooks warm up."""
        self.cluster.wait_for(
            lambda: self.cluster.kubectl("apply", "-f", "-", input=json.dumps(runtime)),
            timeout=timeout,
            what=f"{runtime['kind']} {runtime['metadata']['name']} applied",
            interval=1.0,
        )
        return runtime
