"""Report a pod's state to the API server, as a kubelet would (``pods/status``).

kwok marks pods Running but runs nothing; when a local process stands in for a container
(``ckpt_e2e.localpod``), its exit is reported here. Semantics: the "Exit report" section
of the ``ckpt_e2e.localpod`` docstring. :data:`LOCAL_PROCESS_ANNOTATION` marks a pod
whose container runs locally (kwok's delete stage skips such pods).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

from .api import KubeClient
from .errors import LocalPodError
from .podspec import default_container, native_sidecars

LOCAL_PROCESS_ANNOTATION = "e2e.ckpt.dev/local-process"


def now() -> str:
    """The current time as the API server writes timestamps."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def is_not_found(e: Exception) -> bool:
    """Whether ``e`` is the API server's 404."""
    return getattr(e, "status", None) == 404


def mark_local_process(api: KubeClient, namespace: str, name: str, pid: int | None) -> None:
    """Set (pid) or remove (None) :data:`LOCAL_PROCESS_ANNOTATION` on the pod."""
    value = None if pid is None else str(pid)
    api.request(
        "PATCH",
        pod_path(namespace, name),
        {"metadata": {"annotations": {LOCAL_PROCESS_ANNOTATION: value}}},
    )


def report_container_exit(
    cluster: KubeClient,
    namespace: str,
    name: str,
    exit_code: int,
    *,
    container: str | None = None,
    reason: str | None = None,
    message: str | None = None,
    started_at: str | None = None,
) -> dict[str, Any]:
    """Report through ``pods/status`` that ``container`` exited with ``exit_code``.

    Semantics as in the ``ckpt_e2e.localpod`` docstring ("Exit report"). Returns the
    updated pod status. Works for any kwok pod, whether or not a local process ran for it.
    """
    pod = cluster.request("GET", pod_path(namespace, name))
    spec, status = pod["spec"], pod.get("status") or {}
    names = [c["name"] for c in spec["containers"]]
    target = container or default_container(names)
    sidecar = target not in names and target in native_sidecars(pod)
    if target not in names and not sidecar:
        raise LocalPodError(f"pod {namespace}/{name} has no container {target!r}: {names}")
    ts = now()
    key = "initContainerStatuses" if sidecar else "containerStatuses"
    old = {s["name"]: s for s in status.get(key) or []}
    restart_policy = spec.get("restartPolicy", "Always")
    restart = restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)
    if sidecar:  # restarted whatever the pod's policy, unless the pod is ending
        restart = status.get("phase") not in ("Succeeded", "Failed")
    terminated = {
        "exitCode": exit_code,
        "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        "startedAt": started_at
        or (old.get(target, {}).get("state", {}).get("running", {}).get("startedAt") or ts),
        "finishedAt": ts,
    }
    if message:
        terminated["message"] = message
    if sidecar:
        return _report_sidecar(cluster, namespace, name, spec, old, target, terminated, restart)
    statuses = [
        _container_status(
            c,
            old.get(c["name"], {}),
            f"{namespace}/{name}",
            ts,
            restart,
            terminated if c["name"] == target else None,
        )
        for c in spec["containers"]
    ]
    if restart:
        patch: dict[str, Any] = {"status": {"containerStatuses": statuses}}
    else:
        phase = "Succeeded" if exit_code == 0 else "Failed"
        cond_reason = "PodCompleted" if exit_code == 0 else "PodFailed"
        conds = []
        for cond in status.get("conditions") or []:
            if cond["type"] in ("Ready", "ContainersReady"):
                conds.append(
                    {**cond, "status": "False", "reason": cond_reason, "lastTransitionTime": ts}
                )
            else:
                conds.append(cond)
        patch = {"status": {"phase": phase, "containerStatuses": statuses, "conditions": conds}}
    updated = cluster.request(
        "PATCH",
        pod_path(namespace, name) + "/status",
        patch,
        content_type="application/merge-patch+json",
    )
    result: dict[str, Any] = updated.get("status") or {}
    return result


def _report_sidecar(
    cluster: KubeClient,
    namespace: str,
    name: str,
    spec: Mapping[str, Any],
    old: Mapping[str, Mapping[str, Any]],
    target: str,
    terminated: Mapping[str, Any],
    restart: bool,
) -> dict[str, Any]:
    """A native sidecar's exit: only ``initContainerStatuses`` change, never the phase
    (a sidecar does not decide the pod's fate; the kubelet restarts it while the pod runs)."""
    ts = str(terminated["finishedAt"])
    pod = f"{namespace}/{name}"
    statuses = [
        _container_status(c, old.get(c["name"], {}), pod, ts, restart, terminated)
        if c["name"] == target
        else dict(old.get(c["name"]) or {"name": c["name"], "image": c.get("image", "")})
        for c in spec.get("initContainers") or []
    ]
    updated = cluster.request(
        "PATCH",
        pod_path(namespace, name) + "/status",
        {"status": {"initContainerStatuses": statuses}},
        content_type="application/merge-patch+json",
    )
    result: dict[str, Any] = updated.get("status") or {}
    return result


def _container_status(
    c: Mapping[str, Any],
    prev: Mapping[str, Any],
    pod: str,
    ts: str,
    restart: bool,
    terminated: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The new status of container ``c``: the one that exited (``terminated`` set) or
    another one, which keeps running on a restart and otherwise ends with the pod."""
    base = {
        "name": c["name"],
        "image": c.get("image", ""),
        "imageID": prev.get("imageID", ""),
        "containerID": prev.get("containerID", f"local://{pod}/{c['name']}"),
        "restartCount": prev.get("restartCount", 0),
    }
    if terminated is not None and restart:
        return {
            **base,
            "restartCount": base["restartCount"] + 1,
            "ready": True,
            "started": True,
            "lastState": {"terminated": terminated},
            "state": {"running": {"startedAt": ts}},
        }
    if terminated is not None:
        return {**base, "ready": False, "started": False, "state": {"terminated": terminated}}
    if restart:
        return dict(prev) or {**base, "ready": True, "state": {"running": {"startedAt": ts}}}
    # the pod is ending: its other containers end too
    run = prev.get("state", {}).get("running", {})
    return {
        **base,
        "ready": False,
        "started": False,
        "state": {
            "terminated": {
                "exitCode": 0,
                "reason": "Completed",
                "startedAt": run.get("startedAt", ts),
                "finishedAt": ts,
            }
        },
    }
