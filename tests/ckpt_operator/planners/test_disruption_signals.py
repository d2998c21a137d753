"""Disruption detection on recorded pods and nodes → save-now patches."""

from __future__ import annotations

from typing import Any

import pytest

from ckpt_operator.model import constants as c
from ckpt_operator.planners.disruption_signals import (
    Disruption,
    node_disruption,
    pod_disruption,
    save_now_patch,
)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("pod_running_injected.json", None),
        ("pod_disruption_target.json", "EvictionByEvictionAPI"),
        ("pod_terminating.json", "PodDeleting"),
    ],
)
def test_pod_disruptions(fixture: Any, name: str, reason: str | None) -> None:
    d = pod_disruption(fixture(name))
    assert (d.reason if d else None) == reason


def test_disruption_target_wins_over_deletion(fixture: Any) -> None:
    pod = fixture("pod_disruption_target.json")
    pod["metadata"]["deletionTimestamp"] = "2024-05-02T10:58:13Z"
    d = pod_disruption(pod)
    assert d is not None and d.reason == "EvictionByEvictionAPI"
    # same request id as before the deletion started: the agent is not signalled twice
    d0 = pod_disruption(fixture("pod_disruption_target.json"))
    assert d0 is not None and d.request_id == d0.request_id


def test_false_disruption_target_is_ignored(fixture: Any) -> None:
    pod = fixture("pod_disruption_target.json")
    pod["status"]["conditions"][0]["status"] = "False"
    assert pod_disruption(pod) is None


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("node_ready.json", None),
        ("node_cordoned.json", "NodeCordoned"),
        ("node_autoscaler.json", "ClusterAutoscalerScaleDown"),
    ],
)
def test_node_disruptions(fixture: Any, name: str, reason: str | None) -> None:
    d = node_disruption(fixture(name))
    assert (d.reason if d else None) == reason


@pytest.mark.parametrize(
    ("taint", "reason"),
    [
        ({"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}, "KarpenterDisruption"),
        ({"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}, "NodeOutOfService"),
        (
            {"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"},
            "GCEImpendingTermination",
        ),
        (
            {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"},
            "AWSSpotInterruption",
        ),
        ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}, None),
    ],
)
def test_going_away_taints(fixture: Any, taint: dict[str, str], reason: str | None) -> None:
    node = fixture("node_ready.json")
    node["spec"]["taints"] = [taint]
    d = node_disruption(node)
    assert (d.reason if d else None) == reason


def test_cordon_without_taint_yet(fixture: Any) -> None:
    node = fixture("node_ready.json")
    node["spec"]["unschedulable"] = True
    d = node_disruption(node)
    assert d is not None and d.reason == "NodeCordoned"


def test_save_now_patch_is_idempotent(fixture: Any) -> None:
    pod = fixture("pod_disruption_target.json")
    d = pod_disruption(pod)
    assert d is not None
    patch = save_now_patch(pod, d)
    assert patch is not None
    ann = patch["metadata"]["annotations"]
    assert ann[c.ANN_SAVE_NOW] == d.request_id and d.request_id.startswith("EvictionByEvictionAPI-")
    assert "Eviction API" in ann[c.ANN_SAVE_NOW_REASON]
    pod["metadata"]["annotations"].update(ann)
    assert save_now_patch(pod, d) is None
    # a different disruption later is a new request
    other = Disruption("NodeCordoned", "node gpu-node-7 is cordoned", "node/x/cordon")
    assert save_now_patch(pod, other) is not None


def test_only_running_injected_pods_are_signalled(fixture: Any) -> None:
    d = Disruption("NodeCordoned", "cordoned", "k")
    pod = fixture("pod_running_injected.json")
    assert save_now_patch(pod, d) is not None
    del pod["metadata"]["labels"][c.LABEL_INJECTED]
    assert save_now_patch(pod, d) is None  # no agent inside
    done = fixture("pod_running_injected.json")
    done["status"]["phase"] = "Succeeded"
    assert save_now_patch(done, d) is None


def test_request_ids_differ_per_disruption(fixture: Any) -> None:
    a = node_disruption(fixture("node_cordoned.json"))
    b = node_disruption(fixture("node_autoscaler.json"))
    assert a is not None and b is not None and a.request_id != b.request_id
    assert len(a.request_id) < 64  # fits comfortably in an annotation and a file
