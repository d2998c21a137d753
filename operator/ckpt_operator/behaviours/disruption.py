"""Disruptions: ask injected pods for an emergency checkpoint (``ckpt.dev/save-now``), relay
node warnings to them and clear those when the node is calm again."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.planners.disruption_signals import (
    Disruption,
    clear_patch,
    node_disruption,
    pod_disruption,
    save_now_patch,
)

__all__ = ["signal_node", "signal_pod", "signal_save_now"]


async def signal_save_now(deps: Deps, pod: Mapping[str, Any], disruption: Disruption) -> bool:
    """Set ``ckpt.dev/save-now`` on ``pod`` (False: it already has this request)."""
    patch = save_now_patch(pod, disruption)
    if patch is None:
        return False
    meta = meta_of(pod)
    await deps.api.patch_pod(str(meta.namespace), str(meta.name), patch)
    deps.metrics.save_now.labels(disruption.reason).inc()
    kind = " (node warning)" if disruption.warning else ""
    deps.events.emit(
        pod,
        "Normal",
        "SaveNowRequested",
        f"emergency checkpoint requested{kind}: {disruption.message}",
    )
    return True


async def signal_pod(deps: Deps, pod: Mapping[str, Any]) -> bool:
    """Signal ``pod`` to save now when the pod itself announces a disruption."""
    disruption = pod_disruption(pod)
    if disruption is None:
        return False
    return await signal_save_now(deps, pod, disruption)


async def signal_node(deps: Deps, node: Mapping[str, Any]) -> int:
    """Signal every injected pod on a node that announces a warning; returns pods signalled.

    A calm node clears the warning its pods still hold (once: ``deps.node_signals`` keeps
    ``""`` for a node known calm; unknown nodes, e.g. after a restart, are checked once).
    """
    name = str(meta_of(node).name or "")
    disruption = node_disruption(node)
    signalled = deps.node_signals.last(name)
    if disruption is None:
        if signalled != "":
            await _clear(deps, name)
            deps.node_signals.remember(name, "")
        return 0
    if signalled == disruption.signal:
        return 0
    n = 0
    for pod in await _injected_pods(deps, name):
        if await signal_save_now(deps, pod, disruption):
            n += 1
    deps.node_signals.remember(name, disruption.signal)
    return n


async def _injected_pods(deps: Deps, node: str) -> list[Mapping[str, Any]]:
    return list(await deps.api.list_pods(node_name=node, label_selector=f"{c.LABEL_INJECTED}=true"))


async def _clear(deps: Deps, node: str) -> None:
    """Tell the pods on ``node`` that still hold a warning that it went."""
    for pod in await _injected_pods(deps, node):
        patch = clear_patch(pod, node)
        if patch is None:
            continue
        meta = meta_of(pod)
        await deps.api.patch_pod(str(meta.namespace), str(meta.name), patch)
        deps.events.emit(pod, "Normal", "NodeWarningCleared", f"node {node} is calm again")
