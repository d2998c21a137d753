"""End-to-end harness: a local Kubernetes control plane built from pinned Go modules.

Import as ``ckpt_e2e`` with ``e2e/`` on the Python path (it is a source root).
"""

from .cluster import ApiError, ClusterError, CommandError, LocalCluster, free_port
from .localpod import (
    LOCAL_PROCESS_ANNOTATION,
    LocalPod,
    LocalPodError,
    PathTranslator,
    pvc_path,
    report_container_exit,
    run_pod_locally,
)
from .tools import ToolError

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
