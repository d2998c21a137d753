"""A pod's volumes as local folders: made, materialized and kept fresh.

The rules (which folder each volume kind gets, the kubelet's file layout, refreshes,
atomic replacement): the "Volumes → local folders" section of the ``ckpt_e2e.localpod``
docstring. The file contents come from :mod:`ckpt_e2e.podspec`; this module reads what
they refer to from the API server and writes the files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .api import KubeClient
from .errors import LocalPodError
from .names import PodNames
from .podspec import (
    MATERIALIZED,
    PathTranslator,
    mount_paths,
    object_data,
    volume_files,
    volume_uses_api,
)
from .podstatus import is_not_found


def claim_folder(pvc_root: Path, namespace: str, claim: str) -> Path:
    """``<pvc_root>/<namespace>/<claim>``, the folder that stands in for a claim (made)."""
    p = pvc_root / namespace / claim
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_atomic(path: Path, data: bytes, mode: int | None) -> bool:
    """Write ``path`` via rename; returns True when the content changed."""
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    if mode is not None:
        tmp.chmod(mode)
    os.replace(tmp, path)
    return True


def fetch_data(
    api: KubeClient, namespace: str, kind: str, name: str, optional: bool
) -> dict[str, str] | None:
    """Data of ConfigMap/Secret ``name`` (decoded), or None if optional and missing."""
    try:
        obj = api.request("GET", f"/api/v1/namespaces/{namespace}/{kind}/{name}")
    except Exception as e:
        if is_not_found(e) and optional:
            return None
        raise LocalPodError(f"{kind} {namespace}/{name}: {e}") from e
    return object_data(kind, obj)


class PodVolumes:
    """The volumes one container mounts, as local folders (see the module docstring).

    ``paths`` maps every mount path to its local path (``overrides`` win), ``translator``
    translates container paths; made folders and files are written at construction.
    """

    def __init__(
        self,
        api: KubeClient,
        pod: Mapping[str, Any],
        container: Mapping[str, Any],
        root: Path,
        pvc_root: Path,
        *,
        overrides: Mapping[str, Path],
        rewrite_files: bool,
        hosts: PodNames | None = None,
    ) -> None:
        self.api = api
        self.pod = pod
        self.namespace: str = pod["metadata"]["namespace"]
        self.container_name: str = container["name"]
        self.root = root
        self.pvc_root = pvc_root
        self.rewrite_files = rewrite_files
        self.hosts = hosts
        """Pod names → loopback IPs, rewritten in configMap files (``ckpt_e2e.names``)."""
        self._materialized: list[tuple[str, Mapping[str, Any], Path]] = []
        self._shm_dirs: list[Path] = []
        self.paths = mount_paths(pod, container, self._volume_dir)
        self.paths.update(overrides)
        self.translator = PathTranslator(self.paths)
        self.refresh(pod, full=True)

    def lookup(self, kind: str, name: str, optional: bool) -> dict[str, str] | None:
        """:data:`ckpt_e2e.podspec.Lookup` against the API server, in the pod's namespace."""
        return fetch_data(self.api, self.namespace, kind, name, optional)

    def refresh(self, pod: Mapping[str, Any], full: bool) -> None:
        """Rewrite the materialized files from ``pod`` (``full``: also the API-backed ones)."""
        if full and self.hosts is not None and self._materialized:
            self.hosts.refresh()
        for kind, src, d in self._materialized:
            if not full and volume_uses_api(kind, src):
                continue
            files = volume_files(kind, src, pod, self.container_name, self.lookup, self._sa_token)
            default_mode = src.get("defaultMode")
            for rel, (raw, mode) in files.items():
                text = self.translator.text(raw) if self.rewrite_files and kind != "secret" else raw
                if self.hosts is not None and kind == "configMap":
                    text = self.hosts.rewrite(text)
                write_atomic(d / rel, text.encode(), mode if mode is not None else default_mode)

    def cleanup(self) -> None:
        """Remove the ``medium: Memory`` folders under /dev/shm."""
        for d in self._shm_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._shm_dirs.clear()

    def _volume_dir(self, vol: Mapping[str, Any]) -> Path:
        name: str = vol["name"]
        if "hostPath" in vol:
            p = Path(vol["hostPath"]["path"])
            p.mkdir(parents=True, exist_ok=True)
            return p
        if "persistentVolumeClaim" in vol:
            return self._claim_dir(vol["persistentVolumeClaim"]["claimName"])
        if (
            "emptyDir" in vol
            and (vol["emptyDir"] or {}).get("medium") == "Memory"
            and Path("/dev/shm").is_dir()
        ):
            meta = self.pod["metadata"]
            p = Path("/dev/shm") / f"ckpt-e2e-{meta.get('uid', meta['name'])}" / name
            p.mkdir(parents=True, exist_ok=True)
            self._shm_dirs.append(p.parent)
            return p
        d = self.root / name
        d.mkdir(parents=True, exist_ok=True)
        for key in MATERIALIZED:
            if key in vol:
                self._materialized.append((key, vol[key] or {}, d))
        return d

    def _claim_dir(self, claim: str) -> Path:
        """The bound PV's hostPath (see LocalCluster.create_pvc), else claim_folder()."""
        with contextlib.suppress(Exception):
            pvc = self.api.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{claim}"
            )
            pv_name = pvc["spec"].get("volumeName")
            if pv_name:
                pv = self.api.request("GET", f"/api/v1/persistentvolumes/{pv_name}")
                host = (pv["spec"].get("hostPath") or {}).get("path")
                if host:
                    p = Path(host)
                    p.mkdir(parents=True, exist_ok=True)
                    return p
        return claim_folder(self.pvc_root, self.namespace, claim)

    def _sa_token(self, sub: Mapping[str, Any]) -> str | None:
        """A projected ``serviceAccountToken`` (TokenRequest bound to the pod), or None."""
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        meta = self.pod["metadata"]
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [sub["audience"]] if sub.get("audience") else [],
                "expirationSeconds": int(sub.get("expirationSeconds") or 3607),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta.get("uid"),
                },
            },
        }
        try:
            res = self.api.request(
                "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token", body
            )
        except Exception:
            return None
        token = (res.get("status") or {}).get("token")
        return str(token) if token else None
