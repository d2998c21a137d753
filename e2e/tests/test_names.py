"""``ckpt_e2e.names``: cluster DNS names of loopback pods → their IPs (no cluster needed)."""

from __future__ import annotations

from typing import Any

from ckpt_e2e.names import PodNames

NS = "team"


def _pod(name: str, ip: str | None, labels: dict[str, str], **meta: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running" if ip else "Pending"}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, "labels": labels, **meta}, "status": status}


def _names(pods: list[dict[str, Any]]) -> PodNames:
    services = [
        {"metadata": {"name": "j-master-0"}, "spec": {"selector": {"type": "master"}}},
        {"metadata": {"name": "headless"}, "spec": {}},
    ]
    objects = {"pods": pods, "services": services}
    return PodNames(NS, lambda kind: objects[kind])


def test_pods_and_services_resolve_to_loopback_ips_as_whole_hosts_only() -> None:
    names = _names(
        [
            _pod("j-master-0", "127.9.0.0", {"type": "master"}),
            _pod("j-worker-0", "127.9.1.0", {"type": "worker"}),
            _pod("elsewhere", "10.0.0.4", {}),
            _pod("gone", "127.9.2.0", {}, deletionTimestamp="2026-01-01T00:00:00Z"),
        ]
    )
    ips = names.refresh()
    assert ips["j-worker-0.team.svc"] == "127.9.1.0" and ips["j-master-0"] == "127.9.0.0"
    assert "elsewhere" not in ips and "gone" not in ips
    assert names.rewrite("j-worker-0.team.svc:7471,j-master-0.team.svc.cluster.local:1") == (
        "127.9.1.0:7471,127.9.0.0:1"
    )
    # part of a path or of a longer name: untouched
    text = "/results/j-worker-0.abc.json x-j-worker-0 j-worker-0.other.svc"
    assert names.rewrite(text) == text
    assert names.unknown("j-worker-0.team.svc:1,j-worker-1.team.svc:1,10.1.1.1:5") == [
        "j-worker-1.team.svc"
    ]


def test_a_service_resolves_to_its_running_pod_and_env_waits_for_it() -> None:
    pods = [_pod("j-master-0", None, {"type": "master"})]
    names = _names(pods)
    env = {"MASTER_ADDR": "j-master-0", "POD_NAME": "j-master-0"}
    # never gets an IP: left as it is after the wait
    assert names.resolve_env(env, timeout=0.3) == {"MASTER_ADDR": "j-master-0"}
    pods[0] = _pod("j-master-0", "127.9.0.0", {"type": "master"})
    assert names.resolve_env(env, timeout=5) == {"MASTER_ADDR": "127.9.0.0"}
