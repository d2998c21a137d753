"""The operator's per-event costs and memory at fleet scale (issue #19): kopf's diff base
only where change-detection handlers read it, one kept connection per calling thread and
a credential refresh every few seconds (not per call), lean cached bodies, webhook
answers built without copying the object."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import platform
from pathlib import Path
from typing import Any, cast

import kopf
import pytest
from kubernetes import client
from kubernetes.config import kube_config

from ckpt_operator.adapters.caches import ObjectCache, PodIndex, lean
from ckpt_operator.adapters.kube import KubernetesApi, NotFoundError, ThrottledRefresh
from ckpt_operator.adapters.metrics import Metrics
from ckpt_operator.app import loops
from ckpt_operator.app.handlers import (
    EVENT_ONLY_KINDS,
    MEMO_KEY,
    DiffBaseForChanges,
    make_runtime,
    on_job_event,
    on_pod_event,
    on_training_pod_event,
    register,
)
from ckpt_operator.app.loops import MemoryReturn
from ckpt_operator.app.main import build_settings, configure_logging
from ckpt_operator.behaviours.admission import inject_pod, label_job_ops
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import parse_config
from ckpt_operator.model.jobs import REPLICA_SPECS, label_templates_in_place
from ckpt_operator.model.jsonpatch import apply_patch
from tests.ckpt_operator.app.test_webhook_server import Post, decode_patch, job_review, serve

KINDS = {
    "pods": "Pod",
    "nodes": "Node",
    "pytorchjobs": c.PYTORCHJOB_KIND,
    "trainjobs": c.TRAINJOB_KIND,
    "jobsets": "JobSet",
    "checkpointpolicies": "CheckpointPolicy",
}


def _body(kind: str) -> kopf.Body:
    raw: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": kind,
        "metadata": {"name": "x", "namespace": "ns", "labels": {"a": "b"}, "annotations": {}},
        "spec": {"replicas": 1},
        "status": {"phase": "Running"},
    }
    return kopf.Body(cast(Any, raw))


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)


def _kind(handler: Any) -> str:
    return KINDS[str(handler.selector.any_name)]


def _storage() -> DiffBaseForChanges:
    return DiffBaseForChanges(prefix=c.KOPF_PREFIX, key="last-handled-configuration")


def test_no_diff_base_is_built_for_kinds_with_event_handlers_only() -> None:
    storage = _storage()
    for kind in EVENT_ONLY_KINDS:
        assert storage.build(body=_body(kind)) is None
        assert storage.fetch(body=_body(kind)) is None


def test_policies_keep_kopfs_diff_base() -> None:
    reference = kopf.AnnotationsDiffBaseStorage(
        prefix=c.KOPF_PREFIX, key="last-handled-configuration"
    )
    body = _body("CheckpointPolicy")
    essence = _storage().build(body=body)
    assert essence == reference.build(body=body)
    assert essence is not None and essence["spec"] == {"replicas": 1}


def test_only_event_only_kinds_lose_their_diff_base() -> None:
    """Every kind with a change-detection handler keeps its diff base (a create/update/
    resume handler on one of EVENT_ONLY_KINDS would never see a change)."""
    registry = register(kopf.OperatorRegistry())
    changing = {_kind(h) for h in registry._changing.get_all_handlers()}
    watching = {_kind(h) for h in registry._watching.get_all_handlers()}
    assert changing == {"CheckpointPolicy"}
    assert not changing & EVENT_ONLY_KINDS
    assert watching - changing <= EVENT_ONLY_KINDS


def test_the_operator_uses_it() -> None:
    settings = build_settings(parse_config(["--webhook=false"], environ={}), Metrics())
    assert isinstance(settings.persistence.diffbase_storage, DiffBaseForChanges)


# --------------------------------------------------------------------------- API client


def _kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(client.Configuration, "_default", None)  # restored afterwards


def test_the_client_keeps_a_connection_per_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below the threads that call at once, each extra call opened (TLS) and dropped a
    connection; the pool covers both executors."""
    _kubeconfig(tmp_path, monkeypatch)
    api = KubernetesApi.from_environment(connections=500)
    assert api._client.configuration.connection_pool_maxsize == 500
    assert api._client.rest_client.pool_manager.connection_pool_kw["maxsize"] == 500
    few = KubernetesApi.from_environment(connections=1)  # never below the client's default
    assert few._client.configuration.connection_pool_maxsize >= 1


class _Configuration:
    """What a loader's refresh hook touches: it sets the token and re-installs itself."""

    def __init__(self) -> None:
        self.refresh_api_key_hook: Any = None
        self.runs = 0

    def loader_hook(self, configuration: Any) -> None:
        self.runs += 1
        configuration.token = f"t{self.runs}"
        configuration.refresh_api_key_hook = self.loader_hook  # a fresh closure, as theirs


def test_the_credential_refresh_runs_once_per_interval_not_per_call() -> None:
    now = [100.0]
    cfg = _Configuration()
    cfg.refresh_api_key_hook = ThrottledRefresh(cfg.loader_hook, every_s=5.0, clock=lambda: now[0])
    for _ in range(50):
        cfg.refresh_api_key_hook(cfg)
    assert cfg.runs == 1 and isinstance(cfg.refresh_api_key_hook, ThrottledRefresh)
    now[0] += 4.9
    cfg.refresh_api_key_hook(cfg)
    assert cfg.runs == 1
    now[0] += 0.1
    cfg.refresh_api_key_hook(cfg)
    cfg.refresh_api_key_hook(cfg)
    assert cfg.runs == 2 and cfg.token == "t2"  # type: ignore[attr-defined]
    assert isinstance(cfg.refresh_api_key_hook, ThrottledRefresh)  # still in front


def test_the_clients_credentials_are_refreshed_through_the_throttle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _kubeconfig(tmp_path, monkeypatch)
    settings = KubernetesApi.from_environment()._client.configuration
    for _ in range(3):  # the kubeconfig loader's hook re-installs itself when it runs
        assert isinstance(settings.refresh_api_key_hook, ThrottledRefresh)
        assert settings.auth_settings()["BearerToken"]["value"] == "Bearer t"


@pytest.fixture
def restored_logging() -> Any:
    root, objects = logging.getLogger(), logging.getLogger("kopf.objects")
    saved = (root.level, list(root.handlers), objects.level)
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    objects.setLevel(saved[2])


@pytest.mark.usefixtures("restored_logging")
def test_kopfs_per_event_info_lines_are_dropped_unless_verbose() -> None:
    """kopf's "Handler '...' succeeded." at INFO for every watch event and admission."""
    objects = logging.getLogger("kopf.objects")
    configure_logging(parse_config(["--webhook=false"], {}))
    assert not objects.isEnabledFor(logging.INFO) and objects.isEnabledFor(logging.WARNING)
    assert logging.getLogger("ckpt_operator.adapters.events").isEnabledFor(
        logging.INFO
    )  # ours stay
    configure_logging(parse_config(["--webhook=false", "--verbose"], {}))
    assert objects.isEnabledFor(logging.DEBUG)


# --------------------------------------------------------------------------- caches


def test_cached_bodies_leave_out_managed_fields() -> None:
    managed = [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}]
    pod: dict[str, Any] = {
        "metadata": {
            "name": "j-master-0",
            "namespace": "ns",
            "labels": {c.LABEL_TO_JOB_NAME: "j"},
            "managedFields": managed,
        },
        "status": {"phase": "Failed"},
    }
    jobs, pods = ObjectCache(), PodIndex()
    jobs.upsert({**pod, "metadata": {**pod["metadata"], "name": "j"}})
    pods.upsert(pod)
    (cached_pod,) = pods.of_job("ns", "j")
    for body in (jobs.get("ns", "j"), cached_pod):
        assert body is not None and "managedFields" not in body["metadata"]
        assert body["status"] == {"phase": "Failed"}
        assert body["metadata"]["labels"] == {c.LABEL_TO_JOB_NAME: "j"}
    assert pod["metadata"]["managedFields"] is managed  # the watch's body is untouched
    assert lean({"kind": "Pod"}) == {"kind": "Pod"}


# --------------------------------------------------------------------------- admission


def test_the_pod_webhook_answers_with_the_injection_ops_as_built(
    world: Any, fixture: Any, tmp_path: Path
) -> None:
    """kopf's real admission path: the answer is inject_pod's own ops (no copy-and-diff of
    the pod), and they give the pod inject_pod means."""
    world.api.add_job(fixture("pytorchjob_running.json"))
    review = fixture("admission_review_pod.json")
    pod = copy.deepcopy(review["request"]["object"])
    expected = asyncio.run(inject_pod(world.deps, copy.deepcopy(pod), "ml-team", dryrun=True))

    async def body(post: Post, url: str) -> None:
        status, answer = await post(c.WEBHOOK_INJECT_ID, review)
        assert status == 200 and answer["response"]["allowed"] is True
        ops = decode_patch(answer["response"])
        assert ops == json.loads(json.dumps(expected.ops))
        assert apply_patch(pod, ops) == apply_patch(pod, expected.ops)

    serve(world, tmp_path, body)


def _job_shapes(fixture: Any) -> list[dict[str, Any]]:
    """An opted-in job whose replicas' templates have every shape the labelling meets."""
    job: dict[str, Any] = fixture("pytorchjob_running.json")
    spec = job["spec"][REPLICA_SPECS]["Master"]
    labels = {"app": "x", c.LABEL_INJECT: "false"}
    job["spec"][REPLICA_SPECS] = {
        "Master": spec,
        "NoTemplate": {"replicas": 1},
        "NullTemplate": {"template": None},
        "NoMetadata": {"template": {"spec": {}}},
        "NullMetadata": {"template": {"metadata": None}},
        "NoLabels": {"template": {"metadata": {"name": "w"}}},
        "NullLabels": {"template": {"metadata": {"labels": None}}},
        "WrongLabel": {"template": {"metadata": {"labels": labels}}},
        "Labelled": {"template": {"metadata": {"labels": {c.LABEL_INJECT: "true"}}}},
        "a/b~c": {"template": {"metadata": {"labels": {}}}},
        "NotAMap": "x",
    }
    plain = copy.deepcopy(job)
    del plain["metadata"]["annotations"][c.ANN_POLICY]
    no_specs = copy.deepcopy(job)
    del no_specs["spec"][REPLICA_SPECS]
    return [job, plain, no_specs, fixture("pytorchjob_running.json")]


def _template_labels(job: dict[str, Any]) -> dict[str, Any]:
    """Replica type → its template's labels, where the template and its metadata are maps."""
    out = {}
    for rtype, rspec in job["spec"].get(REPLICA_SPECS, {}).items():
        template = rspec.get("template") if isinstance(rspec, dict) else None
        meta = template.get("metadata") if isinstance(template, dict) else None
        if isinstance(meta, dict):
            out[rtype] = meta.get("labels")
    return out


def test_label_job_ops_label_every_template_and_keep_the_rest(fixture: Any) -> None:
    job, plain, no_specs, other = _job_shapes(fixture)
    ops = label_job_ops(job)
    assert len(ops) == 7  # one per template without the label, none for the others
    done = apply_patch(job, ops)
    labels = _template_labels(done)
    untouchable = {"NullTemplate", "NullMetadata", "NotAMap"}  # not maps: left as they are
    assert set(labels) == set(job["spec"][REPLICA_SPECS]) - untouchable
    assert all(v[c.LABEL_INJECT] == "true" for v in labels.values())
    assert labels["WrongLabel"]["app"] == "x"  # other labels kept
    assert done["spec"][REPLICA_SPECS]["NoMetadata"]["template"]["spec"] == {}
    assert done["spec"][REPLICA_SPECS]["NullTemplate"] == {"template": None}
    assert label_job_ops(done) == []
    # the in-place labelling (restarts) does the same
    in_place = copy.deepcopy(job)
    assert label_templates_in_place(in_place) and in_place == done
    assert label_job_ops(plain) == [] and label_job_ops(no_specs) == []  # not opted in / none
    once = apply_patch(other, label_job_ops(other))
    assert label_job_ops(once) == [] and all(
        v[c.LABEL_INJECT] == "true" for v in _template_labels(once).values()
    )


def test_the_job_webhooks_answer_without_copying_the_job(
    world: Any, fixture: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kopf deep-copied the job on every call (and diffed the copies for the label)."""
    copies: list[Any] = []
    deepcopy = copy.deepcopy

    def counted(obj: Any, memo: Any = None) -> Any:
        if isinstance(obj, dict) and obj.get("kind") == c.PYTORCHJOB_KIND:
            copies.append(obj)
        return deepcopy(obj, memo)

    job = _job_shapes(fixture)[0]
    bad = copy.deepcopy(job)
    bad["metadata"]["annotations"][c.ANN_RESUME_STEP] = "latest"
    review = job_review(job)

    async def body(post: Post, url: str) -> None:
        monkeypatch.setattr(copy, "deepcopy", counted)
        _, labelled = await post(c.WEBHOOK_LABEL_JOB_ID, review)
        _, valid = await post(c.WEBHOOK_VALIDATE_JOB_ID, review)
        review["request"]["object"] = bad
        _, invalid = await post(c.WEBHOOK_VALIDATE_JOB_ID, review)
        monkeypatch.undo()
        assert copies == []
        assert labelled["response"]["allowed"] is True
        assert decode_patch(labelled["response"]) == json.loads(json.dumps(label_job_ops(job)))
        assert valid["response"]["allowed"] is True and "patch" not in valid["response"]
        assert invalid["response"]["allowed"] is False
        assert c.ANN_RESUME_STEP in invalid["response"]["status"]["message"]

    serve(world, tmp_path, body)


# --------------------------------------------------------------------------- memory


def test_deletions_give_memory_back_once_per_wave() -> None:
    trims: list[int] = []

    async def main() -> MemoryReturn:
        memory = MemoryReturn(delay_s=0.01, trim=lambda: trims.append(1))
        for _ in range(50):  # a wave of deletions: one trim after it
            memory.evicted()
        await asyncio.sleep(0.05)
        memory.evicted()  # the next wave: another
        await asyncio.sleep(0.05)
        memory.evicted()
        memory.stop()  # the operator stops: nothing left pending
        await asyncio.sleep(0.05)
        return memory

    memory = run_async(main())
    assert len(trims) == 2 and memory.trims == 2


def test_without_glibc_nothing_is_scheduled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loops, "malloc_trim", lambda: None)

    async def main() -> MemoryReturn:
        memory = MemoryReturn(delay_s=0.0)
        memory.evicted()
        await asyncio.sleep(0.01)
        return memory

    assert run_async(main()).trims == 0


def test_deleted_jobs_and_pods_empty_the_caches_and_return_memory(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    world.api.add_job(job)
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "mnist-ddp-worker-0",
            "namespace": "ml-team",
            "uid": "u1",
            "labels": {c.LABEL_TO_JOB_NAME: "mnist-ddp"},
        },
        "status": {"phase": "Running"},
    }
    trims: list[int] = []

    async def main() -> tuple[int, int, int, int]:
        runtime = make_runtime(world.deps)
        runtime.memory = MemoryReturn(delay_s=0.01, trim=lambda: trims.append(1))
        memo = kopf.Memo({MEMO_KEY: runtime})
        await on_job_event(type=None, body=kopf.Body(job), memo=memo)
        await on_training_pod_event(type=None, body=kopf.Body(cast(Any, pod)), memo=memo)
        full = len(world.deps.jobs) + len(world.deps.pods)
        await asyncio.sleep(0.05)
        before = len(trims)  # nothing deleted yet: nothing trimmed
        await on_training_pod_event(type="DELETED", body=kopf.Body(cast(Any, pod)), memo=memo)
        await on_job_event(type="DELETED", body=kopf.Body(job), memo=memo)
        await asyncio.sleep(0.05)
        await runtime.recovery.stop()
        return full, before, len(world.deps.jobs) + len(world.deps.pods), len(trims)

    assert run_async(main()) == (2, 0, 0, 1)


def test_cached_bodies_are_packed_and_read_as_fresh_copies() -> None:
    job = {
        "metadata": {"namespace": "ns", "name": "j", "resourceVersion": "3", "labels": {"a": "b"}},
        "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1}}},
    }
    pod = {"metadata": {"namespace": "ns", "name": "p", "labels": {c.LABEL_TO_JOB_NAME: "j"}}}
    jobs, pods = ObjectCache(), PodIndex()
    jobs.upsert(job)
    pods.upsert(pod)
    assert isinstance(jobs._items[("ns", "j")][1], bytes)
    assert isinstance(pods._by_job[("ns", "j")]["p"], bytes)
    first = jobs.get("ns", "j")
    assert first == job and first is not job
    assert first is not None
    first["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 9  # a caller's copy only
    assert jobs.get("ns", "j") == job
    assert pods.of_job("ns", "j") == [pod]
    odd = {"metadata": {"namespace": "ns", "name": "k"}, "spec": {"when": object()}}
    jobs.upsert(odd)  # not JSON types: kept as it is
    assert jobs.get("ns", "k") == odd


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibcs_malloc_trim_is_found() -> None:
    trim = loops.malloc_trim()
    assert trim is not None
    trim()


def test_a_pod_gone_before_its_save_now_request_is_no_error(world: Any, fixture: Any) -> None:
    """A deletion wave: the pod's deletion event arrives after the pod is gone (404)."""
    calls: list[str] = []

    async def gone(namespace: str, name: str, patch: Any) -> None:
        calls.append(name)
        raise NotFoundError(404, f'pods "{name}" not found')

    world.deps.api.patch_pod = gone
    memo = kopf.Memo({MEMO_KEY: make_runtime(world.deps)})
    body = kopf.Body(fixture("pod_terminating.json"))
    run_async(on_pod_event(type="MODIFIED", body=body, memo=memo))
    assert calls  # it was asked, and the 404 ended it quietly
