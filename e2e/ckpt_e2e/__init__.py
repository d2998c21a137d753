"""End-to-end harness: a local Kubernetes control plane built from pinned Go modules.

Import as ``ckpt_e2e`` with ``e2e/`` on the Python path (it is a source root). Importing
the package is cheap: the names below are loaded from their modules on first access, so
``ckpt_e2e.tools`` (used by the storage tests for the pinned Go tools) stays light.

Modules: ``cluster`` (LocalCluster), ``bootstrap`` (starting the components), ``api``
(the client side: raw requests, kubectl/helm, kubeconfigs), ``localpod`` (a pod's
container as a local process), ``podspec`` (pod spec → process, pure), ``volumes``
(a pod's volumes as local folders), ``podstatus`` (reporting pod status), ``procs``
(child processes), ``tools`` (the pinned Go binaries), ``pki``, ``errors``; the operator
scenarios: ``stack``, ``training``, ``kubelet``, ``scenario``, ``admission``, ``demo``;
TrainJobs (on demand): ``trainer_v2`` (JobSet + Kubeflow Trainer v2), ``trainjob``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import free_port
    from .cluster import LocalCluster
    from .errors import ApiError, ClusterError, CommandError, LocalPodError
    from .localpod import LocalPod, pvc_path, run_pod_locally
    from .podspec import PathTranslator
    from .podstatus import LOCAL_PROCESS_ANNOTATION, report_container_exit
    from .tools import ToolError

_HOMES = {
    "LOCAL_PROCESS_ANNOTATION": "podstatus",
    "ApiError": "errors",
    "ClusterError": "errors",
    "CommandError": "errors",
    "LocalCluster": "cluster",
    "LocalPod": "localpod",
    "LocalPodError": "errors",
    "PathTranslator": "podspec",
    "ToolError": "tools",
    "free_port": "api",
    "pvc_path": "localpod",
    "report_container_exit": "podstatus",
    "run_pod_locally": "localpod",
}

__all__ = [
    "LOCAL_PROCESS_ANNOTATION",
    "ApiError",
    "ClusterError",
    "CommandError",
    "LocalCluster",
    "LocalPod",
    "LocalPodError",
    "PathTranslator",
    "ToolError",
    "free_port",
    "pvc_path",
    "report_container_exit",
    "run_pod_locally",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
