"""Disruptions: ask injected pods for an emergency checkpoint (``ckpt.dev/save-now``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_operator import constants as c
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.disruption import Disruption, node_disruption, pod_disruption, save_now_patch

__all__ = ["signal_node", "signal_pod"]


async def _signal(deps: Deps, pod: Mapping[str, Any], disruption: Disruption) -> bool:
    """Set ``ckpt.dev/save-now`` on ``pod`` (False: it already has this request)."""
    patch = save_now_patch(pod, disruption)
    if patch is None:
        return False
    meta = pod.get("metadata") or {}
    await deps.api.patch_pod(str(meta.get("namespace")), str(meta.get("name")), patch)
    deps.metrics.save_now.labels(disruption.reason).inc()
    deps.events.emit(
        pod, "Normal", "SaveNowRequested", f"emergency checkpoint requested: {disruption.message}"
    )
    return True


async def signal_pod(deps: Deps, pod: Mapping[str, Any]) -> bool:
    """Signal ``pod`` to save now when the pod itself announces a disruption."""
    disruption = pod_disruption(pod)
    if disruption is None:
        return False
    return await _signal(deps, pod, disruption)


async def signal_node(deps: Deps, node: Mapping[str, Any]) -> int:
    """Signal every injected pod on a node that announces a disruption; returns pods signalled."""
    name = str((node.get("metadata") or {}).get("name") or "")
    disruption = node_disruption(node)
    if disruption is None:
        deps.node_signals.pop(name, None)
        return 0
    if deps.node_signals.get(name) == disruption.request_id:
        return 0
    pods = await deps.api.list_pods(node_name=name, label_selector=f"{c.LABEL_INJECTED}=true")
    n = 0
    for pod in pods:
        if await _signal(deps, pod, disruption):
            n += 1
    deps.node_signals[name] = disruption.request_id
    return n
