"""Checkpoint-aware preemption with the real Kueue controller (issue #30).

Kueue (``ckpt_e2e.kueue``, started once for this module by the ``kueue`` fixture) admits
the jobs of a ClusterQueue with quota for exactly one job. A low-priority opted-in
PyTorchJob trains with the agent; a high-priority job arrives; Kueue evicts the low one
(its Workload ``Evicted``/``Preempted``, the job suspended: the training-operator deletes
its pods, whose processes get SIGTERM); the agent's SIGTERM checkpoint commits within the
grace. When the high one has finished, Kueue re-admits the low one: the training-operator
creates its pods again, the operator's webhook injects them as for any pod of the run, and
they resume from that save. Nothing here needs the operator's Kueue feature: SIGTERM is
enough (scenario 2 shows what the operator's priority boost adds).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ckpt_agent.records import CheckpointRecord
from ckpt_e2e.kubelet import PodRun
from ckpt_e2e.kueue import (
    Kueue,
    cluster_queue,
    local_queue,
    queue_labels,
    resource_flavor,
    with_labels,
    workload_condition,
    workload_priority_class,
)
from ckpt_e2e.scenario import RESTARTED_AS, Scenario
from ckpt_e2e.training import (
    Training,
    annotations_of,
    condition,
    events,
    final_loss,
    last_logged_step,
    pytorchjob_manifest,
    reference_run,
    result_path,
)

pytestmark = pytest.mark.e2e

#: The preempted run: slow enough that the preemption lands in the middle.
TRAINING = Training(steps=60, seed=7, step_sleep=0.15)
#: The preemptor: a short plain run (no agent), it only needs the quota.
PREEMPTOR = Training(steps=8, seed=3, step_sleep=0.05, checkpoint=False)
#: One job's pods (one master: ``pytorchjob_manifest`` requests 1 CPU, 1Gi).
ONE_JOB = {"cpu": "1", "memory": "1Gi"}
LOW, HIGH = "ckpt-e2e-low", "ckpt-e2e-high"
PYTORCHJOB = "PyTorchJob"


@pytest.fixture
def queue(kueue: Kueue, scenario: Scenario) -> Iterator[str]:
    """A ClusterQueue with quota for one job (preempting lower priorities), the
    namespace's LocalQueue ``lq`` feeding it; returns the LocalQueue's name."""
    cq = f"cq-{scenario.namespace}"[:63]
    kueue.apply(resource_flavor())
    kueue.apply(workload_priority_class(LOW, 100))
    kueue.apply(workload_priority_class(HIGH, 1000))
    kueue.apply(cluster_queue(cq, ONE_JOB))
    kueue.apply(local_queue("lq", cq), namespace=scenario.namespace)
    yield "lq"
    kueue.delete("clusterqueue", cq)


def _submit(
    scenario: Scenario, name: str, training: Training, queue: str, priority: str, **kw: Any
) -> None:
    manifest = pytorchjob_manifest(name, training, scenario.results, **kw)
    manifest = with_labels(manifest, queue_labels(queue, priority))
    scenario.cluster.apply(manifest, namespace=scenario.namespace)


def _log(run: PodRun) -> str:
    return run.local.log_text()[-3000:] if run.local else ""


def _suspended(job: dict[str, Any] | None) -> bool:
    return bool(((job or {}).get("spec") or {}).get("runPolicy", {}).get("suspend"))


# --------------------------------------------------------------------------- scenario 1
def test_preempted_job_saves_on_sigterm_and_resumes_on_readmission(
    kueue: Kueue, scenario: Scenario, queue: str
) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    ref = reference_run(TRAINING, cluster.workdir / "reference")
    # scheduled saves are rare: the preemption's SIGTERM save is what the resume uses
    scenario.apply_policy("e2e", pulse_every=50, full_every=1000)
    view = scenario.view()
    runner = scenario.runner()

    # 1. the low-priority job is admitted (quota for one job) and trains with the agent
    _submit(scenario, "low", TRAINING, queue, LOW, policy="e2e")
    low_wl = kueue.wait_workload(ns, PYTORCHJOB, "low", "Admitted")
    assert low_wl["spec"]["priority"] == 100
    first = runner.wait_run("low")
    run_id = scenario.run_id("low")
    scenario.wait_step(first, 12)

    # 2. a high-priority job arrives: Kueue evicts the low one (job suspended, pods deleted)
    t_preempt = time.time()
    _submit(scenario, "high", PREEMPTOR, queue, HIGH, policy=None)
    evicted = kueue.wait_workload(ns, PYTORCHJOB, "low", "Evicted", timeout=60)
    why = workload_condition(evicted, "Evicted")
    assert why is not None and why["reason"] == "Preempted", why
    assert first.wait(60) == 143, _log(first)
    assert first.local is not None and first.local.terminated_by_deletion
    assert _suspended(scenario.job("low"))
    ended = time.time()
    killed_at = last_logged_step(scenario.results, first.pod)
    saves = [
        r for r in view.since(run_id, t_preempt) if r.emergency and "sigterm" in r.reason.lower()
    ]
    assert saves, [(r.id, r.reason) for r in view.since(run_id, t_preempt)]
    last: CheckpointRecord = max(saves, key=lambda r: r.step)
    assert last.created_at <= ended  # committed before the pod was gone, within the grace
    newest = view.newest_valid(run_id)
    assert newest is not None and newest.id == last.id
    assert killed_at - last.step <= 1, (killed_at, last.step)  # at most one step lost
    assert "Traceback" not in _log(first), _log(first)

    # 3. the preemptor runs in the freed quota and finishes
    high = runner.wait_run("high", timeout=90)
    assert high.wait(120) == 0, _log(high)
    assert condition(scenario.wait_finished("high"), "Succeeded") is not None

    # 4. Kueue re-admits the low job; its new pod is injected and resumes from the save
    kueue.wait_workload(ns, PYTORCHJOB, "low", "Admitted", timeout=60)
    second = runner.wait_run("low", index=1, timeout=90)
    assert second.name == first.name and second.uid != first.uid
    assert second.pod["metadata"]["labels"].get("ckpt.dev/inject") == "true"
    env = {e["name"]: e.get("value") for e in second.pod["spec"]["containers"][0]["env"]}
    assert env["CKPT_RUN_ID"] == run_id  # same run, same storage folder
    assert second.wait(180) == 0, _log(second)
    res = json.loads(result_path(scenario.results, second.pod).read_text())
    assert res["resume"]["checkpoint_id"] == last.id, res["resume"]
    assert res["resume"]["exact"] is True
    assert res["first_step"] == last.step + 1
    for step, loss in res["losses"].items():  # bit for bit the uninterrupted run's losses
        assert loss == ref["losses"][step], f"step {step}"
    assert final_loss(res) == final_loss(ref)
    assert res["final_params_sha256"] == ref["final_params_sha256"]

    # 5. the preemption was not a failure: no restart, no failed job, Succeeded in place
    job = scenario.wait_finished("low")
    assert condition(job, "Succeeded") is not None
    assert condition(job, "Failed") is None
    ann = annotations_of(job)
    assert RESTARTED_AS not in ann and "ckpt.dev/restart-count" not in ann, ann
    reasons = [e["reason"] for e in events(cluster, ns, name="low")]
    assert "JobFailed" not in reasons and "Restarted" not in reasons, reasons
    assert scenario.job("low-r1") is None
    kueue.wait_workload(ns, PYTORCHJOB, "low", "Finished", timeout=30)
