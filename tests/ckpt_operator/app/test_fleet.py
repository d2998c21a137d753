"""The operator at fleet scale (issue #19): caches, executors, pod-template labels,
unprotected-pod reports, sub-second backoff, memory back to baseline."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
import pytest

from ckpt_operator.adapters.caches import ObjectCache, PodIndex
from ckpt_operator.adapters.kube import KubernetesApi
from ckpt_operator.adapters.metrics import Metrics
from ckpt_operator.app.handlers import (
    MEMO_KEY,
    make_runtime,
    on_job_event,
    on_policy_event,
    on_training_pod_event,
)
from ckpt_operator.app.loops import RecoveryScheduler
from ckpt_operator.app.main import build_settings, executors, start_threads
from ckpt_operator.behaviours.admission import inject_pod, label_job_ops, report_unprotected
from ckpt_operator.behaviours.recovery import observe_job, recover_job
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import parse_config
from ckpt_operator.model.jobs import (
    format_time,
    inject_label_patch,
    label_templates_in_place,
    parse_time,
    unlabelled_replicas,
)
from ckpt_operator.model.jsonpatch import apply_patch
from tests.ckpt_operator.planners.test_reports import message, reported
from tests.ckpt_operator.planners.test_reports import pod as report_pod


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _pod(name: str, job: str, *, phase: str = "Running", rv: str = "1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ml-team",
            "uid": f"uid-{name}",
            "resourceVersion": rv,
            "labels": {c.LABEL_TO_JOB_NAME: job, c.LABEL_INJECT: "true"},
        },
        "status": {"phase": phase},
    }


# --------------------------------------------------------------------------- caches


def test_object_cache_keeps_the_newest_version_and_forgets_deleted_objects() -> None:
    cache = ObjectCache()
    new = {"metadata": {"namespace": "a", "name": "p", "resourceVersion": "7"}, "spec": 2}
    old = {"metadata": {"namespace": "a", "name": "p", "resourceVersion": "5"}, "spec": 1}
    cache.upsert(new)
    cache.upsert(old)  # a late API read never undoes a newer watch event
    assert cache.get("a", "p") == new and len(cache) == 1
    cache.upsert({**new, "metadata": {**new["metadata"], "resourceVersion": "8"}, "spec": 3})
    assert (cache.get("a", "p") or {})["spec"] == 3
    cache.remove("a", "p")
    assert cache.get("a", "p") is None and len(cache) == 0


def test_pod_index_groups_pods_by_job_and_drops_empty_jobs() -> None:
    index = PodIndex()
    index.upsert(_pod("j-worker-0", "j"))
    index.upsert(_pod("j-worker-1", "j"))
    index.upsert(_pod("k-worker-0", "k"))
    index.upsert({"metadata": {"name": "web", "namespace": "ml-team"}})  # no job label
    assert sorted(p["metadata"]["name"] for p in index.of_job("ml-team", "j")) == [
        "j-worker-0",
        "j-worker-1",
    ]
    index.upsert(_pod("j-worker-0", "j", phase="Failed", rv="2"))
    phases = {p["metadata"]["name"]: p["status"]["phase"] for p in index.of_job("ml-team", "j")}
    assert phases["j-worker-0"] == "Failed"
    for name in ("j-worker-0", "j-worker-1", "k-worker-0"):
        index.remove(_pod(name, name.split("-")[0]))
    assert len(index) == 0 and index._by_job == {}


def test_watch_events_feed_the_caches_and_deletions_empty_them(world: Any, fixture: Any) -> None:
    policy = world.api.policies[("ml-team", "llm-finetune")]
    job = fixture("pytorchjob_running.json")
    world.api.add_job(job)

    async def main() -> tuple[int, int, int, int, int, int]:
        runtime = make_runtime(world.deps)
        memo = kopf.Memo({MEMO_KEY: runtime})
        await on_policy_event(type=None, body=kopf.Body(policy), memo=memo)
        await on_job_event(type=None, body=kopf.Body(job), memo=memo)
        await on_training_pod_event(
            type=None, body=kopf.Body(_pod("mnist-ddp-worker-0", "mnist-ddp")), memo=memo
        )
        full = (len(world.deps.policies), len(world.deps.jobs), len(world.deps.pods))
        await on_training_pod_event(
            type="DELETED", body=kopf.Body(_pod("mnist-ddp-worker-0", "mnist-ddp")), memo=memo
        )
        await on_job_event(type="DELETED", body=kopf.Body(job), memo=memo)
        await on_policy_event(type="DELETED", body=kopf.Body(policy), memo=memo)
        await runtime.recovery.stop()
        return (*full, len(world.deps.policies), len(world.deps.jobs), len(world.deps.pods))

    assert run(main()) == (1, 1, 1, 0, 0, 0)
    assert len(world.deps.reported_pods) == 0


def test_observe_job_reads_the_policy_from_the_cache(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    label_templates_in_place(job)
    world.api.add_job(job)
    world.deps.policies.upsert(world.api.policies[("ml-team", "llm-finetune")])
    for _ in range(5):
        run(observe_job(world.deps, job))
    assert world.api.called("get_policy") == []


def test_a_cache_miss_reads_the_api_once_and_remembers_the_policy(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    world.api.add_job(job)
    pod = fixture("admission_review_pod.json")["request"]["object"]
    world.deps.jobs.upsert(job)
    for _ in range(3):
        assert run(inject_pod(world.deps, pod, "ml-team")).result == "injected"
    assert world.api.called("get_policy") == ["llm-finetune"]
    assert world.api.called("get_job") == []


def test_recovery_reads_finished_pods_from_the_index_not_a_cluster_wide_list(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.runs["mnist-ddp-5f0c6a7e"] = [rec("pulse", 1200, created_at=1.0)]
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.deps.pods.upsert(_pod("mnist-ddp-worker-0", "mnist-ddp", phase="Failed"))
    run(recover_job(world.deps, job))
    assert ("ml-team", "mnist-ddp-r1") in world.api.jobs
    assert world.api.called("list_pods") == []


def test_recovery_lists_the_namespace_when_the_index_is_not_final(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.runs["mnist-ddp-5f0c6a7e"] = [rec("pulse", 1200, created_at=1.0)]
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.deps.pods.upsert(_pod("mnist-ddp-worker-0", "mnist-ddp", phase="Running"))
    world.api.add_pod(_pod("other-ns-pod", "mnist-ddp") | {})
    stranger = _pod("mnist-ddp-worker-0", "mnist-ddp", phase="Failed")
    stranger["metadata"]["namespace"] = "elsewhere"
    world.api.add_pod(stranger)
    run(recover_job(world.deps, job))
    assert world.api.called("list_pods") == [(None, f"{c.LABEL_TO_JOB_NAME}=mnist-ddp", "ml-team")]
    assert ("ml-team", "mnist-ddp-r1") in world.api.jobs


# --------------------------------------------------------------------------- labels


def test_pod_template_labels(fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    replicas = sorted(job["spec"]["pytorchReplicaSpecs"])
    assert unlabelled_replicas(job) == replicas
    patch = inject_label_patch(job)
    assert patch == {
        "spec": {
            "pytorchReplicaSpecs": {
                r: {"template": {"metadata": {"labels": {c.LABEL_INJECT: "true"}}}}
                for r in replicas
            }
        }
    }
    labelled = copy.deepcopy(job)
    assert label_templates_in_place(labelled)
    assert not label_templates_in_place(labelled)  # idempotent
    assert unlabelled_replicas(labelled) == [] and inject_label_patch(labelled) is None
    # the user's template labels are kept
    bare = {"spec": {"pytorchReplicaSpecs": {"Worker": {"template": {"spec": {}}}}}}
    assert label_templates_in_place(bare)
    assert bare["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"] == {
        "labels": {c.LABEL_INJECT: "true"}
    }


def test_only_opted_in_jobs_are_labelled(fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    other = copy.deepcopy(job)
    del other["metadata"]["annotations"][c.ANN_POLICY]
    job = apply_patch(job, label_job_ops(job))
    assert unlabelled_replicas(job) == []
    assert label_job_ops(other) == [] and unlabelled_replicas(other) != []


def test_the_watcher_labels_an_unlabelled_opted_in_job_once(world: Any, fixture: Any) -> None:
    job = world.api.add_job(fixture("pytorchjob_running.json"))
    expected = inject_label_patch(job)
    run(observe_job(world.deps, copy.deepcopy(job)))
    ((name, patch),) = world.api.called("patch_job")
    assert expected is not None and name == "mnist-ddp"
    assert patch["spec"] == expected["spec"]
    assert world.api.called("patch_job_annotations") == []  # one write, not two
    labelled = world.api.jobs[("ml-team", "mnist-ddp")]
    assert unlabelled_replicas(labelled) == []
    run(observe_job(world.deps, labelled))
    assert len(world.api.called("patch_job")) == 1
    # a failed job is not relabelled: its restart carries the label
    failed = world.api.add_job(fixture("pytorchjob_failed.json") | {})
    failed["metadata"]["name"] = "failed-one"
    world.api.add_job(failed)
    run(observe_job(world.deps, failed))
    assert len(world.api.called("patch_job")) == 1


# --------------------------------------------------------------------------- unprotected pods


def test_an_opted_in_pod_running_without_the_agent_is_reported_once(
    world: Any, fixture: Any
) -> None:
    world.api.add_job(fixture("pytorchjob_running.json"))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["metadata"]["uid"] = "uid-worker-0"
    assert run(report_unprotected(world.deps, pod))
    assert not run(report_unprotected(world.deps, pod))
    assert world.counter("ckpt_operator_unprotected_pods_total") == 1
    (event,) = [e for e in world.events.events if e.reason == "NotInjected"]
    assert event.type == "Warning" and "WITHOUT the checkpoint agent" in event.message
    # the quiet check counted no injection
    assert world.counter("ckpt_operator_injections_total", result="injected") == 0


def test_injected_skipped_and_unrelated_pods_are_not_reported(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    world.api.add_job(job)
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["metadata"]["uid"] = "uid-worker-0"
    injected = copy.deepcopy(pod)
    injected["metadata"].setdefault("annotations", {})[c.ANN_INJECTED] = c.INJECTION_VERSION
    unrelated = copy.deepcopy(pod)
    del unrelated["metadata"]["labels"][c.LABEL_INJECT]
    skipped = copy.deepcopy(pod)  # the webhook skips it on purpose (reported at admission)
    skipped["spec"]["containers"][0]["name"] = "trainer"
    for p in (injected, unrelated, skipped):
        assert not run(report_unprotected(world.deps, p))
    assert world.counter("ckpt_operator_unprotected_pods_total") == 0
    assert world.events.events == []


# --------------------------------------------------------------------------- executors


def test_api_calls_run_on_the_given_executor_with_a_timeout() -> None:
    seen: list[tuple[str, Any]] = []

    class Client:
        def __init__(self, *_: Any) -> None:
            pass

        def get_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            seen.append((threading.current_thread().name, kwargs.get("_request_timeout")))
            return {"metadata": {"name": args[-1]}}

    api = KubernetesApi(
        object(),
        executor=ThreadPoolExecutor(1, thread_name_prefix="reconcile"),
        timeout_s=7.0,
    )
    api._custom = Client()
    webhook = api.with_executor(ThreadPoolExecutor(1, thread_name_prefix="admit"), timeout_s=2.0)
    assert webhook._custom is not None
    webhook._custom = api._custom
    run(api.get_job("ns", "a"))
    run(webhook.get_job("ns", "b"))
    assert seen[0][0].startswith("reconcile") and seen[0][1] == 7.0
    assert seen[1][0].startswith("admit") and seen[1][1] == 2.0


def test_the_webhook_pool_is_separate_and_sized_by_flags() -> None:
    cfg = parse_config(
        ["--webhook=false", "--workers=5", "--webhook-workers=3", "--api-timeout=9"], environ={}
    )
    reconcile, webhook = executors(cfg)
    try:
        assert reconcile is not webhook
        assert reconcile._max_workers == 5 and webhook._max_workers == 3
        assert cfg.api_timeout_s == 9.0 and cfg.webhook.budget_s == 3.0
    finally:
        reconcile.shutdown()
        webhook.shutdown()
    env = {"CKPT_OPERATOR_WORKERS": "7", "CKPT_OPERATOR_WEBHOOK_BUDGET": "1.5"}
    cfg = parse_config(["--webhook=false"], environ=env)
    assert cfg.workers == 7 and cfg.webhook.budget_s == 1.5
    with pytest.raises(SystemExit):
        parse_config(["--webhook=false", "--workers=0"], environ={})


def test_the_pools_threads_are_all_started_before_any_work() -> None:
    cfg = parse_config(["--webhook=false", "--workers=5", "--webhook-workers=3"], environ={})
    reconcile, webhook = executors(cfg)
    try:
        assert len(reconcile._threads) == 0  # a pool starts its threads on demand
        start_threads(reconcile, cfg.workers)
        start_threads(webhook, cfg.webhook.workers)
        assert len(reconcile._threads) == 5 and len(webhook._threads) == 3
        assert all(t.is_alive() for t in reconcile._threads | webhook._threads)
        # the work after it finds them all started and idle: no new thread
        list(reconcile.map(lambda i: i, range(20)))
        assert len(reconcile._threads) == 5
    finally:
        reconcile.shutdown()
        webhook.shutdown()


def test_a_busy_reconciliation_pool_does_not_delay_admission(world: Any, fixture: Any) -> None:
    """Admission answered from the caches needs no thread at all, even with every
    reconciliation worker blocked."""
    reconcile = ThreadPoolExecutor(2)
    gate = threading.Event()
    for _ in range(4):
        reconcile.submit(gate.wait, 10)
    world.deps.jobs.upsert(fixture("pytorchjob_running.json"))
    world.deps.policies.upsert(world.api.policies[("ml-team", "llm-finetune")])
    pod = fixture("admission_review_pod.json")["request"]["object"]

    async def admit() -> str:
        asyncio.get_running_loop().set_default_executor(reconcile)
        try:
            out = await asyncio.wait_for(inject_pod(world.deps, pod, "ml-team"), 1.0)
        finally:
            gate.set()
        return out.result

    try:
        assert run(admit()) == "injected"
    finally:
        gate.set()
        reconcile.shutdown()


# --------------------------------------------------------------------------- backoff, memory


def test_status_times_keep_sub_second_precision() -> None:
    ts = 1714647737.25
    assert format_time(ts) == "2024-05-02T11:02:17Z"
    precise = format_time(ts, precise=True)
    assert precise == "2024-05-02T11:02:17.250Z"
    assert parse_time(precise) == ts


def test_finished_recoveries_leave_no_state_behind() -> None:
    async def main() -> tuple[int, int]:
        done = asyncio.Event()

        async def fetch(ns: str, name: str) -> dict[str, Any] | None:
            return {"metadata": {"namespace": ns, "name": name}}

        async def recover(job: dict[str, Any]) -> float | None:
            return None

        scheduler = RecoveryScheduler(fetch, recover)
        for i in range(50):
            scheduler.schedule("ns", f"job-{i}")
        peak = len(scheduler._tasks)
        for _ in range(100):
            if not scheduler._tasks:
                done.set()
                break
            await asyncio.sleep(0.01)
        await scheduler.stop()
        return peak, len(scheduler._tasks)

    assert run(main()) == (50, 0)


def test_a_restart_writes_the_reports_with_its_intent(world: Any, fixture: Any, rec: Any) -> None:
    """The pods' checkpoint reports ride on the intent write: two job PATCHes per restart
    (intent, outcome), not three."""
    world.source.unreachable = True
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    pod = report_pod(fixture, "mnist-ddp-worker-0", "mnist-ddp", message(reported(rec)))
    world.deps.pods.upsert(pod)
    run(recover_job(world.deps, copy.deepcopy(job)))
    assert world.api.called("create_job") == ["mnist-ddp-r1"]
    writes = [w[1] for w in world.api.called("patch_job_annotations")]
    assert [json.loads(w[c.ANN_STATUS])["state"] for w in writes] == ["Restarting", "Restarted"]
    assert c.ANN_LAST_VERIFIED in writes[0] and c.ANN_CHECKPOINTS in writes[0]
    assert world.api.called("list_pods") == []


def test_peering_elects_one_replica_by_random_priority() -> None:
    cfg = parse_config(["--peering", "--webhook=false"], environ={})
    assert not cfg.standalone
    one, two = (build_settings(cfg, Metrics()) for _ in range(2))
    assert one.peering.name == two.peering.name == c.PEERING_NAME
    assert one.peering.mandatory and one.peering.clusterwide
    assert one.peering.priority != two.peering.priority  # kopf pauses peers of equal priority
    alone = build_settings(parse_config(["--webhook=false"], environ={}), Metrics())
    assert parse_config(["--webhook=false"], environ={}).standalone
    assert alone.peering.priority == kopf.OperatorSettings().peering.priority
    with pytest.raises(SystemExit, match="cluster-wide"):
        parse_config(["--peering", "--webhook=false", "--namespace=a"], environ={})


def test_a_restart_is_born_watched_and_needs_no_bookkeeping_write(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.runs["mnist-ddp-5f0c6a7e"] = [rec("pulse", 1200, created_at=1.0)]
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    run(recover_job(world.deps, copy.deepcopy(job)))
    restart = world.api.jobs[("ml-team", "mnist-ddp-r1")]
    status = json.loads(restart["metadata"]["annotations"][c.ANN_STATUS])
    assert status["state"] == "Watching" and status["time"].endswith("Z")
    assert unlabelled_replicas(restart) == []
    writes = len(world.api.calls)
    world.deps.policies.upsert(world.api.policies[("ml-team", "llm-finetune")])
    run(observe_job(world.deps, copy.deepcopy(restart)))
    assert world.api.calls[writes:] == []
