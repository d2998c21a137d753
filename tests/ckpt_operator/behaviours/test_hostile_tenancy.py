"""Issue #17, tried as an attacker would: one tenant's policy or job aimed at another's runs,
at the operator's own identity, at an endpoint of the attacker's choosing, and malformed
annotations. Real local storage, a real HTTP server on 127.0.0.1 standing in for the
attacker's endpoint, the operator's behaviour functions over the fake API server."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.layout import validation_key
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.owner import RunOwner, claim_owner, owner_key, read_owner
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy import CheckpointPolicySpec
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage.fs import LocalStorage
from ckpt_operator.adapters.sources import (
    StorageCheckpointSource,
    StorageSourceFactory,
    StorageTimeoutError,
)
from ckpt_operator.behaviours.admission import inject_pod, validate_job
from ckpt_operator.behaviours.agentcheck import check_agents
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.behaviours.guard import storage_call
from ckpt_operator.behaviours.policies import reconcile_policy
from ckpt_operator.behaviours.recovery import recover_job
from ckpt_operator.behaviours.retention import reconcile_retention
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import (
    IdentityGrant,
    LocalPathGrant,
    OperatorConfig,
    TenancyConfig,
    parse_config,
    parse_tenancy,
)
from ckpt_operator.model.jobs import job_facts, parse_time
from ckpt_operator.model.jsonpatch import apply_patch
from ckpt_operator.planners.tenancy import (
    MAX_ERROR_CHARS,
    endpoint_allowed,
    path_under,
    storage_refusal,
    summarize_error,
)
from ckpt_operator.planners.validation import annotation_errors

RUN_B = "llm-pretrain-b"
TEAM_A, TEAM_B = "ml-team", "team-b"  # ml-team: the recorded job's and policy's namespace
CKPTS = ["full_step_000000000100", "pulse_step_000000000200", "pulse_step_000000000300"]


# --------------------------------------------------------------------------- setup


def _checkpoints(storage: LocalStorage, run_id: str) -> None:
    """Three validated checkpoints (full 100, pulse 200, pulse 300) of ``run_id``."""
    writer = CheckpointWriter(storage, run_id, codec=CodecPolicy(codec="none"), inline_max_bytes=0)
    prev: str | None = None
    for step, tier in ((100, Tier.FULL), (200, Tier.PULSE), (300, Tier.PULSE)):
        meta = CheckpointMeta(
            run_id=run_id, step=step, tier=tier, created_at=1000.0, prev_hash=prev
        )
        data = memoryview(step.to_bytes(8, "little"))
        rank = writer.write_rank(meta, 0, {"step": step}, [TensorSource("w", "uint8", (8,), data)])
        prev = writer.commit(meta, [rank]).manifest_hash
        verdict = ValidationVerdict(meta.checkpoint_id, prev, CheckpointStatus.VALID)
        storage.commit(validation_key(run_id, meta.checkpoint_id), verdict.to_bytes())


def _ids(root: Path, run_id: str) -> list[str]:
    src = StorageCheckpointSource(LocalStorage(root))
    return [r.id for r in src.list_checkpoints(run_id, include_heartbeat=False)]


def _policy(fixture: Any, namespace: str, storage: dict[str, Any]) -> dict[str, Any]:
    policy: dict[str, Any] = fixture("checkpointpolicy.json")
    policy["metadata"]["namespace"] = namespace
    policy["spec"]["storage"] = storage
    return policy


def _local(root: Path) -> dict[str, Any]:
    return {"type": "local", "local": {"path": str(root)}}


def _job(fixture: Any, namespace: str, run_id: str) -> dict[str, Any]:
    job: dict[str, Any] = fixture("pytorchjob_failed.json")
    job["metadata"]["namespace"] = namespace
    job["metadata"]["annotations"][c.ANN_RUN_ID] = run_id
    return job


def _deps(world: Any, tenancy: TenancyConfig, timeout_s: float = 30.0) -> Deps:
    factory = StorageSourceFactory(
        world.api.get_secret_data, gc_grace_s=0.0, tenancy=tenancy, timeout_s=timeout_s
    )
    config = OperatorConfig(storage_timeout_s=timeout_s, tenancy=tenancy)
    return Deps(
        api=world.api,
        events=world.events,
        metrics=world.metrics,
        sources=factory,
        config=config,
        clock=world.clock,
    )


def _condition(world: Any, namespace: str, name: str = "llm-finetune") -> dict[str, Any]:
    status = world.api.policies[(namespace, name)]["status"]
    (cond,) = [x for x in status["conditions"] if x["type"] == "Reconciled"]
    return dict(cond)


def _events(world: Any, reason: str) -> list[Any]:
    return [e for e in world.events.events if e.reason == reason]


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """One storage root both namespaces' policies name; team B's run in it, owned by B."""
    root = tmp_path / "shared"
    storage = LocalStorage(root)
    _checkpoints(storage, RUN_B)
    claim_owner(storage, RUN_B, RunOwner(TEAM_B, "pretrain", "uid-b", "agent", 1.0))
    return root


def _everyone(root: Path) -> TenancyConfig:
    return TenancyConfig(local_paths=(LocalPathGrant("*", str(root)),))


# --------------------------------------------------------------------------- ownership


def test_retention_in_another_namespace_deletes_nothing_and_copies_nothing(
    world: Any, fixture: Any, shared: Path
) -> None:
    deps = _deps(world, _everyone(shared))
    policy_a = _policy(fixture, TEAM_A, _local(shared))
    world.api.add_policy(policy_a)
    world.api.add_job(_job(fixture, TEAM_A, RUN_B))  # A's job claims B's run

    status = asyncio.run(reconcile_retention(deps, policy_a))

    assert _ids(shared, RUN_B) == CKPTS  # nothing of B's deleted
    assert status is not None
    assert "step_0000000" not in json.dumps(status)  # none of B's checkpoints reported to A
    cond = _condition(world, TEAM_A)
    assert cond["status"] == "False" and cond["reason"] == "StorageErrors"
    assert f"run {RUN_B} belongs to namespace {TEAM_B}" in cond["message"]
    (event,) = _events(world, "RunOwnedElsewhere")
    assert event.type == "Warning" and TEAM_B in event.message

    # control: the same policy in B's own namespace applies retention to the run
    policy_b = _policy(fixture, TEAM_B, _local(shared))
    world.api.add_policy(policy_b)
    world.api.add_job(_job(fixture, TEAM_B, RUN_B))
    asyncio.run(reconcile_retention(deps, policy_b))
    assert len(_ids(shared, RUN_B)) < len(CKPTS)


def test_recovery_never_restarts_from_another_namespaces_run(
    world: Any, fixture: Any, shared: Path
) -> None:
    deps = _deps(world, _everyone(shared))
    world.api.add_policy(_policy(fixture, TEAM_A, _local(shared)))
    job = world.api.add_job(_job(fixture, TEAM_A, RUN_B))

    assert asyncio.run(recover_job(deps, job)) is None

    assert world.api.called("create_job") == []
    facts = job_facts(world.api.jobs[(TEAM_A, "mnist-ddp")])
    assert facts.status is not None and facts.status.state == "GaveUp"
    assert facts.status.reason == "RunOwnedElsewhere" and TEAM_B in facts.status.message
    (event,) = _events(world, "GaveUp")
    assert event.type == "Warning" and event.message.startswith("RunOwnedElsewhere")
    assert _ids(shared, RUN_B) == CKPTS
    assert read_owner(LocalStorage(shared), RUN_B) == RunOwner(
        TEAM_B, "pretrain", "uid-b", "agent", 1.0
    )
    # terminal: the job is handled, a second look does nothing
    again = world.api.jobs[(TEAM_A, "mnist-ddp")]
    assert asyncio.run(recover_job(deps, again)) is None and len(_events(world, "GaveUp")) == 1


# a legacy run (no OWNER.json): claimed by nobody but `ckpt claim` (issue #28):
# test_resolved_grants.py::test_a_legacy_run_is_claimed_by_nobody_but_an_administrator


def test_the_agent_check_never_reads_another_namespaces_run(
    world: Any, fixture: Any, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod of A naming B's run: B's heartbeats and checkpoints are not read (their times
    would decide A's AgentMissing verdict); the pod is left to its own owner check."""
    read: list[str] = []

    def recording(real: Any) -> Any:
        def spy(self: Any, run_id: str, *args: Any, **kwargs: Any) -> Any:
            read.append(run_id)
            return real(self, run_id, *args, **kwargs)

        return spy

    for method in ("progress", "list_checkpoints"):
        real = getattr(StorageCheckpointSource, method)
        monkeypatch.setattr(StorageCheckpointSource, method, recording(real))
    deps = _deps(world, _everyone(shared))
    started = "2024-05-02T10:00:00Z"
    world.clock.now = (parse_time(started) or 0.0) + 3600
    for namespace in (TEAM_A, TEAM_B):
        world.api.add_policy(_policy(fixture, namespace, _local(shared)))
        world.api.add_job(_job(fixture, namespace, RUN_B))
        pod = fixture("admission_review_pod.json")["request"]["object"]
        pod["metadata"]["namespace"] = namespace
        pod["metadata"].setdefault("annotations", {}).update(
            {c.ANN_POLICY: "llm-finetune", c.ANN_RUN_ID: RUN_B}
        )
        pod["metadata"].setdefault("labels", {})[c.LABEL_INJECTED] = "true"
        pod["status"] = {"phase": "Running", "startTime": started}
        world.api.add_pod(pod)

    assert asyncio.run(check_agents(deps, world.api.policies[(TEAM_A, "llm-finetune")])) == []
    assert read == [] and _events(world, "AgentMissing") == []
    assert read_owner(LocalStorage(shared), RUN_B).namespace == TEAM_B  # type: ignore[union-attr]

    # control: B's own check reads its run (whose checkpoints predate the pod: silent)
    flagged = asyncio.run(check_agents(deps, world.api.policies[(TEAM_B, "llm-finetune")]))
    assert len(flagged) == 1 and set(read) == {RUN_B}


def test_owner_record_is_written_once(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    first = claim_owner(storage, "run-1", RunOwner("a", "j", "u", "agent", 1.0))
    assert claim_owner(storage, "run-1", RunOwner("b")) == first == read_owner(storage, "run-1")
    assert read_owner(storage, "run-2") is None
    storage.commit(owner_key("run-3"), b"<html>not json</html>")
    with pytest.raises(CheckpointFormatError):
        read_owner(storage, "run-3")
    storage.commit(owner_key("run-4"), json.dumps({"namespace": ""}).encode())
    with pytest.raises(CheckpointFormatError):
        claim_owner(storage, "run-4", RunOwner("a"))


# --------------------------------------------------------------------------- local paths


def test_a_local_path_not_granted_to_the_namespace_is_never_opened(
    world: Any, fixture: Any, shared: Path
) -> None:
    """Not granted: the operator treats the path as storage it cannot reach (a PVC of the
    pods): status and planning from the namespace's own pods' reports, never from the
    folder itself."""
    deps = _deps(world, TenancyConfig(local_paths=(LocalPathGrant(TEAM_B, str(shared)),)))
    before = sorted(p.relative_to(shared) for p in shared.rglob("*"))
    # ".." cannot walk out of a grant either
    sneaky = {"type": "local", "local": {"path": str(shared / TEAM_B / ".." / "..")}}
    for storage in (_local(shared), sneaky):
        policy = _policy(fixture, TEAM_A, storage)
        world.api.add_policy(policy)
        world.api.add_job(_job(fixture, TEAM_A, RUN_B))
        status = asyncio.run(reconcile_retention(deps, policy))
        assert status is not None and "step_0000000" not in json.dumps(status)
        assert _condition(world, TEAM_A)["reason"] != "RetentionApplied"
    job = world.api.jobs[(TEAM_A, "mnist-ddp")]
    asyncio.run(recover_job(deps, job))
    for created in world.api.jobs.values():  # no restart resumes from one of B's checkpoints
        assert created["metadata"]["annotations"].get(c.ANN_RESUME_FROM) not in CKPTS
    assert sorted(p.relative_to(shared) for p in shared.rglob("*")) == before
    assert _ids(shared, RUN_B) == CKPTS


# --------------------------------------------------------------------------- S3: identity, SSRF


class _Recorder(BaseHTTPRequestHandler):
    requests: ClassVar[list[tuple[str, str, dict[str, str]]]] = []
    body: ClassVar[bytes] = b""

    def _answer(self) -> None:
        self.requests.append((self.command, self.path, dict(self.headers)))
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def do_GET(self) -> None:
        self._answer()

    def do_HEAD(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def attacker() -> Iterator[tuple[str, list[tuple[str, str, dict[str, str]]]]]:
    """An HTTP server on 127.0.0.1 that records every request and answers 403 with a body
    full of control characters and a marker that must never reach a status."""

    class Handler(_Recorder):
        requests: ClassVar[list[tuple[str, str, dict[str, str]]]] = []

    handler = Handler
    handler.body = (
        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code><Message>"
        b"denied\x1b[2J\x07"
        + b"A" * 5000
        + b"</Message><Secret>BODY-MARKER\nline2</Secret></Error>"
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    server.shutdown()
    server.server_close()


def _s3(endpoint: str, secret: bool) -> dict[str, Any]:
    s3: dict[str, Any] = {"bucket": "team-b-ckpt", "prefix": "runs", "endpoint": endpoint}
    if secret:
        s3["credentialsSecret"] = {"name": "tenant-s3"}
    return {"type": "s3", "s3": s3}


@pytest.fixture
def operator_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's own credentials, as IRSA/env would give it."""
    for var, value in {
        "CKPT_S3_ACCESS_KEY_ID": "OPERATORKEYID",
        "CKPT_S3_SECRET_ACCESS_KEY": "operator-secret",
        "CKPT_S3_SESSION_TOKEN": "OPERATOR-SESSION-TOKEN",
        "AWS_ACCESS_KEY_ID": "OPERATORKEYID",
        "AWS_SECRET_ACCESS_KEY": "operator-secret",
        "AWS_SESSION_TOKEN": "OPERATOR-SESSION-TOKEN",
    }.items():
        monkeypatch.setenv(var, value)


@pytest.mark.parametrize(
    ("secret", "tenancy_of"),
    [
        # no Secret, endpoint allowed, identity not granted: never borrows the operator's keys
        (False, lambda url: TenancyConfig(allowed_s3_endpoints=(url,))),
        # the tenant's own Secret, endpoint not allowed: server-side request forgery
        (True, lambda url: TenancyConfig()),
        # identity granted for the bucket, but the endpoint is the attacker's
        (False, lambda url: TenancyConfig(operator_identity=(IdentityGrant("*", "team-b-ckpt"),))),
    ],
    ids=["identity-not-granted", "endpoint-not-allowed", "granted-but-foreign-endpoint"],
)
def test_no_request_reaches_an_endpoint_the_administrator_did_not_allow(
    world: Any,
    fixture: Any,
    attacker: tuple[str, list[Any]],
    operator_identity: None,
    secret: bool,
    tenancy_of: Any,
) -> None:
    url, requests = attacker
    world.api.secrets[(TEAM_A, "tenant-s3")] = {
        "AWS_ACCESS_KEY_ID": "TENANTKEYID",
        "AWS_SECRET_ACCESS_KEY": "tenant-secret",
    }
    deps = _deps(world, tenancy_of(url))
    policy = _policy(fixture, TEAM_A, _s3(url, secret))
    world.api.add_policy(policy)
    job = world.api.add_job(_job(fixture, TEAM_A, RUN_B))

    asyncio.run(reconcile_policy(deps, policy))
    asyncio.run(reconcile_retention(deps, policy))
    asyncio.run(recover_job(deps, job))

    assert requests == []
    conditions = world.api.policies[(TEAM_A, "llm-finetune")]["status"]["conditions"]
    (access,) = [x for x in conditions if x["type"] == "StorageAccess"]
    assert access["status"] == "False" and access["reason"] == "StorageAccessDenied"
    cond = _condition(world, TEAM_A)
    assert cond["status"] == "False" and cond["reason"] == "StorageAccessDenied"
    status = job_facts(world.api.jobs[(TEAM_A, "mnist-ddp")]).status
    assert status is not None and (status.state, status.reason) == ("GaveUp", "StorageAccessDenied")
    assert world.api.called("create_job") == []


def test_an_allowed_endpoint_gets_the_tenants_keys_and_its_answer_is_summarized(
    world: Any, fixture: Any, attacker: tuple[str, list[Any]], operator_identity: None
) -> None:
    url, requests = attacker
    world.api.secrets[(TEAM_A, "tenant-s3")] = {
        "AWS_ACCESS_KEY_ID": "TENANTKEYID",
        "AWS_SECRET_ACCESS_KEY": "tenant-secret",
    }
    deps = _deps(world, TenancyConfig(allowed_s3_endpoints=(url,)))
    policy = _policy(fixture, TEAM_A, _s3(url, secret=True))
    world.api.add_policy(policy)
    world.api.add_job(_job(fixture, TEAM_A, RUN_B))

    asyncio.run(reconcile_retention(deps, policy))

    assert requests  # control: this endpoint is allowed, so the operator did talk to it
    for _, _, headers in requests:
        sent = json.dumps(headers)
        assert "TENANTKEYID" in sent
        assert "OPERATORKEYID" not in sent and "OPERATOR-SESSION-TOKEN" not in sent
    cond = _condition(world, TEAM_A)
    assert cond["reason"] == "StorageErrors"
    message = cond["message"]
    assert "BODY-MARKER" not in message and "\n" not in message and "\x1b" not in message
    assert len(message) < 2 * MAX_ERROR_CHARS
    (event,) = _events(world, "RetentionErrors")
    assert "BODY-MARKER" not in event.message and "\x1b" not in event.message


def test_storage_refusal_rules() -> None:
    def spec(storage: dict[str, Any]) -> CheckpointPolicySpec:
        return CheckpointPolicySpec.model_validate({"storage": storage})

    grant = TenancyConfig(
        operator_identity=(IdentityGrant("a", "bkt", "team-a"),),
        local_paths=(LocalPathGrant("a", "/mnt/a"), LocalPathGrant("*", "/mnt/shared")),
        allowed_s3_endpoints=("https://minio.storage:9000", "http://127.0.0.1:*"),
    )
    s3: dict[str, Any] = {"type": "s3", "s3": {"bucket": "bkt", "prefix": "team-a/x"}}
    assert storage_refusal("a", spec(s3), grant, operator_identity=True) is None
    assert storage_refusal("b", spec(s3), grant, operator_identity=True) is not None
    other = copy.deepcopy(s3)
    other["s3"]["prefix"] = "team-ab"
    assert storage_refusal("a", spec(other), grant, operator_identity=True) is not None
    assert storage_refusal("b", spec(other), grant, operator_identity=False) is None
    assert (
        storage_refusal("a", spec(_local(Path("/mnt/a/x"))), grant, operator_identity=True) is None
    )
    assert storage_refusal("b", spec(_local(Path("/mnt/a"))), grant, operator_identity=True)
    assert (
        storage_refusal("b", spec(_local(Path("/mnt/shared/b"))), grant, operator_identity=True)
        is None
    )
    assert storage_refusal("a", spec(_local(Path("/mnt/ab"))), grant, operator_identity=True)

    allowed = grant.allowed_s3_endpoints
    assert endpoint_allowed("https://minio.storage:9000/", allowed)
    assert endpoint_allowed("https://MINIO.storage:9000", allowed)
    assert endpoint_allowed("http://127.0.0.1:4567", allowed)
    for bad in (
        "http://minio.storage:9000",  # scheme differs
        "https://minio.storage",  # port differs (443)
        "https://minio.storage:9000/path",
        "https://user:pw@minio.storage:9000",
        "http://169.254.169.254",
        "http://127.0.0.1:*",
        "file:///etc/passwd",
        "not a url",
    ):
        assert not endpoint_allowed(bad, allowed), bad
    assert path_under("/mnt/a/../a/b", "/mnt/a") and not path_under("/mnt/a/../b", "/mnt/a")
    assert not path_under("relative", "/") and path_under("/x", "/")


def test_error_summaries_are_one_bounded_clean_line() -> None:
    line = summarize_error(OSError("first\x1b[31m line\x00\nsecond line <body>" + "x" * 900))
    assert line == "OSError: first\\x1b[31m line\\x00"  # escaped visibly, body dropped
    long = summarize_error(ValueError("y" * 1000))
    assert len(long) <= MAX_ERROR_CHARS and long.endswith("more characters)")
    assert summarize_error(RuntimeError("")) == "RuntimeError: no details"


def test_tenancy_config_from_flags_and_env() -> None:
    text = json.dumps(
        {
            "operatorIdentity": [{"namespace": "a", "bucket": "bkt", "prefix": "/p/"}],
            "localPaths": [{"namespace": "*", "path": "/mnt"}],
            "allowedS3Endpoints": ["https://minio:9000"],
        }
    )
    want = TenancyConfig(
        (IdentityGrant("a", "bkt", "p"),), (LocalPathGrant("*", "/mnt"),), ("https://minio:9000",)
    )
    assert parse_tenancy(text) == want
    env = {"CKPT_OPERATOR_TENANCY": text, "CKPT_OPERATOR_STORAGE_TIMEOUT": "5"}
    cfg = parse_config(["--webhook=false"], environ=env)
    assert cfg.tenancy == want and cfg.storage_timeout_s == 5.0
    assert parse_config(["--webhook=false"], environ={}).tenancy == TenancyConfig()
    for bad in (
        "[]",
        "{",
        '{"localPaths": [{"namespace": "a", "path": "rel"}]}',
        '{"operatorIdentity": [{"namespace": "a"}]}',
        '{"allowedS3Endpoints": "x"}',
    ):
        with pytest.raises(SystemExit, match="tenancy"):
            parse_tenancy(bad)
    with pytest.raises(SystemExit, match="storage-timeout"):
        parse_config(["--webhook=false", "--storage-timeout=0"], environ={})


# --------------------------------------------------------------------------- stuck storage


class _Stuck:
    """A source whose every call blocks until released (a hung NFS mount, a silent peer)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def _block(self) -> None:
        self.release.wait(30)

    def reachable(self) -> bool:
        self._block()
        return True

    def run_owner(self, run_id: str) -> RunOwner | None:
        self._block()
        return None

    def list_checkpoints(self, run_id: str, *, include_heartbeat: bool = True) -> list[Any]:
        self._block()
        return []

    def close(self) -> None:
        self.release.set()


def test_a_stuck_storage_times_out_instead_of_holding_the_handler(world: Any, fixture: Any) -> None:
    stuck = _Stuck()

    async def sources(namespace: str, policy: str, spec: Any) -> Any:
        return stuck

    deps = Deps(
        api=world.api,
        events=world.events,
        metrics=world.metrics,
        sources=sources,
        config=OperatorConfig(storage_timeout_s=0.2),
        clock=world.clock,
    )
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    policy = world.api.policies[(TEAM_A, "llm-finetune")]

    async def main() -> None:
        try:
            with pytest.raises(StorageTimeoutError, match="run_owner did not return within"):
                await storage_call(deps, stuck.run_owner, "r")
            with pytest.raises(StorageTimeoutError):  # retryable: the scheduler backs off
                await recover_job(deps, job)
            with pytest.raises(StorageTimeoutError):
                await reconcile_retention(deps, policy)
        finally:
            stuck.close()  # lets the abandoned threads end (asyncio.run waits for them)

    t0 = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - t0 < 10


# --------------------------------------------------------------------------- annotations


BAD: dict[str, str] = {
    c.ANN_RUN_ID: "../team-b/llm-pretrain",
    c.ANN_RESUME_FROM: "../../etc/passwd",
    c.ANN_RESUME_STEP: "-1",
    c.ANN_RESTART_COUNT: "lots",
}


@pytest.mark.parametrize("key", sorted(BAD))
def test_admission_rejects_a_bad_annotation_naming_it(key: str, fixture: Any) -> None:
    job = fixture("pytorchjob_failed.json")
    job["metadata"]["annotations"][key] = BAD[key]
    (error,) = validate_job(job)
    assert error.startswith(f"annotation {key}=") and "remove" in error
    # an update that leaves the bad value alone (the operator writing its status) passes
    old = copy.deepcopy(job)
    job["metadata"]["annotations"][c.ANN_STATUS] = "{}"
    assert validate_job(job, old) == []
    # changing it to another bad value does not
    job["metadata"]["annotations"][key] = BAD[key] + "x"
    assert len(validate_job(job, old)) == 1


def test_good_annotations_pass() -> None:
    good = {
        c.ANN_RUN_ID: "mnist-ddp-5f0c6a7e",
        c.ANN_RESUME_FROM: "pulse_step_000000000120",
        c.ANN_RESUME_STEP: "120",
        c.ANN_RESTART_COUNT: "2",
        c.ANN_POLICY: "p",
    }
    assert annotation_errors(good) == []
    assert annotation_errors({}) == []


def test_a_job_admitted_with_a_bad_run_id_gives_up_once(world: Any, fixture: Any) -> None:
    job = world.api.add_job(_job(fixture, TEAM_A, "../team-b/llm-pretrain"))
    assert asyncio.run(recover_job(world.deps, job)) is None
    facts = job_facts(world.api.jobs[(TEAM_A, "mnist-ddp")])
    assert facts.status is not None and facts.status.state == "GaveUp"
    assert facts.status.reason == "InvalidAnnotation" and c.ANN_RUN_ID in facts.status.message
    (event,) = _events(world, "GaveUp")
    assert event.type == "Warning" and c.ANN_RUN_ID in event.message
    assert world.source.listed == [] and world.api.called("create_job") == []
    assert (
        world.counter(
            "ckpt_operator_recoveries_total", result="failure", reason="InvalidAnnotation"
        )
        == 1
    )
    assert asyncio.run(recover_job(world.deps, world.api.jobs[(TEAM_A, "mnist-ddp")])) is None
    assert len(_events(world, "GaveUp")) == 1


def test_pods_of_a_job_with_a_bad_annotation_are_not_injected(world: Any, fixture: Any) -> None:
    job = fixture("pytorchjob_failed.json")
    job["metadata"]["annotations"][c.ANN_RESUME_FROM] = "../../x"
    world.api.add_job(job)
    pod = fixture("admission_review_pod.json")["request"]["object"]
    outcome = asyncio.run(inject_pod(world.deps, pod, TEAM_A))
    assert outcome.result == "skipped" and outcome.ops == []
    assert c.ANN_RESUME_FROM in outcome.warnings[0]
    (event,) = _events(world, "InvalidAnnotation")
    assert event.type == "Warning"


def test_pods_learn_their_namespace_and_job_to_claim_the_run(world: Any, fixture: Any) -> None:
    """The agent claims its run for the namespace the API server says the pod is in."""
    job = world.api.add_job(fixture("pytorchjob_running.json"))
    pod = fixture("admission_review_pod.json")["request"]["object"]
    outcome = asyncio.run(inject_pod(world.deps, pod, TEAM_A))
    assert outcome.result == "injected"
    env = {e["name"]: e for e in apply_patch(pod, outcome.ops)["spec"]["containers"][0]["env"]}
    assert env["CKPT_NAMESPACE"] == {
        "name": "CKPT_NAMESPACE",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
    }
    assert env["CKPT_JOB_NAME"]["value"] == job["metadata"]["name"]
    assert env["CKPT_JOB_UID"]["value"] == job["metadata"]["uid"]
