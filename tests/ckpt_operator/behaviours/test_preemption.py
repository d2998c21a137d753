"""Checkpoint-aware Kueue preemption, the behaviour (#30): boost writes on the Workload,
back-off from a foreign owner, the save on eviction, the steps lost on re-admission, and a
Kueue suspension that never counts as a failure."""

from __future__ import annotations

import asyncio
import copy
import types
from typing import Any

import kopf
import pytest

from ckpt_operator.adapters.kube import ConflictError, NotFoundError
from ckpt_operator.app.handlers import MEMO_KEY, make_runtime, register
from ckpt_operator.app.kueue import KueueHandlers
from ckpt_operator.behaviours.attempts import observe_trainjob, recover_trainjob
from ckpt_operator.behaviours.preemption import PreemptionState, reconcile_workload
from ckpt_operator.behaviours.recovery import observe_job
from ckpt_operator.kinds.trainjob import RESTART_PROBE_S
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import format_time
from ckpt_operator.planners.preemption import (
    ANN_BOOST,
    ANN_BOOST_WRITTEN,
    ANN_HELD,
    ANN_PREEMPTED,
    ANN_SAVE_SECONDS,
    BoostAction,
)
from tests.ckpt_operator.conftest import RUN_ID

NS = "ml-team"
WL = "pytorchjob-mnist-ddp-1a2b3"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _patch_custom(
    self: Any, group: str, version: str, plural: str, namespace: str, name: str, patch: Any
) -> dict[str, Any]:
    """The API server's merge patch of a Workload, with its resourceVersion precondition."""
    self.calls.append(("patch_custom", (plural, name, copy.deepcopy(patch))))
    obj = self.custom.get((plural, namespace, name))
    if obj is None:
        raise NotFoundError(404, f"{plural} {name} not found")
    meta = obj["metadata"]
    want = patch.get("metadata", {}).get("resourceVersion")
    if want is not None and want != meta.get("resourceVersion"):
        raise ConflictError(409, "the object has been modified")
    ann = meta.setdefault("annotations", {})
    for k, v in patch["metadata"].get("annotations", {}).items():
        if v is None:
            ann.pop(k, None)
        else:
            ann[k] = v
    obj.setdefault("spec", {}).update(patch.get("spec", {}))
    meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)
    return copy.deepcopy(obj)


@pytest.fixture
def kueue(world: Any, fixture: Any) -> Any:
    """The world with a Kueue Workload API, an opted-in running PyTorchJob with its pod,
    and a policy with the boost on."""
    world.api.patch_custom = types.MethodType(_patch_custom, world.api)
    policy = world.api.policies[(NS, "llm-finetune")]
    policy["spec"]["preemption"] = {"priorityBoost": {"enabled": True}}
    job = world.api.add_job(fixture("pytorchjob_running.json"))
    world.deps.jobs.upsert(job)
    pod = fixture("pod_running_injected.json")
    world.api.add_pod(pod)
    world.deps.pods.upsert(pod)
    return world


def workload(world: Any, *conditions: dict[str, Any], **annotations: str) -> dict[str, Any]:
    """The Workload as the API holds it (added or replaced), as a watch would deliver it."""
    old = world.api.custom.get(("workloads", NS, WL))
    version = int(old["metadata"]["resourceVersion"]) + 1 if old else 1
    wl = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": WL,
            "namespace": NS,
            "uid": "wl-uid",
            "resourceVersion": str(version),
            "annotations": dict(annotations),
            "ownerReferences": [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": "mnist-ddp",
                    "uid": "5f0c6a7e-3b1d-4c9a-9e2f-8d7b6a5c4e31",
                    "controller": True,
                }
            ],
        },
        "spec": {"podSets": [{"name": "master", "count": 1, "template": {"spec": {}}}]},
        "status": {"conditions": list(conditions)},
    }
    world.api.add_custom("workloads", wl)
    return copy.deepcopy(wl)


def current(world: Any) -> dict[str, Any]:
    return copy.deepcopy(world.api.custom[("workloads", NS, WL)])


def admitted(world: Any, since: float | None = None) -> dict[str, Any]:
    when = format_time(since if since is not None else world.clock.now - 3600)
    return {"type": "QuotaReserved", "status": "True", "lastTransitionTime": when}


def evicted(reason: str = "Preempted") -> dict[str, Any]:
    return {
        "type": "Evicted",
        "status": "True",
        "reason": reason,
        "message": "Preempted to accommodate a workload due to prioritization in the ClusterQueue",
        "lastTransitionTime": "2024-05-02T12:00:00Z",
    }


def checkpoints(world: Any, rec: Any, *, age: float = 600, newest_step: int = 1460) -> None:
    now = world.clock.now
    world.source.runs[RUN_ID] = [
        rec("full", 1000, created_at=now - 900),
        rec("pulse", 1200, created_at=now - age),
    ]
    world.source.heartbeats[RUN_ID] = [(newest_step - 10, now - 20), (newest_step, now - 5)]


def events(world: Any, reason: str) -> list[Any]:
    return [e for e in world.events.events if e.reason == reason]


def kind_of(event: Any) -> str:
    return str(event.obj).split("/", 1)[0]


def patches(world: Any) -> list[Any]:
    return world.api.called("patch_custom")


# --------------------------------------------------------------------------- the boost


def test_an_admitted_workload_gets_the_boost_of_its_at_risk_work(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)  # newest valid 600 s old, heartbeat 5 s ago: 595 s + 10 s save
    state = PreemptionState()
    plan = run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue))))
    assert plan is not None and plan.action is BoostAction.WRITE
    ann = current(kueue)["metadata"]["annotations"]
    assert ann[ANN_BOOST] == ann[ANN_BOOST_WRITTEN] == str((595 + 10) // 30)
    assert kueue.counter("ckpt_priority_boost_writes_total", action="write") == 1
    changed = events(kueue, "PriorityBoostChanged")
    assert {kind_of(e) for e in changed} == {"PyTorchJob", "Workload"}
    assert "260 steps / 605s at risk" in changed[0].message
    # the expected save time is recorded on the job for the webhook's grace
    assert kueue.api.jobs[(NS, "mnist-ddp")]["metadata"]["annotations"][ANN_SAVE_SECONDS] == "10"


def test_a_look_within_the_rate_limit_reads_no_storage(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    state = PreemptionState()
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue))))
    listed = len(kueue.source.listed)
    kueue.clock.now += 10  # < minUpdateSeconds
    assert run(reconcile_workload(kueue.deps, state, current(kueue))) is None
    assert len(kueue.source.listed) == listed and len(patches(kueue)) == 1


def test_a_boost_the_hysteresis_holds_reads_storage_once_per_min_update(
    kueue: Any, rec: Any
) -> None:
    """Nothing is written while the boost moves less than the hysteresis, so the write's
    rate limit never skips the read: the reads have their own (every refresh re-read the
    run: at 100 jobs on S3, ~66 requests a second)."""
    checkpoints(kueue, rec)
    state = PreemptionState()
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue))))
    writes, reads = len(patches(kueue)), len(kueue.source.listed)
    kueue.clock.now += 31  # the write's rate limit has passed; the boost barely moved
    plan = run(reconcile_workload(kueue.deps, state, current(kueue)))
    assert plan is not None and plan.action is BoostAction.NONE  # held by the hysteresis
    assert len(kueue.source.listed) == reads + 1 and len(patches(kueue)) == writes
    for _ in range(2):  # the refresh, every 10 s: no read within minUpdateSeconds
        kueue.clock.now += 10
        assert run(reconcile_workload(kueue.deps, state, current(kueue))) is None
    assert len(kueue.source.listed) == reads + 1
    kueue.clock.now += 11
    assert run(reconcile_workload(kueue.deps, state, current(kueue))) is not None
    assert len(kueue.source.listed) == reads + 2


def test_a_fresh_checkpoint_lowers_the_boost_once_the_rate_limit_allows(
    kueue: Any, rec: Any
) -> None:
    checkpoints(kueue, rec)
    state = PreemptionState()
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue))))
    kueue.clock.now += 40
    checkpoints(kueue, rec, age=5)  # just checkpointed
    plan = run(reconcile_workload(kueue.deps, state, current(kueue)))
    # nothing trained since the checkpoint: only the 10 s save is at risk
    assert plan is not None and plan.action is BoostAction.WRITE and plan.value == 0
    assert current(kueue)["metadata"]["annotations"][ANN_BOOST] == "0"
    assert kueue.counter("ckpt_priority_boost_writes_total", action="write") == 2


def test_a_stale_version_is_not_overwritten(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    stale = workload(kueue, admitted(kueue))
    workload(kueue, admitted(kueue))  # changed meanwhile
    plan = run(reconcile_workload(kueue.deps, PreemptionState(), stale))
    assert plan is not None and plan.action is BoostAction.WRITE
    assert ANN_BOOST not in current(kueue)["metadata"]["annotations"]  # 409: next event
    assert kueue.counter("ckpt_priority_boost_writes_total", action="write") == 0
    assert not events(kueue, "PriorityBoostChanged")


def test_a_foreign_boost_is_left_alone_and_reported_once(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    state = PreemptionState()
    wl = workload(kueue, admitted(kueue), **{ANN_BOOST: "1000"})
    for _ in range(3):
        plan = run(reconcile_workload(kueue.deps, state, wl))
        assert plan is not None and plan.action is BoostAction.CONFLICT
        kueue.clock.now += 60  # past minUpdateSeconds: each look reads again
    assert not patches(kueue)
    assert current(kueue)["metadata"]["annotations"][ANN_BOOST] == "1000"
    conflicts = events(kueue, "PriorityBoostConflict")
    assert len(conflicts) == 2 and {e.type for e in conflicts} == {"Warning"}  # job + Workload
    assert "backs off" in conflicts[0].message


def test_a_boost_changed_after_our_write_is_a_conflict(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    state = PreemptionState()
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue))))
    taken = current(kueue)
    taken["metadata"]["annotations"][ANN_BOOST] = "7"  # another controller
    kueue.clock.now += 3600
    plan = run(reconcile_workload(kueue.deps, state, taken))
    assert plan is not None and plan.action is BoostAction.CONFLICT
    assert len(patches(kueue)) == 1  # only the first write


def test_unreadable_storage_gives_no_boost_and_says_so_once(kueue: Any, rec: Any) -> None:
    kueue.source.unreachable = True
    state = PreemptionState()
    wl = workload(kueue, admitted(kueue))
    for _ in range(2):
        plan = run(reconcile_workload(kueue.deps, state, wl))
        assert plan is not None and plan.action is BoostAction.NONE
        kueue.clock.now += 60  # past minUpdateSeconds: each look reads again
    assert not patches(kueue)
    told = events(kueue, "PriorityBoostUnavailable")
    assert len(told) == 2 and "cannot read" in told[0].message  # once, on job and Workload


def test_a_pending_workload_gets_no_boost(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    plan = run(reconcile_workload(kueue.deps, PreemptionState(), workload(kueue)))
    assert plan is not None and plan.action is BoostAction.NONE
    assert not kueue.source.listed  # nothing read for a Workload that gets nothing


def test_the_boost_is_removed_when_the_job_ends(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    state = PreemptionState()
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue))))
    job = kueue.api.jobs[(NS, "mnist-ddp")]
    job["status"]["conditions"].append({"type": "Succeeded", "status": "True"})
    kueue.deps.jobs.upsert(job)
    kueue.clock.now += 1  # well within the rate limit: a removal is not delayed
    plan = run(reconcile_workload(kueue.deps, state, current(kueue)))
    assert plan is not None and plan.action is BoostAction.REMOVE
    ann = current(kueue)["metadata"]["annotations"]
    assert ANN_BOOST not in ann and ANN_BOOST_WRITTEN not in ann
    assert kueue.counter("ckpt_priority_boost_writes_total", action="remove") == 1
    assert "the job ended" in events(kueue, "PriorityBoostChanged")[-1].message


def test_the_boost_off_writes_nothing(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    kueue.api.policies[(NS, "llm-finetune")]["spec"]["preemption"] = {}
    plan = run(reconcile_workload(kueue.deps, PreemptionState(), workload(kueue, admitted(kueue))))
    assert plan is not None and plan.action is BoostAction.NONE and not patches(kueue)


def test_workloads_of_other_jobs_are_ignored(kueue: Any, rec: Any) -> None:
    wl = workload(kueue, admitted(kueue))
    wl["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": "x"}]
    assert run(reconcile_workload(kueue.deps, PreemptionState(), wl)) is None
    wl = workload(kueue, admitted(kueue))
    wl["metadata"]["ownerReferences"][0]["name"] = "not-opted-in"
    assert run(reconcile_workload(kueue.deps, PreemptionState(), wl)) is None
    assert not patches(kueue) and not kueue.events.events


# --------------------------------------------------------------------------- eviction


def test_an_eviction_asks_every_pod_to_save_once(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    state = PreemptionState()
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue))))
    wl = workload(kueue, admitted(kueue), evicted(), **current(kueue)["metadata"]["annotations"])
    run(reconcile_workload(kueue.deps, state, wl))
    pod = kueue.api.pods[(NS, "mnist-ddp-worker-0")]
    signal = pod["metadata"]["annotations"][c.ANN_SAVE_NOW]
    assert signal.startswith("Preemption-")
    assert "Kueue evicted" in pod["metadata"]["annotations"][c.ANN_SAVE_NOW_REASON]
    assert kueue.counter("ckpt_preemption_saves_total", reason="Preempted") == 1
    assert kueue.counter("ckpt_operator_save_now_signals_total", reason="Preemption") == 1
    saves = events(kueue, "PreemptionSave")
    assert {kind_of(e) for e in saves} == {"PyTorchJob", "Workload"}
    assert "260 steps at risk" in saves[0].message
    assert current(kueue)["metadata"]["annotations"][ANN_PREEMPTED] == signal
    # the same eviction seen again (and after an operator restart): nothing new
    for again in (state, PreemptionState()):
        run(reconcile_workload(kueue.deps, again, current(kueue)))
    assert kueue.counter("ckpt_preemption_saves_total", reason="Preempted") == 1
    assert len(events(kueue, "PreemptionSave")) == 2
    # and the boost went with the eviction
    ann = current(kueue)["metadata"]["annotations"]
    assert ANN_BOOST not in ann
    assert "evicted (Preempted)" in events(kueue, "PriorityBoostChanged")[-1].message


def test_readmission_is_held_until_the_evicted_pods_are_gone(kueue: Any, rec: Any) -> None:
    """Kueue re-admits as soon as the quota allows; the training-operator would count an
    evicted pod still saving as a failed replica of the re-admitted job: the Workload is
    inactive until the pods are gone (or their grace plus a margin has passed)."""
    checkpoints(kueue, rec)
    state = PreemptionState()
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue), evicted())))
    wl = current(kueue)
    assert wl["spec"]["active"] is False
    assert float(wl["metadata"]["annotations"][ANN_HELD]) == kueue.clock.now
    (hold, *_) = events(kueue, "PreemptionHold")
    assert "1 evicted pod(s)" in hold.message
    # the pod is terminating (its save): still held, at every look
    pod = kueue.api.pods[(NS, "mnist-ddp-worker-0")]
    pod["metadata"]["deletionTimestamp"] = format_time(kueue.clock.now)
    kueue.deps.pods.upsert(pod)
    kueue.clock.now += 20
    run(reconcile_workload(kueue.deps, state, current(kueue)))
    assert current(kueue)["spec"]["active"] is False and not events(kueue, "PreemptionReleased")
    # gone: active again, the mark of the hold removed, said once
    kueue.deps.pods.remove(pod)
    run(reconcile_workload(kueue.deps, state, current(kueue)))
    wl = current(kueue)
    assert wl["spec"]["active"] is True and ANN_HELD not in wl["metadata"]["annotations"]
    released = events(kueue, "PreemptionReleased")
    assert {kind_of(e) for e in released} == {"PyTorchJob", "Workload"}
    assert "the evicted pods have ended" in released[0].message
    run(reconcile_workload(kueue.deps, state, current(kueue)))
    assert len(events(kueue, "PreemptionReleased")) == 2
    assert kueue.counter("ckpt_preemption_saves_total", reason="Preempted") == 1


def test_a_workload_deactivated_by_someone_is_never_held_or_reactivated(
    kueue: Any, rec: Any
) -> None:
    checkpoints(kueue, rec)
    wl = workload(kueue, admitted(kueue), evicted("InactiveWorkload"))
    wl["spec"]["active"] = False
    kueue.api.add_custom("workloads", copy.deepcopy(wl))
    run(reconcile_workload(kueue.deps, PreemptionState(), wl))
    assert events(kueue, "PreemptionSave")  # its pods still save
    assert ANN_HELD not in current(kueue)["metadata"]["annotations"]
    assert current(kueue)["spec"]["active"] is False  # left as its owner set it
    assert not events(kueue, "PreemptionHold")


def test_no_save_request_when_save_on_eviction_is_off(kueue: Any, rec: Any) -> None:
    kueue.api.policies[(NS, "llm-finetune")]["spec"]["preemption"] = {"saveOnEviction": False}
    run(reconcile_workload(kueue.deps, PreemptionState(), workload(kueue, evicted())))
    pod = kueue.api.pods[(NS, "mnist-ddp-worker-0")]
    assert c.ANN_SAVE_NOW not in pod["metadata"]["annotations"]
    assert not events(kueue, "PreemptionSave")


def test_readmission_books_the_steps_lost(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    state = PreemptionState()
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue), evicted())))
    # the emergency save committed at step 1460; the pods had trained to 1461
    now = kueue.clock.now
    kueue.source.runs[RUN_ID].append(rec("full", 1460, created_at=now))
    kueue.source.heartbeats[RUN_ID].append((1461, now + 1))
    kueue.clock.now += 120
    kueue.deps.pods.remove(kueue.api.pods[(NS, "mnist-ddp-worker-0")])  # the pod ended
    run(reconcile_workload(kueue.deps, state, current(kueue)))  # the hold is released
    marked = current(kueue)["metadata"]["annotations"]
    assert ANN_HELD not in marked
    run(reconcile_workload(kueue.deps, state, workload(kueue, admitted(kueue), **marked)))
    assert kueue.metrics.registry.get_sample_value("ckpt_preemption_lost_steps_count") == 1
    assert kueue.metrics.registry.get_sample_value("ckpt_preemption_lost_steps_sum") == 1
    resumed = events(kueue, "PreemptionResumed")
    assert "1 step(s) lost" in resumed[0].message and "checkpoint step 1460" in resumed[0].message
    assert ANN_PREEMPTED not in current(kueue)["metadata"]["annotations"]


# --------------------------------------------------------------------------- the handlers


def test_without_kueue_no_workload_handler_is_registered() -> None:
    def plurals(registry: kopf.OperatorRegistry) -> set[str]:
        return {
            str(h.selector.any_name) if h.selector else ""
            for h in registry._watching.get_all_handlers()  # type: ignore[attr-defined]
        }

    assert "workloads" not in plurals(register(kopf.OperatorRegistry(), webhooks=False))
    assert "workloads" in plurals(register(kopf.OperatorRegistry(), webhooks=False, kueue=True))


def test_the_refresh_looks_at_every_known_workload(kueue: Any, rec: Any) -> None:
    checkpoints(kueue, rec)
    memo = kopf.Memo({MEMO_KEY: make_runtime(kueue.deps)})
    handlers = KueueHandlers(lambda m: m[MEMO_KEY].deps)
    body = kopf.Body(workload(kueue))  # pending: nothing
    run(handlers.on_event(type="ADDED", body=body, memo=memo))
    assert not patches(kueue)
    workload(kueue, admitted(kueue))  # admitted; the refresh finds it from the API's version
    handlers.state.upsert(current(kueue))
    run(handlers.refresh_all(kueue.deps))
    assert ANN_BOOST in current(kueue)["metadata"]["annotations"]
    assert "spec" not in handlers.state.workloads[(NS, WL)]  # no pod templates kept
    run(handlers.on_event(type="DELETED", body=kopf.Body(current(kueue)), memo=memo))
    assert not handlers.state.workloads


# --------------------------------------------------------------------------- suspension


def test_a_kueue_suspended_pytorchjob_is_not_a_failure(kueue: Any) -> None:
    """Kueue suspends an evicted PyTorchJob (``Suspended=True``) and its pods are deleted:
    nothing for recovery, no restart counted."""
    job = kueue.api.jobs[(NS, "mnist-ddp")]
    job["spec"].setdefault("runPolicy", {})["suspend"] = True
    job["status"]["conditions"] = [
        {"type": "Created", "status": "True"},
        {"type": "Running", "status": "False"},
        {"type": "Suspended", "status": "True", "reason": "PyTorchJobSuspended"},
    ]
    kueue.deps.pods.remove(kueue.api.pods.pop((NS, "mnist-ddp-worker-0")))
    assert run(observe_job(kueue.deps, job)) is False
    ann = kueue.api.jobs[(NS, "mnist-ddp")]["metadata"]["annotations"]
    assert c.ANN_RESTART_COUNT not in ann
    assert not kueue.api.called("create_job")


def test_a_kueue_suspended_trainjob_plans_no_restart_attempt(world: Any, fixture: Any) -> None:
    """A suspended TrainJob's pods terminate (JobSet suspended, ``restarts`` unchanged): the
    operator looks at the JobSet for a while, then stops; no attempt, no restart counted."""
    tj = fixture("trainjob_running.json")
    tj["spec"]["suspend"] = True
    tj["status"] = {"conditions": [{"type": "Suspended", "status": "True", "reason": "Suspended"}]}
    tj = world.api.add_job(tj)
    world.deps.trainjobs.upsert(tj)
    js = fixture("jobset_restarting.json")
    js["status"]["restarts"] = 0
    js["spec"]["suspend"] = True
    world.api.add_custom(c.JOBSET_PLURAL, js)
    world.deps.jobsets.upsert(js)
    pod = fixture("trainjob_pod.json")
    pod["metadata"]["name"], pod["metadata"]["uid"] = "llm-ft-node-0-0-abcde", "pod-uid"
    pod["metadata"]["deletionTimestamp"] = format_time(world.clock.now)
    world.deps.trainjob_pods.upsert(pod)
    assert run(observe_trainjob(world.deps, tj)) is False
    world.clock.now += RESTART_PROBE_S + 1
    assert run(recover_trainjob(world.deps, tj)) is None
    assert not world.api.called("create_job")
    ann = world.api.trainjobs[(NS, "llm-ft")]["metadata"]["annotations"]
    assert c.ANN_RESTART_COUNT not in ann and c.ANN_RESTART_ATTEMPT not in ann


def test_a_trainjob_eviction_signals_its_pods(world: Any, fixture: Any) -> None:
    world.api.patch_custom = types.MethodType(_patch_custom, world.api)
    tj = world.api.add_job(fixture("trainjob_running.json"))
    world.deps.trainjobs.upsert(tj)
    pod = fixture("trainjob_pod.json")
    pod["metadata"].update(name="llm-ft-node-0-0-abcde", uid="pod-uid")
    pod["metadata"]["labels"][c.LABEL_INJECTED] = "true"
    pod["status"] = {"phase": "Running"}
    world.api.add_pod(pod)
    world.deps.trainjob_pods.upsert(pod)
    wl = workload(world, evicted("PodsReadyTimeout"))
    wl["metadata"]["ownerReferences"] = [
        {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": "llm-ft"}
    ]
    run(reconcile_workload(world.deps, PreemptionState(), wl))
    signalled = world.api.pods[(NS, "llm-ft-node-0-0-abcde")]["metadata"]["annotations"]
    assert signalled[c.ANN_SAVE_NOW].startswith("Preemption-")
    assert world.counter("ckpt_preemption_saves_total", reason="PodsReadyTimeout") == 1
    assert {kind_of(e) for e in events(world, "PreemptionSave")} == {"TrainJob", "Workload"}


def test_the_save_text_never_counts_negative_steps_at_risk(rec: Any) -> None:
    """The heartbeat ring is flushed a moment behind: a pulse newer than its newest step
    means nothing is at risk, not -1 steps."""
    from ckpt_operator.behaviours.preemption import RunRead, _save_text
    from ckpt_operator.planners.workload import Eviction

    eviction = Eviction("Preempted", "m", "t", "uid")
    run = RunRead([rec("pulse", 50, created_at=11.0)], [(49, 10.0)])
    text = _save_text(eviction, 1, run)
    assert "0 steps at risk (step 50, newest valid checkpoint step 50)" in text
