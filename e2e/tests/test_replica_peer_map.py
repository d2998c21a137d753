"""The operator chooses replica peers in other zones from the nodes' labels (#31).

Four kwok nodes, two in zone ``a`` and two in zone ``b`` (``topology.kubernetes.io/zone``),
tainted so that no other test's pod lands there. A PyTorchJob of four pods (a master and
three workers, one per node by a required anti-affinity) under a policy with
``spec.agent.replicas``: the real scheduler places them, and once all four are on their
nodes the operator creates the ConfigMap ``ckpt-replica-peers-<job>`` (owned by the job),
each rank's peer in the other zone; every pod's sidecar has its rank and mounts that
ConfigMap. No pod runs (nothing here needs a process): seconds, not minutes.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from ckpt_e2e.api import free_port
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import Training, events, pytorchjob_manifest

pytestmark = pytest.mark.e2e

ZONE = "topology.kubernetes.io/zone"


def test_the_peer_map_puts_each_ranks_peer_in_the_other_zone(scenario: Scenario) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    group = f"zones-{uuid.uuid4().hex[:5]}"
    taint = {"key": "ckpt-e2e/zones", "value": group, "effect": "NoSchedule"}
    nodes = {f"kwok-{group}-{i}": zone for i, zone in enumerate("aabb")}
    for name, zone in nodes.items():
        cluster.create_node(name, labels={ZONE: zone, "e2e.ckpt.dev/group": group}, taints=[taint])
    try:
        scenario.apply_policy(
            "e2e",
            extra={
                "agent": {
                    "metricsPort": free_port(),
                    "sidecar": True,
                    "replicas": {"enabled": True, "peers": 1},
                }
            },
        )
        job = "zoned"
        manifest = pytorchjob_manifest(
            job, Training(steps=5), scenario.results, policy="e2e",
            node_selector={"e2e.ckpt.dev/group": group},
        )  # fmt: skip
        specs = manifest["spec"]["pytorchReplicaSpecs"]
        pod_spec = specs["Master"]["template"]["spec"]
        pod_spec["tolerations"] = [{**taint, "operator": "Equal"}]
        pod_spec["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {"training.kubeflow.org/job-name": job}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        }
        specs["Worker"] = json.loads(json.dumps(specs["Master"]))
        specs["Worker"]["replicas"] = 3
        cluster.apply(manifest, namespace=ns)

        def peer_map() -> dict[str, Any] | None:
            res = cluster.kubectl(
                "get", "configmap", f"ckpt-replica-peers-{job}", "-n", ns, "-o", "json",
                check=False,
            )  # fmt: skip
            return json.loads(res.stdout) if res.returncode == 0 else None

        cm = cluster.wait_for(peer_map, timeout=90, what="the replica peer map")
        assert isinstance(cm, dict)
        owner = cluster.get_json("pytorchjob", job, "-n", ns)
        (ref,) = cm["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == (
            "PyTorchJob",
            job,
            owner["metadata"]["uid"],
        )

        pods = cluster.get_json("pods", "-n", ns, "-l", f"training.kubeflow.org/job-name={job}")
        host_zone: dict[str, str] = {}
        for pod in pods["items"]:
            node = pod["spec"]["nodeName"]
            assert node in nodes, node
            sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == "ckpt-agent")
            env = {e["name"]: e.get("value") for e in sidecar["env"]}
            assert env["CKPT_REPLICA_PEERS_DIR"] == "/etc/ckpt-replica-peers"
            volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "ckpt-replica-peers")
            assert volume["configMap"]["name"] == f"ckpt-replica-peers-{job}"
            assert volume["configMap"]["optional"] is True
            host_zone[f"{pod['metadata']['name']}.{ns}.svc"] = nodes[node]
            host_zone[f"rank-{env['CKPT_REPLICA_RANK']}"] = nodes[node]
        assert len(pods["items"]) == 4 and len({p["spec"]["nodeName"] for p in pods["items"]}) == 4

        data = cm["data"]
        for rank in range(4):
            (peer,) = data[f"rank-{rank}"].split(",")
            host, _, port = peer.rpartition(":")
            assert port == "7471" and host in host_zone, (peer, host_zone)
            assert host_zone[host] != host_zone[f"rank-{rank}"], (rank, peer, data)
        plan = json.loads(data["plan.json"])
        assert [r["apart"] for r in plan["ranks"]] == [["zone"]] * 4, plan
        chosen = events(cluster, ns, name=job, reason="ReplicaPeersChosen", wait=30)
        assert len(chosen) == 1 and "4 of 4 in another zone" in chosen[0]["message"], chosen
    finally:
        cluster.kubectl(
            "delete", "pytorchjob", "zoned", "-n", ns, "--ignore-not-found", check=False
        )
        for name in nodes:
            cluster.kubectl("delete", "node", name, "--ignore-not-found", check=False)
