"""Failures and running time per node pool: the ledger, the config, and a restart's MTBF."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from ckpt_agent.decide.mtbf import PoolEvidence, estimate_mtbf
from ckpt_operator.app.handlers import MEMO_KEY, make_runtime, on_node_event
from ckpt_operator.behaviours.recovery import observe_job, recover_job
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import RecoveryConfig, parse_config
from ckpt_operator.model.jobs import job_facts, parse_time
from ckpt_operator.planners.pools import DEFAULT_POOL_LABELS, PoolLedger, node_names, pool_of

GKE = "cloud.google.com/gke-nodepool"
EKS = "eks.amazonaws.com/nodegroup"
TYPE = "node.kubernetes.io/instance-type"
H = 3600.0


def _node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


def _ledger(**nodes: str) -> PoolLedger:
    """Nodes named by keyword, each on the GKE pool given."""
    ledger = PoolLedger()
    for name, pool in nodes.items():
        ledger.note_node(_node(name, **{GKE: pool}), DEFAULT_POOL_LABELS)
    return ledger


@pytest.mark.parametrize(
    ("labels", "pool"),
    [
        ({GKE: "a100", TYPE: "a2-highgpu-8g"}, f"{GKE}=a100"),
        ({EKS: "p4d", TYPE: "p4d.24xlarge"}, f"{EKS}=p4d"),
        ({TYPE: "p4d.24xlarge"}, f"{TYPE}=p4d.24xlarge"),  # the instance type as a fallback
        ({"karpenter.sh/nodepool": "gpu"}, "karpenter.sh/nodepool=gpu"),
        ({"kubernetes.azure.com/agentpool": "nd96"}, "kubernetes.azure.com/agentpool=nd96"),
        ({GKE: "", TYPE: "x"}, f"{TYPE}=x"),  # an empty value is no pool
        ({"kubernetes.io/hostname": "n1"}, None),
        ({}, None),
    ],
)
def test_pool_of_the_first_label_present(labels: dict[str, str], pool: str | None) -> None:
    assert pool_of(labels, DEFAULT_POOL_LABELS) == pool


def test_pool_labels_are_configurable() -> None:
    assert RecoveryConfig().node_pool_labels == DEFAULT_POOL_LABELS
    env = {"CKPT_OPERATOR_WEBHOOK": "false"}
    assert parse_config([], env).recovery.node_pool_labels == DEFAULT_POOL_LABELS
    flags = ["--node-pool-label", "example.com/pool", "--node-pool-label", TYPE]
    assert parse_config(flags, env).recovery.node_pool_labels == ("example.com/pool", TYPE)
    env["CKPT_OPERATOR_NODE_POOL_LABELS"] = "a/b, c/d"
    assert parse_config([], env).recovery.node_pool_labels == ("a/b", "c/d")
    assert pool_of({"c/d": "x"}, ("a/b", "c/d")) == "c/d=x"


def test_a_node_is_remembered_relabelled_and_forgotten() -> None:
    ledger = _ledger(n1="a100")
    assert ledger.nodes == {"n1": f"{GKE}=a100"}
    ledger.note_node(_node("n1", **{GKE: "h100"}), DEFAULT_POOL_LABELS)
    assert ledger.nodes == {"n1": f"{GKE}=h100"}
    ledger.note_node(_node("n1"), DEFAULT_POOL_LABELS)  # no pool label any more
    assert ledger.nodes == {}
    ledger.note_node({"metadata": {}}, DEFAULT_POOL_LABELS)  # no name: ignored
    assert ledger.nodes == {}


def test_record_once_per_job_and_only_with_a_known_pool_and_time() -> None:
    ledger = _ledger(n1="a100", n2="a100")
    assert ledger.record("uid1", "run-a", ["n1", "n1", "n2"], H, failed=True)
    assert not ledger.record("uid1", "run-a", ["n1"], 9 * H, failed=True)  # once
    assert not ledger.record("uid2", "run-a", ["unknown-node"], H, failed=True)
    assert not ledger.record("uid3", "run-a", ["n1"], 0.0, failed=True)
    assert not ledger.record("uid4", "run-a", ["n1"], float("nan"), failed=True)
    assert not ledger.record("uid5", "run-a", [], H, failed=True)
    (share,) = ledger.jobs["uid1"]
    # two distinct nodes (a pod per rank on n1 counts n1 once): 2 node-hours, 1 failure
    assert (share.pool, share.failures, share.node_seconds) == (f"{GKE}=a100", 1.0, 2 * H)


def test_a_failure_spread_over_pools_is_shared_by_node_count() -> None:
    ledger = _ledger(n1="a", n2="a", n3="a", n4="b")
    ledger.record("uid", "run", ["n1", "n2", "n3", "n4", "gone"], H, failed=True)
    shares = {s.pool: (s.failures, s.node_seconds) for s in ledger.jobs["uid"]}
    assert shares == {f"{GKE}=a": (0.75, 3 * H), f"{GKE}=b": (0.25, H)}
    ledger.record("ok", "run2", ["n4"], 2 * H, failed=False)
    assert [(s.failures, s.node_seconds) for s in ledger.jobs["ok"]] == [(0.0, 2 * H)]


def test_evidence_is_what_other_runs_showed_on_the_runs_main_pool() -> None:
    ledger = _ledger(n1="a", n2="a", n3="b", n4="b", n5="b")
    assert ledger.evidence("run", ["n1"]) is None  # nothing recorded
    ledger.record("j1", "run", ["n1"], 10 * H, failed=True)  # the run's own failure
    assert ledger.evidence("run", ["n1"]) is None  # ... is not the pool's evidence
    ledger.record("j2", "other", ["n1", "n2"], 5 * H, failed=True)
    ledger.record("j3", "third", ["n2"], 4 * H, failed=False)
    ledger.record("j4", "fourth", ["n3"], 7 * H, failed=True)
    assert ledger.evidence("run", ["n1"]) == PoolEvidence(1.0, 14 * H, 1)
    # most of the run's nodes are on pool b: its evidence, for a run on 3 nodes
    assert ledger.evidence("run", ["n1", "n3", "n4"]) == PoolEvidence(1.0, 7 * H, 3)
    # a tie goes to the first pool by name
    assert ledger.evidence("run", ["n1", "n3"]) == PoolEvidence(1.0, 14 * H, 2)
    assert ledger.evidence("run", ["unknown"]) is None
    assert ledger.evidence("fourth", ["n5"]) is None  # only its own record on b


def test_the_ledger_is_bounded() -> None:
    ledger = PoolLedger(max_nodes=3, max_jobs=2)
    for i in range(5):
        ledger.note_node(_node(f"n{i}", **{GKE: "a"}), DEFAULT_POOL_LABELS)
    assert list(ledger.nodes) == ["n2", "n3", "n4"]
    for i in range(4):
        ledger.record(f"j{i}", f"r{i}", ["n4"], H, failed=True)
    assert list(ledger.jobs) == ["j2", "j3"]
    assert ledger.evidence("x", ["n4"]) == PoolEvidence(2.0, 2 * H, 1)


def test_node_names() -> None:
    pods: list[dict[str, Any]] = [{"spec": {"nodeName": "n1"}}, {"spec": {}}, {}]
    pods.append({"spec": {"nodeName": "n2"}})
    assert node_names(pods) == ["n1", "n2"]


# --------------------------------------------------------------------------- a restart

RUN = "mnist-ddp-5f0c6a7e"
FAILED_AT = parse_time("2024-05-02T11:02:17Z") or 0.0


def _failed_pod(fixture: Any, node: str) -> dict[str, Any]:
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["metadata"].setdefault("labels", {}).update(
        {c.LABEL_INJECTED: "true", c.LABEL_TO_JOB_NAME: "mnist-ddp"}
    )
    pod["metadata"]["namespace"] = "ml-team"
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Failed"}
    return dict(pod)


def test_a_restart_blends_the_pools_failures_into_the_mtbf(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.runs[RUN] = [rec("full", 1000, created_at=FAILED_AT - 900)]
    pools = world.deps.pools
    pools.note_node(_node("gpu-1", **{GKE: "a100"}), DEFAULT_POOL_LABELS)
    # another run on the pool failed 4 times, an hour each; one succeeded after 10 hours
    for i in range(4):
        pools.record(f"o{i}", "other", ["gpu-1"], H, failed=True)
    pools.record("ok", "third", ["gpu-1"], 10 * H, failed=False)
    world.api.add_pod(_failed_pod(fixture, "gpu-1"))
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    created = job_facts(job).created_at
    assert created is not None
    asyncio.run(recover_job(world.deps, job))
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]
    mtbf = float(child["metadata"]["annotations"][c.ANN_MTBF_SECONDS])
    pool = PoolEvidence(4.0, 14 * H, 1)
    assert mtbf == pytest.approx(estimate_mtbf(86_400, 1, FAILED_AT - created, pool), rel=1e-5)
    assert mtbf < estimate_mtbf(86_400, 1, FAILED_AT - created) * 0.6  # a flaky pool
    # the failure is booked for the pool's next runs (once, however often it is looked at)
    (share,) = [s for job in pools.jobs.values() for s in job if s.run_id == RUN]
    assert share.failures == 1.0 and share.node_seconds == pytest.approx(FAILED_AT - created)


def test_a_succeeded_job_books_its_running_time(world: Any, fixture: Any) -> None:
    pools = world.deps.pools
    pools.note_node(_node("gpu-1", **{GKE: "a100"}), DEFAULT_POOL_LABELS)
    job = fixture("pytorchjob_failed.json")
    job["status"]["conditions"] = [
        {"type": "Succeeded", "status": "True", "lastTransitionTime": "2024-05-02T11:02:17Z"}
    ]
    pod = _failed_pod(fixture, "gpu-1")
    pod["status"] = {"phase": "Succeeded"}
    world.deps.pods.upsert(pod)
    job = world.api.add_job(job)
    world.clock.now = FAILED_AT + 10 * 86_400  # seen long after: it ran until it succeeded
    asyncio.run(observe_job(world.deps, job))
    asyncio.run(observe_job(world.deps, job))  # again: booked once
    shares = [s for j in pools.jobs.values() for s in j]
    assert len(shares) == 1 and shares[0].failures == 0.0
    assert shares[0].node_seconds == pytest.approx(FAILED_AT - (job_facts(job).created_at or 0))


def test_the_node_watch_teaches_the_ledger_the_pools(world: Any) -> None:
    memo = kopf.Memo({MEMO_KEY: make_runtime(world.deps)})
    node: Any = _node("gpu-7", **{EKS: "p5"})  # kopf.Body takes a raw body
    asyncio.run(on_node_event(type=None, body=kopf.Body(node), memo=memo))
    assert world.deps.pools.nodes == {"gpu-7": f"{EKS}=p5"}
    # a deleted node keeps its pool: the failures of its pods still count
    asyncio.run(on_node_event(type="DELETED", body=kopf.Body(node), memo=memo))
    assert world.deps.pools.nodes == {"gpu-7": f"{EKS}=p5"}
