"""Checkpoint-aware preemption with the real Kueue controller (issue #30).

Kueue (``ckpt_e2e.kueue``, started once for this module by the ``kueue`` fixture) admits
the jobs of a ClusterQueue with quota for exactly one job. A low-priority opted-in
PyTorchJob trains with the agent; a high-priority job arrives; Kueue evicts the low one
(its Workload ``Evicted``/``Preempted``, the job suspended: the training-operator deletes
its pods, whose processes get SIGTERM); the agent's SIGTERM checkpoint commits within the
grace. When the high one has finished, Kueue re-admits the low one: the training-operator
creates its pods again, the operator's webhook injects them as for any pod of the run, and
they resume from that save. Nothing there needs the operator's Kueue feature: SIGTERM is
enough. The same for a TrainJob (Kueue's trainjob integration), and for a save that
cannot finish within the grace (the previous checkpoint stands).

Scenario 2 shows what the operator's Kueue feature adds (chart ``kueue.enabled``): two
equal-priority jobs, one freshly checkpointed and one with much at-risk work; with the
policy's priority boost on, Kueue evicts the fresh one; with it off, Kueue's own order
(the most recently admitted) evicts the other.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_e2e.fit.faults import INJECT_DIR
from ckpt_e2e.kubelet import PodRun, PodRunner
from ckpt_e2e.kueue import (
    PRIORITY_BOOST_ANNOTATION,
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
from ckpt_e2e.stack import Stack
from ckpt_e2e.tools import REPO_ROOT
from ckpt_e2e.trainer_v2 import NODE
from ckpt_e2e.training import (
    StorageView,
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
from ckpt_e2e.trainjob import TrainJobs, restart_attempt, trainjob_manifest

# one xdist worker runs them one after another (CI: -n 2 --dist loadgroup), so Kueue (a
# module fixture) starts once, on that worker's cluster only
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("kueue")]

#: The preempted run: slow enough that the preemption lands in the middle.
TRAINING = Training(steps=60, seed=7, step_sleep=0.15)
#: The preemptor: a short plain run (no agent), it only needs the quota.
PREEMPTOR = Training(steps=8, seed=3, step_sleep=0.05, checkpoint=False)
#: One job's pods (one master: ``pytorchjob_manifest`` requests 1 CPU, 1Gi).
ONE_JOB = {"cpu": "1", "memory": "1Gi"}
LOW, HIGH = "ckpt-e2e-low", "ckpt-e2e-high"
PYTORCHJOB, TRAINJOB = "PyTorchJob", "TrainJob"


@pytest.fixture
def queue(kueue: Kueue, scenario: Scenario) -> Iterator[str]:
    """A ClusterQueue with quota for one job (preempting lower priorities), the
    namespace's LocalQueue ``lq`` feeding it; returns the LocalQueue's name."""
    with _queue(kueue, scenario, ONE_JOB) as lq:
        yield lq


@contextlib.contextmanager
def _queue(kueue: Kueue, scenario: Scenario, quota: dict[str, str]) -> Iterator[str]:
    cq = f"cq-{scenario.namespace}"[:63]
    kueue.apply(resource_flavor())
    kueue.apply(workload_priority_class(LOW, 100))
    kueue.apply(workload_priority_class(HIGH, 1000))
    kueue.apply(cluster_queue(cq, quota))
    kueue.apply(local_queue("lq", cq), namespace=scenario.namespace)
    try:
        yield "lq"
    finally:
        kueue.delete("clusterqueue", cq)


def _submit(
    scenario: Scenario, name: str, training: Training, queue: str, priority: str, **kw: Any
) -> None:
    manifest = pytorchjob_manifest(name, training, scenario.results, **kw)
    manifest = with_labels(manifest, queue_labels(queue, priority))
    scenario.cluster.apply(manifest, namespace=scenario.namespace)


def _suspended(job: dict[str, Any] | None) -> bool:
    return bool(((job or {}).get("spec") or {}).get("runPolicy", {}).get("suspend"))


def _log(run: PodRun) -> str:
    return run.local.log_text()[-3000:] if run.local else ""


def _env(run: PodRun, container: str) -> dict[str, Any]:
    ctr = next(c for c in run.pod["spec"]["containers"] if c["name"] == container)
    return {e["name"]: e.get("value") for e in ctr.get("env") or ()}


def _preempt(
    kueue: Kueue, scenario: Scenario, runner: PodRunner, queue: str, kind: str, victim: str
) -> tuple[float, PodRun]:
    """A high-priority PyTorchJob arrives; waits until Kueue evicted ``victim`` for it.
    Returns when it was submitted and the preemptor's pod run (``runner`` starts it once
    the victim's quota is free; not waited for)."""
    t0 = time.time()
    _submit(scenario, "high", PREEMPTOR, queue, HIGH, policy=None)
    evicted = kueue.wait_workload(scenario.namespace, kind, victim, "Evicted", timeout=60)
    why = workload_condition(evicted, "Evicted")
    assert why is not None and why["reason"] == "Preempted", why
    return t0, runner.wait_run("high", timeout=90)


def _sigterm_save(
    scenario: Scenario, view: StorageView, run_id: str, run: PodRun, since: float
) -> CheckpointRecord:
    """The evicted pod was deleted (SIGTERM) and exited 143; its agent committed an
    emergency checkpoint before the pod ended, at most one step behind the last step the
    pod logged, and it is the run's newest valid checkpoint. Returns it."""
    assert run.wait(60) == 143, _log(run)
    assert run.local is not None and run.local.terminated_by_deletion
    ended = time.time()
    killed_at = last_logged_step(scenario.results, run.pod)
    saves = [r for r in view.since(run_id, since) if r.emergency and "sigterm" in r.reason.lower()]
    assert saves, [(r.id, r.reason) for r in view.since(run_id, since)]
    save = max(saves, key=lambda r: r.step)
    assert save.created_at <= ended  # committed within the grace, before the pod was gone
    newest = view.newest_valid(run_id)
    assert newest is not None and newest.id == save.id
    assert killed_at - save.step <= 1, (killed_at, save.step)  # at most one step lost
    assert "Traceback" not in _log(run), _log(run)
    return save


def _assert_resumed_exactly(
    scenario: Scenario, run: PodRun, save: CheckpointRecord, ref: dict[str, Any]
) -> None:
    """The re-admitted pod resumed right after ``save`` and ended bitwise like ``ref``."""
    assert run.wait(180) == 0, _log(run)
    res = json.loads(result_path(scenario.results, run.pod).read_text())
    assert res["resume"]["checkpoint_id"] == save.id, res["resume"]
    assert res["resume"]["exact"] is True
    assert res["first_step"] == save.step + 1
    for step, loss in res["losses"].items():  # bit for bit the uninterrupted run's losses
        assert loss == ref["losses"][step], f"step {step}"
    assert final_loss(res) == final_loss(ref)
    assert res["final_params_sha256"] == ref["final_params_sha256"]


def _no_failure_events(scenario: Scenario, name: str) -> None:
    reasons = [e["reason"] for e in events(scenario.cluster, scenario.namespace, name=name)]
    for r in ("JobFailed", "Restarted", "GaveUp"):
        assert r not in reasons, reasons


# --------------------------------------------------------------------------- scenario 1
def test_preempted_pytorchjob_saves_on_sigterm_and_resumes_on_readmission(
    kueue: Kueue, scenario: Scenario, queue: str
) -> None:
    ns = scenario.namespace
    ref = reference_run(TRAINING, scenario.cluster.workdir / "reference")
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
    t_preempt, high = _preempt(kueue, scenario, runner, queue, PYTORCHJOB, "low")
    save = _sigterm_save(scenario, view, run_id, first, t_preempt)
    assert _suspended(scenario.job("low"))

    # 3. the preemptor runs in the freed quota and finishes
    assert high.wait(120) == 0, _log(high)
    assert condition(scenario.wait_finished("high"), "Succeeded") is not None

    # 4. Kueue re-admits the low job; its new pod is injected and resumes from the save
    kueue.wait_workload(ns, PYTORCHJOB, "low", "Admitted", timeout=60)
    second = runner.wait_run("low", index=1, timeout=90)
    assert second.name == first.name and second.uid != first.uid
    assert second.pod["metadata"]["labels"].get("ckpt.dev/inject") == "true"
    assert _env(second, "pytorch")["CKPT_RUN_ID"] == run_id  # same run, same storage
    _assert_resumed_exactly(scenario, second, save, ref)

    # 5. the preemption was not a failure: no restart, no failed job, Succeeded in place
    job = scenario.wait_finished("low")
    assert condition(job, "Succeeded") is not None
    assert condition(job, "Failed") is None
    ann = annotations_of(job)
    assert RESTARTED_AS not in ann and "ckpt.dev/restart-count" not in ann, ann
    _no_failure_events(scenario, "low")
    assert scenario.job("low-r1") is None
    kueue.wait_workload(ns, PYTORCHJOB, "low", "Finished", timeout=30)


def test_preempted_trainjob_saves_on_sigterm_and_resumes_on_readmission(
    kueue: Kueue, scenario: Scenario, trainjobs: TrainJobs, queue: str
) -> None:
    ns = scenario.namespace
    ref = reference_run(TRAINING, scenario.cluster.workdir / "reference")
    scenario.apply_policy("e2e", pulse_every=50, full_every=1000)
    view = scenario.view()
    runner = trainjobs.runner()
    pytorchjobs = scenario.runner()  # the preemptor's (a PyTorchJob) pods

    # 1. the low-priority TrainJob: admitted, JobSet -> Job -> pod, trains with the agent
    manifest = trainjob_manifest("low", TRAINING, scenario.results, policy="e2e")
    manifest = with_labels(manifest, queue_labels(queue, LOW))
    trainjobs.wait_operator_admits(manifest)
    scenario.cluster.apply(manifest, namespace=ns)
    kueue.wait_workload(ns, TRAINJOB, "low", "Admitted")
    first = trainjobs.wait_attempt(runner, "low", 0)
    run_id = trainjobs.run_id("low")
    scenario.wait_step(first, 12)

    # 2. the preemptor: Kueue suspends the TrainJob (JobSet suspended, its Job's pod deleted)
    t_preempt, high = _preempt(kueue, scenario, pytorchjobs, queue, TRAINJOB, "low")
    save = _sigterm_save(scenario, view, run_id, first, t_preempt)
    assert (trainjobs.trainjob("low") or {}).get("spec", {}).get("suspend") is True
    assert high.wait(120) == 0, _log(high)

    # 3. re-admitted: the Job's new pod (no JobSet restart) resumes from the save
    kueue.wait_workload(ns, TRAINJOB, "low", "Admitted", timeout=60)
    second = runner.wait_run("low", index=1, timeout=90)
    assert restart_attempt(second.pod) == 0  # the same attempt: a resumed Job, not a restart
    assert _env(second, NODE)["CKPT_RUN_ID"] == run_id
    _assert_resumed_exactly(scenario, second, save, ref)
    done = trainjobs.wait_condition("low", "Complete", timeout=60)
    assert condition(done, "Failed") is None
    assert trainjobs.jobset_restarts("low") == 0
    assert "ckpt.dev/restart-attempt" not in trainjobs.annotations("low")
    _no_failure_events(scenario, "low")


# --------------------------------------------------------------------------- scenario 2
#: Two equal-priority jobs that run on while the victim is chosen (never to the end).
LONG = Training(steps=2000, seed=11, step_sleep=0.2)
TWO_JOBS = {"cpu": "2", "memory": "2Gi"}
#: A boost that moves fast enough for a test: one point per second of at-risk work.
BOOST = {"maxBoost": 500, "secondsPerPoint": 1.0, "minUpdateSeconds": 1.0}


@contextlib.contextmanager
def _operator_with_kueue(stack: Stack) -> Iterator[None]:
    """The chart upgraded with ``kueue.enabled`` (RBAC on Workloads, ``--kueue=true``) and
    the operator restarted from it; both put back afterwards."""
    with stack.upgraded({"kueue": {"enabled": True}}, expect_arg="--kueue=true"):
        yield


def _boost(kueue: Kueue, ns: str, job: str) -> int | None:
    wl = kueue.workload_of(ns, PYTORCHJOB, job)
    value = annotations_of(wl).get(PRIORITY_BOOST_ANNOTATION)
    return None if value is None else int(value)


def _victim(kueue: Kueue, scenario: Scenario, fresh: str, stale: str, high: str) -> str:
    """Submit the preemptor ``high`` (one job's quota) and return which of ``fresh`` and
    ``stale`` Kueue evicted for it (exactly one)."""
    ns = scenario.namespace
    _submit(scenario, high, PREEMPTOR, "lq", HIGH, policy=None)

    def evicted() -> list[str]:
        return [
            j
            for j in (fresh, stale)
            if workload_condition(kueue.workload_of(ns, PYTORCHJOB, j), "Evicted")
        ]

    victims = scenario.cluster.wait_for(evicted, timeout=60, what=f"Kueue evicting for {high}")
    assert isinstance(victims, list) and len(victims) == 1, victims
    kueue.wait_workload(ns, PYTORCHJOB, high, "Admitted", timeout=60)  # in the freed quota
    return str(victims[0])


def _run_pair(
    kueue: Kueue, scenario: Scenario, runner: PodRunner, fresh: str, stale: str
) -> tuple[PodRun, PodRun]:
    """``fresh`` admitted first, ``stale`` a few seconds later (Kueue's own order, among
    equal priorities: the most recently admitted goes first), both training."""
    ns = scenario.namespace
    _submit(scenario, fresh, LONG, "lq", LOW, policy=fresh)
    a = runner.wait_run(fresh)
    scenario.wait_step(a, 3)
    _submit(scenario, stale, LONG, "lq", LOW, policy=stale)
    b = runner.wait_run(stale)
    scenario.wait_step(b, 3)
    t_a, t_b = (
        workload_condition(kueue.wait_workload(ns, PYTORCHJOB, j, "QuotaReserved"), "QuotaReserved")
        for j in (fresh, stale)
    )
    assert t_a and t_b and t_a["lastTransitionTime"] < t_b["lastTransitionTime"]
    return a, b


def _end(scenario: Scenario, runner: PodRunner, *jobs: str) -> None:
    """Delete the jobs and wait until every pod process of theirs has ended."""
    for job in jobs:
        scenario.cluster.kubectl("delete", "pytorchjob", job, "-n", scenario.namespace)
    for run in (r for job in jobs for r in runner.runs_of(job)):
        if run.local is not None:
            run.wait(60)


def test_boost_makes_kueue_preempt_the_freshly_checkpointed_job(
    kueue: Kueue, scenario: Scenario, stack: Stack
) -> None:
    ns = scenario.namespace
    runner = scenario.runner()
    # a pulse every step: nothing at risk; vs no save in the test's time
    fresh_policy: dict[str, Any] = {"pulse_every": 1, "full_every": 1000}
    stale_policy: dict[str, Any] = {"pulse_every": 1000, "full_every": 1000}
    with _queue(kueue, scenario, TWO_JOBS), _operator_with_kueue(stack):
        # 1. boost on: the operator writes each Workload's at-risk work as its boost
        on = {"preemption": {"priorityBoost": {"enabled": True, **BOOST}}}
        scenario.apply_policy("fresh-on", extra=on, **fresh_policy)
        scenario.apply_policy("stale-on", extra=on, **stale_policy)
        a, b = _run_pair(kueue, scenario, runner, "fresh-on", "stale-on")

        def ordered() -> tuple[int, int] | None:
            fa, fb = _boost(kueue, ns, "fresh-on"), _boost(kueue, ns, "stale-on")
            return (fa, fb) if fa is not None and fb is not None and fa < fb else None

        boosts = scenario.cluster.wait_for(
            ordered, timeout=45, what="the fresh job's boost below the stale one's"
        )
        t_preempt = time.time()
        victim_on = _victim(kueue, scenario, "fresh-on", "stale-on", "high-on")
        assert victim_on == "fresh-on", (victim_on, boosts)  # the one that loses least
        assert a.wait(60) == 143 and b.running
        view = scenario.view()
        run_id = scenario.run_id("fresh-on")
        saved = [r for r in view.since(run_id, t_preempt) if r.emergency]
        assert saved, [(r.id, r.reason) for r in view.since(run_id, t_preempt)]
        assert last_logged_step(scenario.results, a.pod) - max(r.step for r in saved) <= 1
        # the operator asked the victim's pod to save as soon as the Workload was evicted
        assert events(scenario.cluster, ns, name="fresh-on", reason="PreemptionSave", wait=30)
        _end(scenario, runner, "fresh-on", "stale-on", "high-on")

        # 2. boost off (the policy field): no boost, Kueue's own order evicts the newer
        scenario.apply_policy("fresh-off", **fresh_policy)
        scenario.apply_policy("stale-off", **stale_policy)
        _run_pair(kueue, scenario, runner, "fresh-off", "stale-off")
        assert _boost(kueue, ns, "fresh-off") is None
        assert _boost(kueue, ns, "stale-off") is None
        victim_off = _victim(kueue, scenario, "fresh-off", "stale-off", "high-off")
        assert victim_off == "stale-off"  # the most recently admitted: much work lost
        _end(scenario, runner, "fresh-off", "stale-off", "high-off")


# --------------------------------------------------------------------------- save past the grace
#: The victim's pods' grace: far shorter than the (delayed) emergency save.
SHORT_GRACE_S = 3


def _fault_env(fault: dict[str, Any]) -> dict[str, str]:
    """A pod env that installs the FIT ``fault`` in every Python process of the container
    (``ckpt_e2e.fit.faults`` through ``inject/sitecustomize.py``)."""
    paths = [str(INJECT_DIR), str(REPO_ROOT / "e2e"), str(REPO_ROOT / "agent")]
    own = os.environ.get("PYTHONPATH")
    return {
        "CKPT_FIT_FAULT": json.dumps(fault),
        "PYTHONPATH": os.pathsep.join([*paths, *([own] if own else [])]),
    }


def test_preemption_save_past_the_grace_leaves_the_previous_checkpoint(
    kueue: Kueue, scenario: Scenario, queue: str
) -> None:
    """The eviction's SIGTERM save cannot finish within the grace (a blob write stalls, a
    FIT delay armed right before the preemption): the pod is killed mid-save, nothing of
    that save is valid, and the re-admitted pod resumes from the checkpoint before it,
    exactly."""
    ns = scenario.namespace
    ref = reference_run(TRAINING, scenario.cluster.workdir / "reference")
    # maxGraceSeconds 0: the webhook leaves the pods' short grace as the job wrote it
    no_raise = {"preemption": {"maxGraceSeconds": 0}}
    scenario.apply_policy("e2e", pulse_every=10, full_every=1000, extra=no_raise)
    view = scenario.view()
    # once armed, the next blob write stalls 60 s: the SIGTERM save's, or a routine save's
    # still in flight at the eviction, which the SIGTERM save then waits behind (armed by
    # the test, not by a count of saves: under load the trainer is well past the first
    # pulse by the time that pulse is validated)
    marker = scenario.results / "delay-fired"
    armed = scenario.results / "stall-armed"
    fault = {"delay": {"seconds": 60, "marker": str(marker), "armed_by": str(armed)}}
    runner = scenario.runner(extra_env=_fault_env(fault))

    _submit(
        scenario,
        "low",
        TRAINING,
        queue,
        LOW,
        policy="e2e",
        termination_grace_seconds=SHORT_GRACE_S,
    )
    first = runner.wait_run("low")
    assert first.pod["spec"]["terminationGracePeriodSeconds"] == SHORT_GRACE_S
    run_id = scenario.run_id("low")
    scenario.cluster.wait_for(
        lambda: view.newest_valid(run_id), timeout=90, what="the first pulse valid"
    )
    before = view.newest_valid(run_id)
    assert before is not None and before.step >= 10, before
    armed.touch()

    t_preempt, high = _preempt(kueue, scenario, runner, queue, PYTORCHJOB, "low")
    code = first.wait(60)
    assert code in (137, 143), _log(first)
    assert marker.exists(), "no save reached a blob write after the stall was armed"
    assert time.time() - t_preempt < 30  # the grace ended the pod, not the 60 s stall
    killed_at = last_logged_step(scenario.results, first.pod)
    # nothing of the interrupted save is valid: a checkpoint from before it is the resume
    # point (the first pulse, or a routine save that committed before the stall)
    newest = view.newest_valid(run_id)
    assert newest is not None and newest.step >= before.step, newest
    assert not (newest.emergency and "sigterm" in newest.reason.lower()), newest
    sigterm = [r for r in view.checkpoints(run_id) if r.emergency and "sigterm" in r.reason.lower()]
    assert all(r.status != CheckpointStatus.VALID for r in sigterm), sigterm
    assert high.wait(120) == 0, _log(high)

    kueue.wait_workload(ns, PYTORCHJOB, "low", "Admitted", timeout=60)
    second = runner.wait_run("low", index=1, timeout=90)
    _assert_resumed_exactly(scenario, second, newest, ref)
    assert killed_at > newest.step  # the steps since it are what the preemption cost
    job = scenario.wait_finished("low")
    assert condition(job, "Succeeded") is not None
    _no_failure_events(scenario, "low")


# ------------------------------------------------------------ a save that outlasts the preemptor
def test_readmission_waits_for_the_evicted_pod_still_saving(
    kueue: Kueue, scenario: Scenario, stack: Stack, queue: str
) -> None:
    """The preemptor is done while the evicted pod still writes its emergency checkpoint
    (its first blob stalls until the test lets it go on). Kueue would re-admit the job at
    once, and the training-operator would then see the old pod end and fail the job (a
    counted restart); with the operator's Kueue feature the Workload stays inactive until
    the pod is gone, then is admitted and resumes from that save, in place."""
    ns = scenario.namespace
    ref = reference_run(TRAINING, scenario.cluster.workdir / "reference")
    scenario.apply_policy("e2e", pulse_every=50, full_every=1000)
    view = scenario.view()
    go_on = scenario.results / "save-may-go-on"
    marker = scenario.results / "delay-fired"
    stall = {"seconds": 120, "after_commits": 0, "marker": str(marker), "until_file": str(go_on)}
    runner = scenario.runner(extra_env=_fault_env({"delay": stall}))
    with _operator_with_kueue(stack):
        _submit(scenario, "low", TRAINING, queue, LOW, policy="e2e")
        first = runner.wait_run("low")
        run_id = scenario.run_id("low")
        scenario.wait_step(first, 12)
        assert not marker.exists()

        # 1. evicted; the preemptor runs in the freed quota and finishes, the save stalls
        t_preempt, high = _preempt(kueue, scenario, runner, queue, PYTORCHJOB, "low")
        assert high.wait(120) == 0, _log(high)
        assert marker.exists() and first.running, _log(first)

        # 2. the quota is free, but the Workload stays held while its pod saves
        deadline = time.time() + 8
        while time.time() < deadline:
            wl = kueue.workload_of(ns, PYTORCHJOB, "low")
            assert wl is not None and wl["spec"].get("active") is False, wl
            reserved = workload_condition(wl, "QuotaReserved")
            assert not reserved or reserved["status"] != "True", reserved
            assert condition(scenario.job("low"), "Failed") is None
            time.sleep(0.5)
        assert first.running
        assert events(scenario.cluster, ns, name="low", reason="PreemptionHold", wait=10)

        # 3. the save goes on: it commits, the pod ends, the hold is released, re-admitted
        go_on.write_text("")
        assert first.wait(60) == 143, _log(first)
        killed_at = last_logged_step(scenario.results, first.pod)
        save = view.newest_valid(run_id)
        assert save is not None and save.emergency and save.created_at >= t_preempt, save
        assert killed_at - save.step <= 1, (killed_at, save.step)
        kueue.wait_workload(ns, PYTORCHJOB, "low", "Admitted", timeout=60)
        assert events(scenario.cluster, ns, name="low", reason="PreemptionReleased", wait=10)
        second = runner.wait_run("low", index=1, timeout=90)
        _assert_resumed_exactly(scenario, second, save, ref)

        # 4. no failure, no restart: the job succeeded in place
        job = scenario.wait_finished("low")
        assert condition(job, "Succeeded") is not None and condition(job, "Failed") is None
        _no_failure_events(scenario, "low")
        assert scenario.job("low-r1") is None
