"""Node warnings relayed to injected pods through ``ckpt.dev/save-now`` and cleared again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ckpt_agent.format.signal import parse_signal
from ckpt_operator.behaviours.disruption import signal_node, signal_pod
from ckpt_operator.model import constants as c
from ckpt_operator.planners.disruption_signals import clear_patch, node_disruption, pod_disruption

POD = ("ml-team", "mnist-ddp-worker-0")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _condition(node: dict[str, Any], kind: str, status: str) -> dict[str, Any]:
    for cond in node["status"]["conditions"]:
        if cond["type"] == kind:
            cond["status"] = status
            cond["lastTransitionTime"] = "2024-05-02T11:00:00Z"
            cond["reason"] = f"Kubelet{kind}{status}"
    return node


@pytest.mark.parametrize(
    ("kind", "status", "reason"),
    [
        ("Ready", "False", "NodeNotReady"),
        ("Ready", "Unknown", "NodeNotReady"),
        ("MemoryPressure", "True", "NodeMemoryPressure"),
        ("DiskPressure", "True", "NodeDiskPressure"),
        ("PIDPressure", "True", "NodePIDPressure"),
        ("Ready", "True", None),
        ("MemoryPressure", "False", None),
    ],
)
def test_node_conditions_warn(fixture: Any, kind: str, status: str, reason: str | None) -> None:
    d = node_disruption(_condition(fixture("node_ready.json"), kind, status))
    assert (d.reason if d else None) == reason
    if d is not None:
        assert d.warning and (kind in d.message or "NotReady" in d.message)


def test_taint_and_cordon_win_over_conditions(fixture: Any) -> None:
    node = _condition(fixture("node_cordoned.json"), "MemoryPressure", "True")
    d = node_disruption(node)
    assert d is not None and d.reason == "NodeCordoned"
    node["spec"]["taints"].append(
        {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}
    )
    del node["spec"]["taints"][1]  # the cordon taint (the cordon flag stays)
    d = node_disruption(node)
    assert d is not None and d.reason == "AWSSpotInterruption"


def test_node_signals_are_warnings_pod_signals_are_not(fixture: Any) -> None:
    node = node_disruption(fixture("node_cordoned.json"))
    assert node is not None and node.warning
    sig = parse_signal(node.signal)
    assert sig is not None and sig.kind == "warning" and sig.request == node.request_id
    assert "gpu-node-7" in sig.message and len(node.signal) <= 200
    pod = pod_disruption(fixture("pod_disruption_target.json"))
    assert pod is not None and not pod.warning and pod.signal == pod.request_id
    plain = parse_signal(pod.signal)
    assert plain is not None and plain.kind == "save"


def test_clear_patch_only_for_a_held_warning(fixture: Any) -> None:
    pod = fixture("pod_running_injected.json")
    assert clear_patch(pod, "gpu-node-7") is None  # nothing signalled
    pod["metadata"]["annotations"][c.ANN_SAVE_NOW] = "EvictionByEvictionAPI-0123456789ab"
    assert clear_patch(pod, "gpu-node-7") is None  # a plain save-now is not a warning
    pod["metadata"]["annotations"][c.ANN_SAVE_NOW] = "NodeCordoned-0123456789ab warning cordoned"
    patch = clear_patch(pod, "gpu-node-7")
    assert patch is not None
    value = patch["metadata"]["annotations"][c.ANN_SAVE_NOW]
    sig = parse_signal(value)
    assert sig is not None and sig.kind == "clear" and sig.request == "NodeCordoned-0123456789ab"
    pod["metadata"]["annotations"][c.ANN_SAVE_NOW] = value
    assert clear_patch(pod, "gpu-node-7") is None  # cleared once


def _ann(world: Any) -> dict[str, str]:
    return dict(world.api.pods[POD]["metadata"]["annotations"])


def test_warning_then_uncordon_clears_the_pods(world: Any, fixture: Any) -> None:
    world.api.add_pod(fixture("pod_running_injected.json"))
    assert run(signal_node(world.deps, fixture("node_cordoned.json"))) == 1
    sig = parse_signal(_ann(world)[c.ANN_SAVE_NOW])
    assert sig is not None and sig.kind == "warning"
    assert "SaveNowRequested" in world.events.reasons()
    # uncordoned: the pod is told once; later calm events neither list nor patch again
    assert run(signal_node(world.deps, fixture("node_ready.json"))) == 0
    cleared = parse_signal(_ann(world)[c.ANN_SAVE_NOW])
    assert cleared is not None and cleared.kind == "clear" and cleared.request == sig.request
    assert "NodeWarningCleared" in world.events.reasons()
    calls = len(world.api.calls)
    assert run(signal_node(world.deps, fixture("node_ready.json"))) == 0
    assert len(world.api.calls) == calls
    # the same cordon again later is a new warning (the pod's content changes)
    assert run(signal_node(world.deps, fixture("node_cordoned.json"))) == 1
    again = parse_signal(_ann(world)[c.ANN_SAVE_NOW])
    assert again is not None and again.kind == "warning"


def test_calm_node_after_a_restart_clears_a_stale_warning(world: Any, fixture: Any) -> None:
    pod = fixture("pod_running_injected.json")
    pod["metadata"]["annotations"][c.ANN_SAVE_NOW] = "NodeNotReady-0123456789ab warning down"
    world.api.add_pod(pod)
    assert len(world.deps.node_signals) == 0  # a fresh operator knows no node yet
    run(signal_node(world.deps, fixture("node_ready.json")))
    cleared = parse_signal(_ann(world)[c.ANN_SAVE_NOW])
    assert cleared is not None and cleared.kind == "clear"
    assert world.deps.node_signals.last("gpu-node-7") == ""


def test_a_pod_disruption_replaces_a_held_warning(world: Any, fixture: Any) -> None:
    world.api.add_pod(fixture("pod_running_injected.json"))
    run(signal_node(world.deps, fixture("node_cordoned.json")))
    evicted = fixture("pod_disruption_target.json")
    evicted["metadata"]["annotations"] = _ann(world)
    world.api.pods[POD] = evicted
    assert run(signal_pod(world.deps, evicted)) is True
    sig = parse_signal(_ann(world)[c.ANN_SAVE_NOW])
    assert sig is not None and sig.kind == "save"
