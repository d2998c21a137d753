"""Scenario: a zombie pod on a lost node is fenced; the restarted job loses nothing (#28).

The job runs on a kwok node of its own. Its node is then *cut off* rather than killed: the
training container is frozen (SIGSTOP: a partitioned node's pod makes no progress that
anyone sees), the node goes ``NotReady`` and is tainted out-of-service as in the FIT
``node-lost`` scenario, so the control plane evicts the pod, the training-operator fails
the job and the operator restarts it on a spare node — while the old process still exists
(the harness's stand-in kubelet neither kills it nor reports its exit: no kubelet of a lost
node can). Once the restarted pod claimed a newer writer generation of the run and
committed a checkpoint, the zombie is woken (SIGCONT). At its next save it must stop with
``FencedError`` naming the holder (its termination report says ``fenced``, with the
holder's pod and node), and the restarted job must end exactly like an uninterrupted run
with every checkpoint it committed still there and intact.
"""

from __future__ import annotations

import json
import signal
import uuid
from dataclasses import dataclass

import pytest

from ckpt_agent.errors import NotFoundError
from ckpt_agent.format.fence import generations, holder_of
from ckpt_agent.format.layout import commit_key
from ckpt_agent.format.manifest import CommitManifest
from ckpt_agent.format.termination import parse_report
from ckpt_agent.format.verify import verify_hashes
from ckpt_e2e.fit.cluster import cut_off_node
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import StorageView, Training, final_loss, reference_run, result_path

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=80, seed=7, step_sleep=0.15)
POOL_LABEL = "e2e.ckpt.dev/pool"


@dataclass(frozen=True)
class _Commit:
    id: str
    generation: int


def _commits(view: StorageView, run_id: str) -> list[_Commit]:
    """Every committed checkpoint with the writer generation its COMMIT records."""
    out = []
    for r in view.checkpoints(run_id):
        try:
            raw = view.storage.read(commit_key(run_id, r.id))
        except NotFoundError:  # deleted meanwhile
            continue
        out.append(_Commit(r.id, CommitManifest.from_bytes(raw, r.id).meta.generation))
    return out


def test_a_zombie_on_a_lost_node_is_fenced_and_the_restart_loses_nothing(
    scenario: Scenario,
) -> None:
    cluster = scenario.cluster
    ref = reference_run(TRAINING, cluster.workdir / "reference")  # first: both CPUs
    tag = uuid.uuid4().hex[:5]
    lost, spare = f"kwok-zombie-{tag}", f"kwok-spare-{tag}"
    pool = {POOL_LABEL: f"zombie-{tag}"}
    cluster.create_node(lost, labels=pool)
    try:
        scenario.apply_policy(
            "e2e",
            recovery={"backoffSeconds": 0},
            retention={"routineKeep": 100, "importantKeep": 100},
        )
        view = scenario.view()
        runner = scenario.runner()
        scenario.submit("train", TRAINING, node_selector=pool, termination_grace_seconds=10)
        first = runner.wait_run("train")
        assert first.pod["spec"]["nodeName"] == lost and first.local is not None
        run_id = scenario.run_id("train")

        def valid_at(step: int) -> bool:
            assert first.running, first.local and first.local.log_text()[-3000:]
            newest = view.newest_valid(run_id)
            return newest is not None and newest.step >= step

        cluster.wait_for(lambda: valid_at(20), timeout=120, what="a valid checkpoint >= 20")
        assert generations(view.storage, run_id) == [1]

        # 1. the node is cut off: the container freezes, the process stays
        first.local.signal_container(signal.SIGSTOP)
        first.local.lose_node(kill=False)
        cluster.create_node(spare, labels=pool)
        cut_off_node(cluster, lost)

        # 2. the operator restarts the job on the spare node; its pod claims generation 2
        restart = scenario.wait_restart("train", timeout=120)
        name = restart["metadata"]["name"]
        resume_from = restart["metadata"]["annotations"]["ckpt.dev/resume-from"]
        second = runner.wait_run(name, timeout=90)
        assert second.pod["spec"]["nodeName"] == spare
        assert first.running, "the zombie's process must still exist"
        cluster.wait_for(
            lambda: generations(view.storage, run_id) == [1, 2], timeout=60, what="generation 2"
        )
        holder = holder_of(view.storage, run_id)
        assert holder is not None
        assert (holder.pod, holder.node) == (second.name, spare)  # the downward API's names

        def holder_committed() -> bool:
            assert second.running or second.exit_code == 0, second.local and second.local.log_text()
            return any(r.generation == 2 for r in _commits(view, run_id))

        cluster.wait_for(holder_committed, timeout=120, what="a checkpoint of generation 2")

        # 3. the zombie wakes: fenced at its next save, it stops and names the holder
        first.local.signal_container(signal.SIGCONT)
        code = first.wait(120)
        log = first.local.log_text()
        # the documented error itself (the flash persister's fence reaches the trainer)
        assert code != 0 and "ckpt_agent.errors.FencedError: run" in log, log[-3000:]
        assert f"pod {second.name} on node {spare}" in log, log[-3000:]
        report = parse_report(first.local.termination_log.read_text())
        assert report.fenced is not None, report
        assert (report.fenced.generation, report.fenced.holder) == (1, 2)
        assert (report.fenced.pod, report.fenced.node) == (second.name, spare)
        assert first.local.reported_status is None  # a lost node reports nothing

        # 4. the restarted job ends exactly like an uninterrupted run ...
        assert second.wait(240) == 0, second.local.log_text()[-3000:] if second.local else ""
        res = json.loads(result_path(scenario.results, second.pod).read_text())
        assert res["resume"]["checkpoint_id"] == resume_from
        assert res["resume"]["exact"] is True
        assert final_loss(res) == final_loss(ref)
        assert res["final_params_sha256"] == ref["final_params_sha256"]
        # ... and every checkpoint it committed is there, its own, and intact
        mine = [r for r in _commits(view, run_id) if r.generation == 2]
        assert mine, "the restarted job committed checkpoints"
        for r in mine:
            check = verify_hashes(view.storage, run_id, r.id)
            assert check.ok, (r.id, check)
        assert generations(view.storage, run_id) == [1, 2]
    finally:
        for node in (lost, spare):
            cluster.kubectl("delete", "node", node, "--ignore-not-found", check=False)
