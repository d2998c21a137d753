"""A Deployment's container started from its image the way a kubelet would start it.

:func:`container_run` turns a pod spec and one of its containers (as the API server
stored them) into a ``buildah run`` command line (:class:`ckpt_e2e.image.Container`):

* the container's ``command`` (else the image's entry point) and ``args``;
* its ``env`` (``value``, and ``fieldRef: metadata.namespace``), plus
  ``KUBERNETES_SERVICE_HOST``/``PORT`` of the API server;
* the pod's ``runAsUser``/``runAsGroup`` (else the image's ``USER``);
* its ``secret`` volumes written out as files and its ``emptyDir`` volumes (fresh, 0777),
  bind-mounted at their ``mountPath``; the files group-owned by the pod's ``fsGroup``;
* a TokenRequest token of the ServiceAccount, the cluster CA and the namespace at
  ``/var/run/secrets/kubernetes.io/serviceaccount`` (the in-cluster configuration);
* the cluster's PVC root at the same path (the storage the "pods" and the operator share),
  readable and writable by the pod's ``fsGroup`` through default ACLs (inherited by what
  the root-run "pods" create later, whatever their umask), like a shared volume an
  administrator set up for that group; without them the operator, a non-root user, could
  not create a run's folder where the pods wrote as root.

Other volume types are refused (say so rather than run with a missing mount).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .cluster import LocalCluster
from .errors import ClusterError
from .image import Container

SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class ContainerRun:
    """The ``buildah run`` argv and where its mounted files are on this machine."""

    argv: list[str]
    token_path: Path
    #: Secret name -> the folder written out for it
    secret_dirs: dict[str, Path] = field(default_factory=dict)


def service_account_token(
    cluster: LocalCluster, namespace: str, service_account: str, duration: str = "24h"
) -> str:
    """A token of ``namespace/service_account`` from the TokenRequest API."""
    return cluster.kubectl(
        "create", "token", service_account, "-n", namespace, f"--duration={duration}"
    ).stdout.strip()


def materialize_secret(cluster: LocalCluster, namespace: str, name: str, directory: Path) -> Path:
    """Write a Secret's keys as files (what the kubelet does for a secret volume)."""
    secret = cluster.request("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in (secret.get("data") or {}).items():
        p = directory / key
        p.write_bytes(base64.b64decode(value))
        p.chmod(0o440)
    return directory


def share_with_group(path: Path, gid: int) -> None:
    """Group ``gid`` may read and write ``path`` and all created under it (default ACLs)."""
    res = subprocess.run(
        ["setfacl", "-R", "-m", f"g:{gid}:rwX", "-m", f"d:g:{gid}:rwX", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        raise ClusterError(f"setfacl on {path} (apt package acl): {res.stderr.strip()}")


def _env(cluster: LocalCluster, spec: Mapping[str, Any], namespace: str) -> dict[str, str]:
    api = urlsplit(cluster.server)
    env = {"KUBERNETES_SERVICE_HOST": str(api.hostname), "KUBERNETES_SERVICE_PORT": str(api.port)}
    for var in spec.get("env") or []:
        field_path = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif field_path == "metadata.namespace":
            env[var["name"]] = namespace
    return env


def container_run(
    cluster: LocalCluster,
    container: Container,
    pod: Mapping[str, Any],
    spec: Mapping[str, Any],
    *,
    namespace: str,
    service_account: str,
    volumes_dir: Path,
    extra_args: Sequence[str] = (),
) -> ContainerRun:
    """The ``buildah run`` of ``spec`` (a container of ``pod``) as a kubelet would start it."""
    security = pod.get("securityContext") or {}
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    mounts: dict[str | Path, str] = {}
    secret_dirs: dict[str, Path] = {}
    shared: list[Path] = []
    for mount in spec.get("volumeMounts") or []:
        volume, host = volumes[mount["name"]], volumes_dir / mount["name"]
        if "secret" in volume:
            name = volume["secret"]["secretName"]
            secret_dirs[name] = materialize_secret(cluster, namespace, name, host)
        elif "emptyDir" in volume:
            shutil.rmtree(host, ignore_errors=True)  # a new pod gets a new emptyDir
            host.mkdir(parents=True)
            host.chmod(0o777)
        elif "hostPath" in volume:  # e.g. the shared checkpoint root (chart extraVolumes)
            host = Path(volume["hostPath"]["path"])
            host.mkdir(parents=True, exist_ok=True)
            shared.append(host)
        else:
            raise ClusterError(
                f"volume {mount['name']!r}: the e2e mounts only secret, emptyDir and hostPath"
                " volumes; run the operator as a process (CKPT_E2E_OPERATOR=process) for others"
            )
        mounts[host] = mount["mountPath"]
    account = volumes_dir / "kube-api-access"
    account.mkdir(parents=True, exist_ok=True)
    assert cluster.ca is not None
    (account / "token").write_text(service_account_token(cluster, namespace, service_account))
    shutil.copyfile(cluster.ca.cert_path, account / "ca.crt")
    (account / "namespace").write_text(namespace)
    mounts[account] = SERVICE_ACCOUNT_MOUNT
    fs_group = security.get("fsGroup")
    if fs_group is not None:
        for folder in shared:
            share_with_group(folder, int(fs_group))
    for f in (p for p in volumes_dir.rglob("*") if p.is_file()):
        if fs_group is not None:
            os.chown(f, -1, int(fs_group))
        f.chmod(0o440 if fs_group is not None else 0o444)
    user = security.get("runAsUser")
    group = security.get("runAsGroup", user)
    argv = container.argv(
        spec.get("command"),
        args=[*(str(a) for a in spec.get("args") or []), *extra_args],
        mounts=mounts,
        env=_env(cluster, spec, namespace),
        user=None if user is None else f"{user}:{group}",
    )
    return ContainerRun(argv, account / "token", secret_dirs)
