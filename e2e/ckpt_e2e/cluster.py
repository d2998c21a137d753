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

Where each part lives: starting and watching the components in ``ckpt_e2e.bootstrap``,
the client side (raw requests, kubectl, helm, kubeconfigs) in ``ckpt_e2e.api``, the
errors in ``ckpt_e2e.errors``; this module puts them together and adds the cluster-level
helpers (namespaces, PVCs, identities).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from . import pki, tools
from .api import KubeClient, cert_credentials, write_kubeconfig
from .bootstrap import ClusterOptions, ControlPlane
from .errors import ClusterError
from .podstatus import report_container_exit
from .procs import ManagedProcess, install_signal_handlers


class LocalCluster(KubeClient):
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
            ``python -m ckpt_e2e down WORKDIR`` (or :func:`ckpt_e2e.procs.stop_workdir`)
            stops them later using ``WORKDIR/pids``. Implies keep_workdir.
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
        self.keep_workdir = (
            keep_workdir or persistent or os.environ.get("CKPT_E2E_KEEP_WORKDIR") == "1"
        )
        super().__init__(self.workdir / "kubeconfig", self.workdir / "helm")
        self.pods_dir = self.workdir / "pods"
        self.pvc_dir = self.workdir / "pvc"
        options = ClusterOptions(
            scheduler=scheduler,
            controller_manager=controller_manager,
            kwok=kwok,
            training_operator=training_operator,
            nodes=nodes if kwok else 0,
            verbosity=verbosity,
            startup_timeout=startup_timeout,
        )
        self.plane = ControlPlane(self.workdir, options, self, persistent=persistent)
        self._failed = False
        self._started = False

    # ------------------------------------------------------------------ the components
    @property
    def options(self) -> ClusterOptions:
        return self.plane.options

    @property
    def log_dir(self) -> Path:
        return self.plane.log_dir

    @property
    def procs(self) -> dict[str, ManagedProcess]:
        return self.plane.procs

    @property
    def bin(self) -> dict[str, Path]:
        return self.plane.bin

    @property
    def ports(self) -> dict[str, int]:
        return self.plane.ports

    @property
    def timings(self) -> dict[str, float]:
        return self.plane.timings

    @property
    def ca(self) -> pki.CertificateAuthority | None:
        return self.plane.ca

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

    def start(self) -> Self:
        """Start every component and wait until each is ready. Raises ClusterError."""
        if self._started:
            return self
        self._started = True
        install_signal_handlers()
        t0 = time.monotonic()
        try:
            self.plane.start()
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
        self.close()
        self.plane.stop()
        if self._own_workdir and not self.keep_workdir and not self._failed:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def release(self) -> None:
        """Leave the components running (``persistent`` clusters) and forget them here."""
        self.close()
        self.plane.release()

    def mark_failed(self) -> None:
        """Keep the workdir (logs) when the cluster is stopped later."""
        self._failed = True

    def check_alive(self) -> None:
        """Raise ClusterError if a component process has exited."""
        self.plane.check_alive()

    def diagnostics(self, names: Sequence[str] | None = None, max_bytes: int = 4000) -> str:
        """Tails of the component logs (all, or ``names``)."""
        return self.plane.diagnostics(names, max_bytes)

    def create_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        pod_cidr: str | None = None,
        taints: Sequence[Mapping[str, str]] = (),
    ) -> dict[str, Any]:
        """Create a kwok-managed fake Node and wait until kwok reports it Ready (``pod_cidr``:
        its pods' IP range, a loopback one makes them reachable at their pod IPs here;
        ``taints`` keep other pods off it)."""
        return self.plane.create_node(name, labels, pod_cidr, taints)

    def wait_crd_established(self, name: str, timeout: float | None = None) -> None:
        """Wait until CustomResourceDefinition ``name`` is Established (served)."""
        self.plane.wait_crd_established(name, timeout)

    # ------------------------------------------------------------------ identities
    def kubeconfig_for(self, user: str, groups: Sequence[str] = ()) -> Path:
        """Issue a client certificate for ``user``/``groups`` and write a kubeconfig for it."""
        assert self.ca is not None
        safe = "".join(c if c.isalnum() else "-" for c in user)
        pair = self.ca.client_cert(f"user-{safe}", user, list(groups))
        return write_kubeconfig(
            self.workdir / f"kubeconfig-{safe}",
            self.server,
            self.ca.cert_path,
            user,
            cert_credentials(pair.cert, pair.key),
        )

    # ------------------------------------------------------------------ namespaces
    def create_namespace(self, name: str, labels: Mapping[str, str] | None = None) -> str:
        """Create a namespace and wait until its ``default`` ServiceAccount exists."""
        obj = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": dict(labels or {})},
        }
        self.kubectl("create", "-f", "-", input=json.dumps(obj))
        if self.options.controller_manager:
            self.plane.wait_default_service_account(name)
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
        if self.options.controller_manager:
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
        self, namespace: str, name: str, exit_code: int, **report: str | None
    ) -> dict[str, Any]:
        """Report that a pod's container exited with ``exit_code`` (see ckpt_e2e.localpod);
        ``report``: ``container``, ``reason``, ``message`` of
        :func:`ckpt_e2e.podstatus.report_container_exit`."""
        return report_container_exit(self, namespace, name, exit_code, **report)
