"""A lost node's ranks rehydrate from their peer's replicas, through Kubernetes (issue #31).

A 2-node gloo DDP PyTorchJob, 1 or 2 ranks per pod (``ddp_train.py --nproc-per-node``: the
pod's ranks ``2·pod + local`` as ``torchrun --nproc_per_node=2`` would start them, one
sidecar per pod serving and pushing every area of the pod; a Master and one Worker,
``restartPolicy: OnFailure``, a required anti-affinity: one pod per kwok node) under a
policy with the webhook's sidecar, peer replication (the per-job Secret
``ckpt-replica-<job>`` made by hand, docs/replicas.md) and the memory tier (a snapshot
every 2 steps, a pulse every 10). The kwok
nodes have loopback pod CIDRs: each pod has its own address here, its sidecar serves its
peers there (``CKPT_REPLICA_LISTEN_HOST``) and the harness resolves the cluster's names
(``MASTER_ADDR``, the webhook's ``<pod>.<ns>.svc`` peers, the operator's peer map) to pod
IPs (``ckpt_e2e.names``).

Once a memory snapshot of every Worker rank is in the Master sidecar's replica store, both trainers
are frozen, the Worker's node is lost (its processes killed, its shared memory gone, the
Node and the pod deleted as the node lifecycle does) and the Master's trainer fails (its
peer is gone: SIGKILL, restarted in place by ``OnFailure``). The training-operator recreates
the Worker, which lands on a third node: its sidecar rehydrates its ranks from the Master
node's replicas; every rank resumes from memory (``resume_shm``) at the step after the
snapshot, newer than storage's newest pulse, and the run ends bitwise equal to an
uninterrupted one.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.flash.replica.store import ReplicaStore
from ckpt_e2e.api import free_port
from ckpt_e2e.kubelet import PodRun
from ckpt_e2e.localpod import LocalPod
from ckpt_e2e.procs import clean_env
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import RESULTS_MOUNT, Training, pytorchjob_manifest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[1] / "ckpt_e2e" / "ddp_train.py"
CODE = "/opt/ckpt-e2e"
STEPS, SEED, STEP_SLEEP = 60, 3, 0.15
PULSE_EVERY, MEMORY_EVERY = 10, 2
SHM_DIR = "/var/run/ckpt/shm"  # ckpt_operator.model.constants.SHM_DIR
REPLICA_TYPE = "training.kubeflow.org/replica-type"


def _reference(workdir: Path, world: int) -> list[dict[str, Any]]:
    """The uninterrupted run: ``world`` local processes, no checkpointing."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    argv = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--seed", str(SEED)]
    procs = [
        subprocess.Popen(
            [*argv, "--no-checkpoint", "--out", str(workdir / f"ref{r}.json")],
            env={**env, "WORLD_SIZE": str(world), "RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-3000:]
    return [json.loads((workdir / f"ref{r}.json").read_text()) for r in range(world)]


def _tiers() -> dict[str, Any]:
    pulse = {"baseInterval": PULSE_EVERY, "minInterval": PULSE_EVERY, "maxInterval": PULSE_EVERY}
    return {
        "heartbeat": {"everySteps": 1},
        "pulse": pulse,
        "full": {"everySteps": 1000},
        "memory": {"enabled": True, "everySteps": MEMORY_EVERY},
    }


def _manifest(
    scenario: Scenario, job: str, pool: str, master_port: int, nproc: int
) -> dict[str, Any]:
    # the example's pod (its env, results volume, opt-in), running ddp_train.py instead
    pool_label = {"e2e.ckpt.dev/pool": pool}
    training = Training(steps=STEPS)
    manifest = pytorchjob_manifest(
        job, training, scenario.results, policy="e2e", node_selector=pool_label
    )
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    master = specs["Master"]
    master["restartPolicy"] = "OnFailure"
    spec = master["template"]["spec"]
    spec["tolerations"] = [
        {"key": "ckpt-e2e/pool", "operator": "Equal", "value": pool, "effect": "NoSchedule"}
    ]
    spec["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"training.kubeflow.org/job-name": job}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    spec["volumes"].append(
        {"name": "e2e-code", "hostPath": {"path": str(SCRIPT.parent), "type": "Directory"}}
    )
    [container] = spec["containers"]
    container["volumeMounts"].append({"name": "e2e-code", "mountPath": CODE, "readOnly": True})
    container["command"] = ["python", f"{CODE}/{SCRIPT.name}"]
    out = f"{RESULTS_MOUNT}/$(POD_NAME).$(POD_UID).{{rank}}"  # one file per rank
    container["args"] = [
        *("--steps", str(STEPS), "--seed", str(SEED), "--step-sleep", str(STEP_SLEEP)),
        *("--out", f"{out}.json", "--loss-log", f"{out}.losses.jsonl"),
        *(("--nproc-per-node", str(nproc)) if nproc > 1 else ()),
    ]
    # the training-operator's MASTER_PORT: a free one, not 23456
    container["ports"] = [{"name": "pytorchjob-port", "containerPort": master_port}]
    specs["Worker"] = json.loads(json.dumps(master))
    return manifest


def _base(results: Path, pod: dict[str, Any], rank: int) -> str:
    return str(results / f"{pod['metadata']['name']}.{pod['metadata']['uid']}.{rank}")


def _losses(results: Path, pod: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """The steps one rank of a pod logged (``--loss-log``: a restart in place appends)."""
    lines = Path(f"{_base(results, pod, rank)}.losses.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


@pytest.mark.parametrize("nproc", [1, 2], ids=["2 nodes x 1 rank", "2 nodes x 2 ranks"])
def test_a_lost_nodes_worker_rehydrates_from_the_masters_replica_and_resumes_bitwise(
    scenario: Scenario, nproc: int
) -> None:
    started = time.monotonic()
    cluster, ns = scenario.cluster, scenario.namespace
    ref = _reference(cluster.workdir / f"reference-ddp-{nproc}", 2 * nproc)
    master_ranks = list(range(nproc))  # the pod's ranks: nproc·pod + local
    worker_ranks = list(range(nproc, 2 * nproc))
    job, pool = "lost", f"nl-{uuid.uuid4().hex[:5]}"
    octet = 100 + int.from_bytes(os.urandom(1)) % 100
    taint = {"key": "ckpt-e2e/pool", "value": pool, "effect": "NoSchedule"}
    nodes = [f"kwok-{pool}-{i}" for i in range(3)]

    def node(i: int) -> None:
        cidr = f"127.{octet}.{i}.0/24"  # loopback: the pod's own address here
        cluster.create_node(nodes[i], {"e2e.ckpt.dev/pool": pool}, cidr, [taint])

    node(0)
    node(1)
    try:
        cluster.kubectl(
            "create", "secret", "generic", f"ckpt-replica-{job}", "-n", ns,
            f"--from-literal=secret={secrets.token_hex(32)}",
        )  # fmt: skip
        metrics = free_port()
        scenario.apply_policy(
            "e2e",
            metrics_port=None,
            extra={
                "agent": {
                    "metricsPort": metrics,
                    "sidecar": True,
                    "replicas": {"enabled": True, "port": free_port()},
                },
                "tiers": _tiers(),
            },
        )
        view = scenario.view()
        # no /metrics: the sidecar binds its metrics port on 0.0.0.0 whatever
        # CKPT_METRICS_ADDR says, so two pods' sidecars here would take the same port
        runner = scenario.runner(sidecars=True, extra_env={"CKPT_METRICS_PORT": "0"})
        cluster.apply(_manifest(scenario, job, pool, free_port(), nproc), namespace=ns)
        runner.wait_run(job, index=1, timeout=120)
        runs = {r.pod["metadata"]["labels"][REPLICA_TYPE]: r for r in runner.runs_of(job)}
        master, worker = runs["master"], runs["worker"]
        assert master.local is not None and worker.local is not None
        assert {master.pod["spec"]["nodeName"], worker.pod["spec"]["nodeName"]} == set(nodes[:2])
        [master_sidecar] = master.sidecars
        # the sidecar serves its peers at its pod IP; the peers are named by pod IP here
        master_ip = master.pod["status"]["podIP"]
        worker_ip = worker.pod["status"]["podIP"]
        assert master_sidecar.env["CKPT_REPLICA_LISTEN_HOST"] == master_ip
        assert master_sidecar.env["CKPT_REPLICA_PEERS"].startswith(f"{worker_ip}:")
        run_id = scenario.run_id(job)
        on_master = ReplicaStore(master.local.local_path(SHM_DIR), run_id)
        worker_node = worker.pod["spec"]["nodeName"]

        def worker_replicas() -> list[int]:
            """The steps held on the Master's node for every one of the Worker's ranks."""
            held = [
                {
                    r.desc.step
                    for r in on_master.replicas()
                    if r.source == worker_node and r.desc.rank == rank
                }
                for rank in worker_ranks
            ]
            return sorted(set.intersection(*held))

        def replicated() -> bool:
            assert master.running and worker.running, worker.local.log_text()[-3000:]  # type: ignore[union-attr]
            stored = view.newest_valid(run_id)
            held = worker_replicas()
            return stored is not None and any(s > stored.step for s in held)

        what = "a memory snapshot of the Worker on the Master's node"
        cluster.wait_for(replicated, timeout=150, what=what, interval=0.1)

        # freeze both trainers; the sidecars finish pushing what the Worker snapshotted
        for run in (worker, master):
            assert run.local is not None
            run.local.signal_container(signal.SIGSTOP)
        seen: list[Any] = []

        def settled() -> bool:
            seen.append(worker_replicas())
            return len(seen) >= 8 and all(s == seen[-1] for s in seen[-8:])

        cluster.wait_for(settled, timeout=30, what="replication settled", interval=0.25)
        replica_step = seen[-1][-1]
        stored_at_loss = view.newest_valid(run_id)
        assert stored_at_loss is not None and stored_at_loss.step < replica_step

        # the Worker's node is lost: every process, its memory, then the Node and the pod
        for lp in (*worker.sidecars, worker.local):
            lp.lose_node()
        assert not Path(worker.local.local_path(SHM_DIR)).exists()
        cluster.kubectl("delete", "node", worker_node, "--wait=false")
        cluster.kubectl("delete", "pod", worker.name, "-n", ns, "--grace-period=0", "--force")
        # the Master's trainer loses its peer and fails: restarted in place (OnFailure)
        master.local.kill()
        assert master.local.wait(30) == 137
        node(2)
        again = LocalPod(cluster, ns, master.name).start()
        try:
            recreated: PodRun = runner.wait_run(job, index=2, timeout=120)
            assert recreated.pod["spec"]["nodeName"] == nodes[2]
            assert recreated.local is not None
            assert recreated.wait(180) == 0, recreated.local.log_text()[-3000:]
            assert again.wait(120) == 0, again.log_text()[-3000:]
        finally:
            again.stop()

        ranked = [(r, master) for r in master_ranks] + [(r, recreated) for r in worker_ranks]
        for rank, run in ranked:
            pod = cluster.get_json("pod", run.name, "-n", ns)
            res = json.loads(Path(f"{_base(scenario.results, pod, rank)}.json").read_text())
            log = _losses(scenario.results, pod, rank)
            resumed = res["resume"]
            assert (resumed["action"], resumed["step"], resumed["exact"]) == (
                "resume_shm",
                replica_step + 1,
                True,
            ), (rank, resumed, stored_at_loss.id)
            assert res["final_params_sha256"] == ref[rank]["final_params_sha256"], rank
            for e in log:
                assert e["loss"] == ref[rank]["losses"][str(e["step"])], (rank, e)
        for rank in master_ranks:
            steps = {e["step"] for e in _losses(scenario.results, master.pod, rank)}
            assert steps == set(range(STEPS)), rank
        # the Worker's two pods together logged every step, each as the reference did
        again_pod = cluster.get_json("pod", recreated.name, "-n", ns)
        [sc] = recreated.sidecars
        for rank in worker_ranks:
            first = _losses(scenario.results, worker.pod, rank)
            second = _losses(scenario.results, again_pod, rank)
            for e in first:
                assert e["loss"] == ref[rank]["losses"][str(e["step"])], (rank, e)
            assert {e["step"] for e in first} | {e["step"] for e in second} == set(range(STEPS))
            # the recreated Worker's sidecar installed the replica held on the Master's node
            installed = f"rehydration of rank {rank}: step {replica_step} from peer {master_ip}:"
            assert installed in sc.log_text(), sc.log_text()[-3000:]
        print(f"node loss ({nproc} rank(s) per pod): replica step {replica_step}, storage "
              f"{stored_at_loss.step}, {time.monotonic() - started:.0f} s")  # fmt: skip
    finally:
        cluster.kubectl("delete", "pytorchjob", job, "-n", ns, "--ignore-not-found", check=False)
        for name in nodes:
            cluster.kubectl("delete", "node", name, "--ignore-not-found", check=False)
