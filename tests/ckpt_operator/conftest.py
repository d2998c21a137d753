"""Fixtures for the operator tests: recorded objects, a fake API server, a fake storage.

The recorded objects under ``fixtures/`` are what a real API server returns
(PyTorchJobs written by the Kubeflow training-operator v1.7, pods as the
training-operator creates them at admission time, nodes, a defaulted
CheckpointPolicy, AdmissionReview requests).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.format.listing import Listing, ListingLimits
from ckpt_agent.format.owner import RunOwner
from ckpt_agent.persist.housekeeping import GcResult
from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, checkpoint_id
from ckpt_operator.adapters.events import RecordedEvents
from ckpt_operator.adapters.kube import ApiError, ConflictError, NotFoundError
from ckpt_operator.adapters.metrics import Metrics
from ckpt_operator.adapters.sources import VerificationFailedError
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.kinds.registry import kind_of
from ckpt_operator.kinds.trainjob import TRAINJOB
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import OperatorConfig

FIXTURES = Path(__file__).parent / "fixtures"

#: 2024-05-02T11:02:17Z, the recorded job's failure time.
FAILED_AT = 1714647737.0


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture
def fixture() -> Callable[[str], dict[str, Any]]:
    """``fixture("pytorchjob_failed.json")`` → a fresh copy of a recorded object."""
    return load


def record(
    tier: str,
    step: int,
    *,
    status: CheckpointStatus = CheckpointStatus.VALID,
    created_at: float = 0.0,
    size: int = 1000,
    score: float = 0.1,
    manifest_hash: str = "",
    prev_hash: str | None = None,
    depends_on: tuple[str, ...] = (),
    anomaly: str | None = None,
) -> CheckpointRecord:
    return CheckpointRecord(
        id=checkpoint_id(Tier(tier), step),
        step=step,
        tier=Tier(tier),
        status=status,
        score=score,
        size_bytes=size,
        created_at=created_at,
        manifest_hash=manifest_hash,
        prev_hash=prev_hash,
        depends_on=depends_on,
        anomaly=anomaly,
    )


@pytest.fixture
def rec() -> Callable[..., CheckpointRecord]:
    return record


def _merge(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """RFC 7386 JSON merge patch, in place."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


def _patched(obj: dict[str, Any]) -> dict[str, Any]:
    """What a server answers a PATCH with: the object, its resourceVersion advanced."""
    meta = obj["metadata"]
    meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)
    return copy.deepcopy(obj)


class FakeApi:
    """An in-memory API server for the handful of calls the operator makes."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.trainjobs: dict[tuple[str, str], dict[str, Any]] = {}
        #: other custom objects by (plural, namespace or "", name): JobSets, runtimes
        self.custom: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.policies: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.config_maps: dict[tuple[str, str], dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.created_secrets: dict[tuple[str, str], dict[str, Any]] = {}
        """Secrets the operator created (bodies), by (namespace, name)."""
        self.forbid_secrets = False
        """Refuse every create_secret with 403 (an operator without the right)."""
        self.calls: list[tuple[str, Any]] = []
        self.fail_create: Exception | None = None
        self.fail_get_job: Exception | None = None

    def _store(self, kind: JobKind) -> dict[tuple[str, str], dict[str, Any]]:
        return self.trainjobs if kind is TRAINJOB else self.jobs

    def add_job(self, job: Mapping[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(dict(job))
        m = obj["metadata"]
        self._store(kind_of(obj))[(m["namespace"], m["name"])] = obj
        return obj

    def add_custom(self, plural: str, obj: Mapping[str, Any]) -> None:
        m = obj["metadata"]
        self.custom[(plural, m.get("namespace") or "", m["name"])] = copy.deepcopy(dict(obj))

    async def get_custom(
        self, group: str, version: str, plural: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        self.calls.append(("get_custom", (plural, name)))
        got = self.custom.get((plural, namespace or "", name))
        return copy.deepcopy(got) if got is not None else None

    def add_policy(self, policy: Mapping[str, Any]) -> None:
        m = policy["metadata"]
        self.policies[(m["namespace"], m["name"])] = copy.deepcopy(dict(policy))

    def add_pod(self, pod: Mapping[str, Any]) -> None:
        m = pod["metadata"]
        self.pods[(m["namespace"], m["name"])] = copy.deepcopy(dict(pod))

    async def get_job(
        self, namespace: str, name: str, *, kind: JobKind = PYTORCHJOB
    ) -> dict[str, Any] | None:
        self.calls.append(("get_job", name))
        if self.fail_get_job is not None:
            raise self.fail_get_job
        job = self._store(kind).get((namespace, name))
        return copy.deepcopy(job) if job is not None else None

    async def list_jobs(
        self, namespace: str, *, kind: JobKind = PYTORCHJOB
    ) -> list[dict[str, Any]]:
        self.calls.append(("list_jobs", namespace))
        store = self._store(kind)
        return [copy.deepcopy(j) for (ns, _), j in sorted(store.items()) if ns == namespace]

    async def create_job(
        self, namespace: str, body: dict[str, Any], *, kind: JobKind = PYTORCHJOB
    ) -> dict[str, Any]:
        self.calls.append(("create_job", body["metadata"]["name"]))
        if self.fail_create is not None:
            raise self.fail_create
        key = (namespace, body["metadata"]["name"])
        store = self._store(kind)
        if key in store:
            raise ConflictError(409, f"{kind.plural} {key[1]} already exists")
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = f"uid-{key[1]}"
        obj["metadata"]["creationTimestamp"] = "2024-05-02T11:02:30Z"
        store[key] = obj
        return copy.deepcopy(obj)

    async def patch_job_annotations(
        self,
        namespace: str,
        name: str,
        annotations: Mapping[str, str | None],
        *,
        kind: JobKind = PYTORCHJOB,
    ) -> dict[str, Any]:
        self.calls.append(("patch_job_annotations", (name, dict(annotations))))
        job = self._store(kind).get((namespace, name))
        if job is None:
            raise NotFoundError(404, f"pytorchjobs {name} not found")
        ann = job["metadata"].setdefault("annotations", {})
        for k, v in annotations.items():
            if v is None:
                ann.pop(k, None)
            else:
                ann[k] = v
        return _patched(job)

    async def patch_job(
        self, namespace: str, name: str, patch: dict[str, Any], *, kind: JobKind = PYTORCHJOB
    ) -> dict[str, Any]:
        self.calls.append(("patch_job", (name, copy.deepcopy(patch))))
        job = self._store(kind).get((namespace, name))
        if job is None:
            raise NotFoundError(404, f"pytorchjobs {name} not found")
        _merge(job, patch)
        return _patched(job)

    async def get_policy(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get_policy", name))
        p = self.policies.get((namespace, name))
        return copy.deepcopy(p) if p is not None else None

    async def patch_policy_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        *,
        resource_version: str | None = None,
    ) -> None:
        self.calls.append(("patch_policy_status", (name, status)))
        p = self.policies.get((namespace, name))
        if p is None:
            raise NotFoundError(404, name)
        meta = p.setdefault("metadata", {})
        if resource_version is not None and resource_version != meta.get("resourceVersion"):
            raise ConflictError(409, f"{name}: resourceVersion {resource_version} is stale")
        p.setdefault("status", {}).update(copy.deepcopy(status))
        meta["resourceVersion"] = str(int(meta.get("resourceVersion") or 0) + 1)

    async def apply_config_map(self, body: dict[str, Any]) -> None:
        self.calls.append(("apply_config_map", body["metadata"]["name"]))
        m = body["metadata"]
        self.config_maps[(m["namespace"], m["name"])] = copy.deepcopy(body)

    async def create_config_map(self, body: dict[str, Any]) -> bool:
        self.calls.append(("create_config_map", body["metadata"]["name"]))
        m = body["metadata"]
        if (m["namespace"], m["name"]) in self.config_maps:
            return False
        self.config_maps[(m["namespace"], m["name"])] = copy.deepcopy(body)
        return True

    async def get_node(self, name: str) -> dict[str, Any] | None:
        self.calls.append(("get_node", name))
        node = self.nodes.get(name)
        return copy.deepcopy(node) if node is not None else None

    async def list_pods(
        self, *, node_name: str | None, label_selector: str, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        self.calls.append(("list_pods", (node_name, label_selector, namespace)))
        key, _, value = label_selector.partition("=")
        out = []
        for (ns, _name), pod in self.pods.items():
            if namespace and ns != namespace:
                continue
            if node_name and pod.get("spec", {}).get("nodeName") != node_name:
                continue
            if pod["metadata"].get("labels", {}).get(key) != value:
                continue
            out.append(copy.deepcopy(pod))
        return out

    async def patch_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.calls.append(("patch_pod", (name, patch)))
        pod = self.pods[(namespace, name)]
        ann = pod["metadata"].setdefault("annotations", {})
        ann.update(patch["metadata"]["annotations"])

    async def get_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        return self.secrets.get((namespace, name))

    async def create_secret(self, body: dict[str, Any]) -> bool:
        m = body["metadata"]
        self.calls.append(("create_secret", m["name"]))
        if self.forbid_secrets:
            raise ApiError(403, f'secrets is forbidden: cannot create "{m["name"]}"')
        key = (m["namespace"], m["name"])
        if key in self.secrets or key in self.created_secrets:
            return False
        self.created_secrets[key] = copy.deepcopy(body)
        return True

    def called(self, name: str) -> list[Any]:
        return [arg for n, arg in self.calls if n == name]


@dataclass
class FakeSource:
    """A CheckpointSource over in-memory records."""

    runs: dict[str, list[CheckpointRecord]] = field(default_factory=dict)
    heartbeats: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)
    fail_delete: set[str] = field(default_factory=set)
    verified: list[str] = field(default_factory=list)
    deleted: list[tuple[str, str]] = field(default_factory=list)
    gc_runs: list[str] = field(default_factory=list)
    listed: list[tuple[str, bool]] = field(default_factory=list)
    unreachable: bool = False
    """Plays storage the operator cannot reach (a PVC mounted in the pods only)."""
    owners: dict[str, RunOwner] = field(default_factory=dict)
    """run id → owner record (``OWNER.json``)."""
    writer_namespace: str | None = "ml-team"
    """The namespace whose trainer created (and so claimed) every run with checkpoints that
    has no entry in ``owners`` (None: such runs are legacy: no owner record)."""

    def reachable(self) -> bool:
        return not self.unreachable

    def list_checkpoints(
        self, run_id: str, *, include_heartbeat: bool = True
    ) -> list[CheckpointRecord]:
        self.listed.append((run_id, include_heartbeat))
        return list(self.runs.get(run_id, []))

    def scan_checkpoints(self, run_id: str, limits: ListingLimits) -> Listing:
        return Listing(records=self.list_checkpoints(run_id, include_heartbeat=False))

    def progress(self, run_id: str) -> list[tuple[int, float]]:
        return list(self.heartbeats.get(run_id, []))

    def verify(self, run_id: str, checkpoint_id: str) -> bool:
        self.verified.append(checkpoint_id)
        if checkpoint_id in self.corrupt:
            raise VerificationFailedError(f"{checkpoint_id}: blob 3fa1… does not match its SHA-256")
        return True

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        from ckpt_agent.storage import StorageError

        if checkpoint_id in self.fail_delete:
            raise StorageError(f"permission denied deleting {checkpoint_id}")
        self.deleted.append((run_id, checkpoint_id))
        self.runs[run_id] = [r for r in self.runs.get(run_id, []) if r.id != checkpoint_id]

    def delete_checkpoints(self, run_id: str, checkpoint_ids: Sequence[str]) -> None:
        for ckpt in checkpoint_ids:  # the first failure stops the rest, as batched
            self.delete_checkpoint(run_id, ckpt)

    def collect_garbage(self, run_id: str) -> GcResult:
        self.gc_runs.append(run_id)
        return GcResult(deleted=["a" * 64, "b" * 64], freed_bytes=4096)

    def run_owner(self, run_id: str) -> RunOwner | None:
        if run_id not in self.owners and self.runs.get(run_id) and self.writer_namespace:
            return RunOwner(self.writer_namespace, claimed_by="agent")
        return self.owners.get(run_id)

    def close(self) -> None:
        pass


@dataclass
class Clock:
    now: float

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    api: FakeApi
    source: FakeSource
    events: RecordedEvents
    metrics: Metrics
    clock: Clock
    deps: Deps

    def counter(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if value is None else value


@pytest.fixture
def world() -> World:
    api = FakeApi()
    source = FakeSource()
    events = RecordedEvents()
    metrics = Metrics()
    clock = Clock(FAILED_AT + 3600)

    async def sources(namespace: str, policy: str, spec: CheckpointPolicySpec) -> FakeSource:
        return source

    deps = Deps(
        api=api,
        events=events,
        metrics=metrics,
        sources=sources,
        config=OperatorConfig(),
        clock=clock,
    )
    api.add_policy(load("checkpointpolicy.json"))
    return World(api, source, events, metrics, clock, deps)


RUN_ID = "mnist-ddp-5f0c6a7e"
__all__ = ["FAILED_AT", "RUN_ID", "c", "load", "record"]
