"""Issue #11 items 3, 4, 5, 7 on the operator side: the heartbeat rebuild's weights reach
the pods, manual recovery through annotations (even after GaveUp), silent pods (no
agent), the run's start time and MTBF handed to the agent."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.cli.recover_job import ANNOTATIONS, annotate_command, request_recovery
from ckpt_agent.decide.mtbf import estimate_mtbf
from ckpt_agent.format.heartbeat import Heartbeat, encode_heartbeats
from ckpt_agent.format.layout import heartbeat_key
from ckpt_agent.format.termination import CheckpointReport, encode_report
from ckpt_agent.policy.agent_config import (
    ENV_MTBF_SECONDS,
    ENV_RESUME_PIN,
    ENV_RESUME_WEIGHTS,
    ENV_RUN_STARTED_AT,
)
from ckpt_agent.policy.models import RecoverySpec
from ckpt_agent.storage.fs import LocalStorage
from ckpt_operator.adapters.sources import StorageCheckpointSource, VerificationFailedError
from ckpt_operator.behaviours.admission import inject_pod, validate_job
from ckpt_operator.behaviours.agentcheck import check_agents
from ckpt_operator.behaviours.recovery import observe_job, recover_job
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import job_facts, parse_time
from ckpt_operator.model.jsonpatch import apply_patch
from ckpt_operator.planners.agent_presence import (
    AGENT_MISSING,
    Presence,
    ProbeResult,
    probe_target,
    processes_started,
    silent_pods,
    unreported_pods,
)
from ckpt_operator.planners.manual import (
    RecoverRequest,
    parse_request,
    pending_request,
    plan_manual,
)
from ckpt_operator.planners.restart import GiveUp, Restart, RestartDecision, build_restart_job
from ckpt_operator.planners.runfacts import agent_run_env

FAILED_AT = parse_time("2024-05-02T11:02:17Z") or 0.0
RUN = "mnist-ddp-5f0c6a7e"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def _ann(world: Any, name: str) -> dict[str, str]:
    return dict(world.api.jobs[("ml-team", name)]["metadata"]["annotations"])


def _checkpoints(world: Any, rec: Any) -> None:
    world.source.runs[RUN] = [
        rec("full", 1000, created_at=FAILED_AT - 900, manifest_hash="h1000"),
        rec("pulse", 1100, created_at=FAILED_AT - 600, manifest_hash="h1100", prev_hash="h1000"),
        rec("pulse", 1200, created_at=FAILED_AT - 300, manifest_hash="h1200", prev_hash="h1100"),
    ]


def _gave_up(world: Any, fixture: Any, **request: str) -> dict[str, Any]:
    job = fixture("pytorchjob_failed.json")
    ann = job["metadata"]["annotations"]
    ann[c.ANN_STATUS] = json.dumps({"state": "GaveUp", "reason": "MaxRestartsExceeded"})
    ann.update(request)
    return dict(world.api.add_job(job))


def _request(step: str = "1100", **more: str) -> dict[str, str]:
    return {
        c.ANN_RECOVER_STEP: step,
        c.ANN_RECOVER_BY: "alice@laptop",
        c.ANN_RECOVER_REASON: "loss spike after 1150",
        **more,
    }


# --------------------------------------------------------------------------- item 3


def test_heartbeat_rebuild_weights_reach_the_restart_and_its_pods(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.runs[RUN] = [
        rec("full", 1000, created_at=FAILED_AT - 900, manifest_hash="h1000"),
        rec("pulse", 1100, created_at=FAILED_AT - 600, manifest_hash="h1100", prev_hash="h1000"),
        rec("heartbeat", 1150, created_at=FAILED_AT - 60),
    ]
    world.source.corrupt = {"pulse_step_000000001100", "full_step_000000001000"}
    world.source.runs[RUN].append(
        rec("pulse", 900, created_at=FAILED_AT - 1200, manifest_hash="h900")
    )
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    run(recover_job(world.deps, job))
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]
    ann = child["metadata"]["annotations"]
    assert ann[c.ANN_RESUME_FROM] == "heartbeat_step_000000001150"
    assert ann[c.ANN_RESUME_WEIGHTS] == "pulse_step_000000000900"
    warning = [e for e in world.events.events if e.reason == "HeartbeatRebuild"]
    assert warning and warning[0].type == "Warning" and "not exact" in warning[0].message
    # the webhook hands the weights source to the restarted pods
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["metadata"]["ownerReferences"][0]["name"] = "mnist-ddp-r1"
    out = run(inject_pod(world.deps, pod, "ml-team"))
    env = {
        e["name"]: e.get("value") for e in apply_patch(pod, out.ops)["spec"]["containers"][0]["env"]
    }
    assert env["CKPT_RESUME_FROM"] == "heartbeat_step_000000001150"
    assert env[ENV_RESUME_WEIGHTS] == "pulse_step_000000000900"


# --------------------------------------------------------------------------- item 7


def test_mtbf_blends_the_policy_with_the_runs_failures() -> None:
    assert estimate_mtbf(86_400, 0, 1000) == 86_400
    assert estimate_mtbf(86_400, 1, 3600) == pytest.approx((86_400 + 3600) / 2)
    assert estimate_mtbf(1000, 9, 9000) == pytest.approx(1000)
    assert estimate_mtbf(1000, 3, 0) == 1000


def test_restart_carries_the_run_start_and_mtbf(world: Any, fixture: Any, rec: Any) -> None:
    _checkpoints(world, rec)
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    created = job_facts(job).created_at
    assert created is not None
    run(recover_job(world.deps, job))
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]
    ann = child["metadata"]["annotations"]
    assert ann[c.ANN_RUN_STARTED_AT] == f"{created:.0f}"
    mtbf = float(ann[c.ANN_MTBF_SECONDS])
    assert mtbf == pytest.approx(estimate_mtbf(86_400, 1, FAILED_AT - created), abs=1)
    assert json.loads(_ann(world, "mnist-ddp")[c.ANN_RESTART_DECISION])["mtbfSeconds"]
    # the restart of the restart keeps the chain's start time
    again = build_restart_job(
        child, RestartDecision("mnist-ddp-r2", 2, None, None, "fresh", mtbf_seconds=100.0)
    )
    assert again["metadata"]["annotations"][c.ANN_RUN_STARTED_AT] == f"{created:.0f}"
    env = agent_run_env(job_facts(child))
    assert env[ENV_RUN_STARTED_AT] == f"{created:.0f}" and float(env[ENV_MTBF_SECONDS]) > 0
    # the original job's pods get its creation time
    assert agent_run_env(job_facts(job)) == {ENV_RUN_STARTED_AT: f"{created:.0f}"}


# --------------------------------------------------------------------------- item 4


def test_parse_request_and_pending_once() -> None:
    assert parse_request({}) is None
    assert parse_request({c.ANN_RECOVER_STEP: "x"}) is None
    req = parse_request({**_request(), c.ANN_RECOVER_FORCE: "TRUE"})
    assert req == RecoverRequest(1100, "alice@laptop", "loss spike after 1150", force=True)


def test_manual_recover_after_gave_up_restarts_exactly_there(
    world: Any, fixture: Any, rec: Any
) -> None:
    _checkpoints(world, rec)
    job = _gave_up(world, fixture, **_request())
    assert run(observe_job(world.deps, job)) is True  # a request wakes a handled job
    assert run(recover_job(world.deps, job)) is None
    assert world.api.called("create_job") == ["mnist-ddp-r1"]
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]["metadata"]["annotations"]
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001100"
    assert child[c.ANN_RESUME_PIN] == "mnist-ddp-r1"  # a new pin: a new lineage epoch
    assert child[c.ANN_RECOVER_BY] == "alice@laptop"
    assert child[c.ANN_RECOVER_REASON] == "loss spike after 1150"
    assert c.ANN_RECOVER_STEP not in child  # the request is not carried
    manual = [e for e in world.events.events if e.reason == "ManualRecover"]
    assert "alice@laptop" in manual[0].message and "loss spike" in manual[0].message
    facts = job_facts(world.api.jobs[("ml-team", "mnist-ddp")])
    assert pending_request(facts) is None  # handled once
    assert facts.status is not None and facts.status.state == "Restarted"
    assert run(recover_job(world.deps, world.api.jobs[("ml-team", "mnist-ddp")])) is None
    assert world.api.called("create_job") == ["mnist-ddp-r1"]
    env = agent_run_env(job_facts(world.api.jobs[("ml-team", "mnist-ddp-r1")]))
    assert env[ENV_RESUME_PIN] == "mnist-ddp-r1"


def test_manual_dry_run_changes_nothing(world: Any, fixture: Any, rec: Any) -> None:
    _checkpoints(world, rec)
    job = _gave_up(world, fixture, **_request(**{c.ANN_RECOVER_DRY_RUN: "true"}))
    run(recover_job(world.deps, job))
    assert world.api.called("create_job") == []
    ann = _ann(world, "mnist-ddp")
    assert json.loads(ann[c.ANN_RECOVER_PLAN])["resumeFrom"] == "pulse_step_000000001100"
    assert json.loads(ann[c.ANN_STATUS])["state"] == "GaveUp"
    planned = [e for e in world.events.events if e.reason == "RecoverPlanned"]
    assert "would restart as mnist-ddp-r1" in planned[0].message
    assert "alice@laptop" in planned[0].message


def test_manual_recover_of_a_poisoned_checkpoint_needs_force(
    world: Any, fixture: Any, rec: Any
) -> None:
    _checkpoints(world, rec)
    job = _gave_up(world, fixture, **_request(), **{c.ANN_POISONED: "pulse_step_000000001100"})
    run(recover_job(world.deps, job))
    assert world.api.called("create_job") == []
    refused = [e for e in world.events.events if e.reason == "RecoverRefused"]
    assert "recover-force" in refused[0].message
    # the same request with force is a new request: applied
    world.api.jobs[("ml-team", "mnist-ddp")]["metadata"]["annotations"][c.ANN_RECOVER_FORCE] = (
        "true"
    )
    run(recover_job(world.deps, world.api.jobs[("ml-team", "mnist-ddp")]))
    assert world.api.called("create_job") == ["mnist-ddp-r1"]
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]["metadata"]["annotations"]
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001100"
    assert "pulse_step_000000001100" not in child.get(c.ANN_POISONED, "")


def test_manual_recover_refusals(world: Any, fixture: Any, rec: Any) -> None:
    _checkpoints(world, rec)
    job = fixture("pytorchjob_failed.json")
    out = plan_manual(
        job, RecoverRequest(1150, "a", "b"), world.source.runs[RUN], RecoverySpec(), lambda _: True
    )
    assert isinstance(out, GiveUp) and "no checkpoint at step 1150" in out.message
    world.source.corrupt = {"pulse_step_000000001200"}
    out = plan_manual(
        job,
        RecoverRequest(1200, "a", "b"),
        world.source.runs[RUN],
        RecoverySpec(),
        world.source.verify.__get__(world.source)
        if False
        else (lambda cid: world.source.verify(RUN, cid)),
    )
    assert isinstance(out, GiveUp) and "does not match" in out.message
    ok = plan_manual(
        job, RecoverRequest(1000, "a", "b"), world.source.runs[RUN], RecoverySpec(), lambda _: True
    )
    assert isinstance(ok, Restart) and ok.decision.action == "manual"
    # a request without who/why is refused by the webhook and by the operator
    bad = _gave_up(world, fixture, **{c.ANN_RECOVER_STEP: "1000"})
    assert any("recover-by" in e for e in validate_job(bad))
    run(recover_job(world.deps, bad))
    assert [e.reason for e in world.events.events] == ["RecoverRefused"]
    assert world.api.called("create_job") == []


def test_webhook_validates_the_new_annotations(fixture: Any) -> None:
    job = fixture("pytorchjob_failed.json")
    ann = job["metadata"]["annotations"]
    ann.update(_request())
    assert validate_job(job) == []
    ann.update({c.ANN_RECOVER_STEP: "-3", c.ANN_RECOVER_FORCE: "yes", c.ANN_MTBF_SECONDS: "0"})
    ann[c.ANN_RESUME_WEIGHTS] = "not-an-id"
    errors = " ".join(validate_job(job))
    for key in (c.ANN_RECOVER_STEP, c.ANN_RECOVER_FORCE, c.ANN_MTBF_SECONDS, c.ANN_RESUME_WEIGHTS):
        assert key in errors


def test_cli_files_the_request_with_kubectl(tmp_path: Path) -> None:
    assert ANNOTATIONS == {
        "step": c.ANN_RECOVER_STEP,
        "by": c.ANN_RECOVER_BY,
        "reason": c.ANN_RECOVER_REASON,
        "force": c.ANN_RECOVER_FORCE,
        "dry_run": c.ANN_RECOVER_DRY_RUN,
    }
    argv = annotate_command(
        "j", "ns", step=5, reason="why", by="me", force=True, dry_run=False, kubectl="k"
    )
    assert argv[:7] == ["k", "annotate", "pytorchjob", "j", "--overwrite", "--namespace", "ns"]
    assert f"{c.ANN_RECOVER_FORCE}=true" in argv and f"{c.ANN_RECOVER_STEP}=5" in argv
    log = tmp_path / "args"
    fake = tmp_path / "kubectl"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"KUBECTL": str(fake), "PATH": os.environ.get("PATH", "")}
    request_recovery("j", None, 5, reason="loss spike", force=False, dry_run=True, environ=env)
    args = log.read_text().splitlines()
    assert f"{c.ANN_RECOVER_DRY_RUN}=true" in args and f"{c.ANN_RECOVER_REASON}=loss spike" in args


# --------------------------------------------------------------------------- item 5


def _running_pod(fixture: Any, started: str) -> dict[str, Any]:
    pod = fixture("admission_review_pod.json")["request"]["object"]
    pod["metadata"].setdefault("annotations", {}).update(
        {c.ANN_POLICY: "llm-finetune", c.ANN_RUN_ID: RUN}
    )
    pod["metadata"].setdefault("labels", {}).update(
        {c.LABEL_INJECTED: "true", c.LABEL_TO_JOB_NAME: "mnist-ddp"}
    )
    pod["metadata"]["namespace"] = "ml-team"
    pod["status"] = {"phase": "Running", "startTime": started}
    return dict(pod)


def test_silent_pods() -> None:
    pod = {
        "metadata": {"name": "p", "annotations": {c.ANN_RUN_ID: "r"}, "labels": {}},
        "status": {"phase": "Running", "startTime": "2024-05-02T11:00:00Z"},
    }
    t0 = parse_time("2024-05-02T11:00:00Z") or 0.0
    assert silent_pods([pod], {}, t0 + 100, 300) == []  # not past the deadline yet
    assert [s.pod for s in silent_pods([pod], {}, t0 + 400, 300)] == ["p"]
    assert silent_pods([pod], {"r": [t0 + 5]}, t0 + 400, 300) == []  # a heartbeat: fine
    assert [s.pod for s in silent_pods([pod], {"r": [t0 - 5]}, t0 + 400, 300)] == ["p"]
    assert silent_pods([pod], {}, t0 + 400, 0) == []  # disabled


def test_agent_missing_is_flagged_once(world: Any, fixture: Any) -> None:
    world.api.add_job(fixture("pytorchjob_running.json"))
    policy = fixture("checkpointpolicy.json")
    world.api.add_pod(_running_pod(fixture, "2024-05-02T10:00:00Z"))
    world.clock.now = (parse_time("2024-05-02T10:00:00Z") or 0.0) + 600
    assert run(check_agents(world.deps, policy)) == ["mnist-ddp-worker-0"]
    # a pass lists the policy's namespace only (its cost follows its pods, not the cluster's)
    assert [ns for _, _, ns in world.api.called("list_pods")] == ["ml-team"]
    assert run(check_agents(world.deps, world.api.policies[("ml-team", "llm-finetune")]))
    warnings = [e for e in world.events.events if e.reason == "AgentMissing"]
    assert len(warnings) == 1 and AGENT_MISSING in warnings[0].message
    conditions = world.api.policies[("ml-team", "llm-finetune")]["status"]["conditions"]
    cond = next(x for x in conditions if x["type"] == "AgentReporting")
    assert (cond["status"], cond["reason"]) == ("False", "AgentMissing")
    # the agent reports in: the condition clears
    world.source.heartbeats[RUN] = [(3, world.clock.now - 10)]
    assert run(check_agents(world.deps, world.api.policies[("ml-team", "llm-finetune")])) == []
    conditions = world.api.policies[("ml-team", "llm-finetune")]["status"]["conditions"]
    cond = next(x for x in conditions if x["type"] == "AgentReporting")
    assert cond["status"] == "True"


def test_agent_check_lists_a_run_only_when_its_heartbeats_leave_a_pod_silent(
    world: Any, fixture: Any
) -> None:
    """The heartbeat ring is one small read; the run's checkpoint listing (a walk of the
    whole run) is needed only where heartbeats are off or stale."""
    world.api.add_job(fixture("pytorchjob_running.json"))
    policy = fixture("checkpointpolicy.json")
    world.api.add_pod(_running_pod(fixture, "2024-05-02T10:00:00Z"))
    world.clock.now = (parse_time("2024-05-02T10:00:00Z") or 0.0) + 600
    world.source.heartbeats[RUN] = [(3, world.clock.now - 10)]
    assert run(check_agents(world.deps, policy)) == []
    assert world.source.listed == []
    world.source.heartbeats[RUN] = []  # heartbeats off: the listing decides
    assert run(check_agents(world.deps, policy)) == ["mnist-ddp-worker-0"]
    assert [r for r, _ in world.source.listed] == [RUN]


def test_fresh_restart_without_agent_reports_says_so(world: Any, fixture: Any) -> None:
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    run(recover_job(world.deps, job))
    assert world.api.called("create_job") == ["mnist-ddp-r1"]
    restarted = [e for e in world.events.events if e.reason == "Restarted"]
    assert "fresh" in restarted[0].message
    missing = [e for e in world.events.events if e.reason == "AgentMissing"]
    assert missing and missing[0].type == "Warning"


def _ended(pod: dict[str, Any], message: str) -> dict[str, Any]:
    """``pod`` with its container restarted in place, the old one's message ``message``."""
    terminated = {"exitCode": 137, "message": message} if message else {"exitCode": 137}
    pod["status"]["containerStatuses"] = [
        {"name": "pytorch", "state": {"running": {}}, "lastState": {"terminated": terminated}}
    ]
    return pod


def test_unreported_pods() -> None:
    """Blind (storage the operator cannot read): only a container that ended without a
    report is evidence; one that never ended tells nothing yet."""
    pod = {
        "metadata": {"name": "p", "annotations": {c.ANN_RUN_ID: "r"}, "labels": {}},
        "status": {"phase": "Running", "startTime": "2024-05-02T11:00:00Z"},
    }
    t0 = parse_time("2024-05-02T11:00:00Z") or 0.0
    assert unreported_pods([pod], set(), t0 + 400, 300) == []  # never ended: no verdict
    _ended(pod, "")
    assert [s.pod for s in unreported_pods([pod], set(), t0 + 400, 300)] == ["p"]
    assert unreported_pods([pod], {"p"}, t0 + 400, 300) == []  # it reported
    assert unreported_pods([pod], set(), t0 + 100, 300) == []  # not past the deadline yet
    assert unreported_pods([pod], set(), t0 + 400, 0) == []  # disabled


def test_unreported_pods_with_probes() -> None:
    """A refused probe is a verdict of its own; an agent that answers clears any doubt; a
    probe without a verdict changes nothing."""
    pod = {
        "metadata": {"name": "p", "annotations": {c.ANN_RUN_ID: "r"}, "labels": {}},
        "status": {"phase": "Running", "startTime": "2024-05-02T11:00:00Z"},
    }
    t0 = parse_time("2024-05-02T11:00:00Z") or 0.0
    absent = {"p": ProbeResult(Presence.ABSENT, "10.0.0.5:9400 refused the connection")}
    serving = {"p": ProbeResult(Presence.SERVING, "the agent serves 10.0.0.5:9400")}
    unknown = {"p": ProbeResult(Presence.UNKNOWN, "10.0.0.5:9400 did not answer within 2s")}
    # a first refusal is a suspicion (the process may still be starting) ...
    assert unreported_pods([pod], set(), t0 + 400, 300, absent) == []
    assert unreported_pods([pod], set(), t0 + 400, 300, absent, {"p": t0 + 101}) == []
    # ... proof once every probe of the same processes refused for a deadline
    silent = unreported_pods([pod], set(), t0 + 400, 300, absent, {"p": t0 + 100})
    assert [(s.pod, s.evidence) for s in silent] == [
        ("p", "10.0.0.5:9400 refused the connection on every probe for 300s")
    ]
    since = {"p": t0 - 500}
    assert unreported_pods([pod], set(), t0 + 100, 300, absent, since) == []  # before deadline
    assert unreported_pods([pod], {"p"}, t0 + 400, 300, absent, since) == []  # it reported
    assert unreported_pods([pod], set(), t0 + 400, 300, unknown) == []  # never ended
    assert unreported_pods([pod], set(), t0 + 400, 300, serving) == []
    _ended(pod, "")
    assert unreported_pods([pod], set(), t0 + 400, 300, serving) == []  # restarted, agent up
    assert [s.pod for s in unreported_pods([pod], set(), t0 + 400, 300, unknown)] == ["p"]


def test_the_deadline_counts_from_the_processes_start_not_the_pods() -> None:
    """The pod's startTime precedes the image pull: a container that started late (or
    restarted in place) has its own deadline, from its state.running.startedAt."""
    pod = {
        "metadata": {"name": "p", "annotations": {c.ANN_RUN_ID: "r"}, "labels": {}},
        "status": {
            "phase": "Running",
            "startTime": "2024-05-02T11:00:00Z",
            "containerStatuses": [
                {"name": "sidecar", "state": {"running": {"startedAt": "2024-05-02T11:00:05Z"}}},
                {"name": "pytorch", "state": {"running": {"startedAt": "2024-05-02T11:04:00Z"}}},
            ],
        },
    }
    t0 = parse_time("2024-05-02T11:00:00Z") or 0.0
    assert processes_started(pod) == t0 + 240
    absent = {"p": ProbeResult(Presence.ABSENT, "10.0.0.5:9400 refused the connection")}
    long_ago = {"p": t0 - 10_000}
    assert unreported_pods([pod], set(), t0 + 400, 300, absent, long_ago) == []  # ran 160 s
    assert [s.pod for s in unreported_pods([pod], set(), t0 + 540, 300, absent, long_ago)] == ["p"]
    assert silent_pods([pod], {"r": []}, t0 + 400, 300) == []
    # heartbeats of the process before a restart in place say nothing about this one
    assert [s.pod for s in silent_pods([pod], {"r": [t0 + 100]}, t0 + 540, 300)] == ["p"]
    del pod["status"]["containerStatuses"]
    assert processes_started(pod) == t0  # no container status yet: the pod's start
    assert processes_started({"metadata": {}}) is None


def test_probe_target() -> None:
    def pod(ip: str | None, ports: list[Any], env: list[Any]) -> dict[str, Any]:
        ctr = {"name": "pytorch", "ports": ports, "env": env}
        return {"spec": {"containers": [{"name": "other"}, ctr]}, "status": {"podIP": ip}}

    named = [{"name": c.METRICS_PORT_NAME, "containerPort": 9400}]
    env = [{"name": "CKPT_METRICS_PORT", "value": "9500"}]
    assert probe_target(pod("10.0.0.5", named, env)) == ("10.0.0.5", 9400)
    assert probe_target(pod("10.0.0.5", [], env)) == ("10.0.0.5", 9500)  # port declared by hand
    assert probe_target(pod(None, named, env)) is None  # no IP yet
    assert probe_target(pod("10.0.0.5", [], [{"name": "CKPT_METRICS_PORT", "value": "0"}])) is None
    assert probe_target(pod("10.0.0.5", [], [{"name": "CKPT_METRICS_PORT", "value": "x"}])) is None
    assert probe_target(pod("10.0.0.5", [], [])) is None


def test_agent_missing_blind_probes_the_running_pod(world: Any, fixture: Any) -> None:
    """Blind, the container never ended: the probe of the agent's port is the verdict,
    refused → AgentMissing naming what was found; answered → fine."""
    world.api.add_job(fixture("pytorchjob_running.json"))
    policy = fixture("checkpointpolicy.json")
    world.source.unreachable = True
    pod = _running_pod(fixture, "2024-05-02T10:00:00Z")
    pod["status"]["podIP"] = "10.0.0.5"
    pod["metadata"]["uid"] = "pod-uid-1"
    pod["spec"]["containers"][0]["ports"] = [{"name": c.METRICS_PORT_NAME, "containerPort": 9400}]
    world.api.add_pod(pod)
    probed: list[tuple[str, int]] = []
    presence = [Presence.ABSENT]

    async def probe(ip: str, port: int, timeout: float) -> ProbeResult:
        probed.append((ip, port))
        return ProbeResult(presence[0], f"{ip}:{port} says {presence[0]}")

    world.deps.probe = probe
    world.clock.now = (parse_time("2024-05-02T10:00:00Z") or 0.0) + 100
    assert run(check_agents(world.deps, policy)) == []  # not past the deadline: not probed
    assert probed == []
    world.clock.now += 500
    # refused once: the process may still be starting (a loaded node), no verdict yet
    assert run(check_agents(world.deps, policy)) == []
    assert probed == [("10.0.0.5", 9400)]
    world.clock.now += 100  # refused again, but not for a whole deadline (300 s) yet
    assert run(check_agents(world.deps, policy)) == [] and len(probed) == 2
    presence[0] = Presence.UNKNOWN  # no verdict in between: the suspicion starts over
    world.clock.now += 100
    assert run(check_agents(world.deps, policy)) == [] and len(probed) == 3
    presence[0] = Presence.ABSENT
    world.clock.now += 100
    assert run(check_agents(world.deps, policy)) == [] and len(probed) == 4
    world.clock.now += 300  # every probe for a deadline refused: proof
    assert run(check_agents(world.deps, policy)) == ["mnist-ddp-worker-0"]
    assert len(probed) == 5
    warnings = [e for e in world.events.events if e.reason == "AgentMissing"]
    assert len(warnings) == 1
    assert "10.0.0.5:9400 says absent on every probe for 300s" in warnings[0].message
    presence[0] = Presence.SERVING
    policy = world.api.policies[("ml-team", "llm-finetune")]
    assert run(check_agents(world.deps, policy)) == []
    conditions = world.api.policies[("ml-team", "llm-finetune")]["status"]["conditions"]
    assert next(x for x in conditions if x["type"] == "AgentReporting")["status"] == "True"
    assert len(probed) == 6
    presence[0] = Presence.ABSENT  # answered once: not probed again while nothing restarted
    world.clock.now += 600
    assert run(check_agents(world.deps, policy)) == [] and len(probed) == 6
    stored = world.api.pods[("ml-team", "mnist-ddp-worker-0")]
    stored["status"]["containerStatuses"] = [
        {"name": "pytorch", "restartCount": 1, "state": {"running": {}}}
    ]  # a new process (no report in lastState): probed again, suspected anew
    assert run(check_agents(world.deps, policy)) == [] and len(probed) == 7
    world.clock.now += 300
    assert run(check_agents(world.deps, policy)) == ["mnist-ddp-worker-0"]
    assert len(probed) == 8


def test_agent_missing_blind_uses_the_pods_reports(world: Any, fixture: Any) -> None:
    world.api.add_job(fixture("pytorchjob_running.json"))
    policy = fixture("checkpointpolicy.json")
    world.source.unreachable = True  # a PVC mounted in the pods only
    world.api.add_pod(_running_pod(fixture, "2024-05-02T10:00:00Z"))
    pod = world.api.pods[("ml-team", "mnist-ddp-worker-0")]
    world.clock.now = (parse_time("2024-05-02T10:00:00Z") or 0.0) + 600
    assert run(check_agents(world.deps, policy)) == []  # running, never ended: no verdict
    assert not [e for e in world.events.events if e.reason == "AgentMissing"]
    _ended(pod, "")  # restarted in place, and the container left no report
    assert run(check_agents(world.deps, policy)) == ["mnist-ddp-worker-0"]
    warnings = [e for e in world.events.events if e.reason == "AgentMissing"]
    assert len(warnings) == 1 and AGENT_MISSING in warnings[0].message
    conditions = world.api.policies[("ml-team", "llm-finetune")]["status"]["conditions"]
    cond = next(x for x in conditions if x["type"] == "AgentReporting")
    assert (cond["status"], cond["reason"]) == ("False", "AgentMissing")
    report = encode_report(CheckpointReport(RUN, written_at=world.clock.now)).decode()
    _ended(pod, report)  # the agent reported in at start()
    policy = world.api.policies[("ml-team", "llm-finetune")]
    assert run(check_agents(world.deps, policy)) == []
    conditions = world.api.policies[("ml-team", "llm-finetune")]["status"]["conditions"]
    assert next(x for x in conditions if x["type"] == "AgentReporting")["status"] == "True"


def test_storage_source_verifies_a_heartbeat_by_its_ring(tmp_path: Path) -> None:
    """The ladder's heartbeat rung verifies the heartbeat: it has no commit, no hashes."""
    store = LocalStorage(tmp_path)
    store.commit(
        heartbeat_key(RUN, 0),
        encode_heartbeats(RUN, 0, [Heartbeat(step=310, time=5000.0)]),
    )
    src = StorageCheckpointSource(store)
    assert src.verify(RUN, "heartbeat_step_000000000310") is True
    with pytest.raises(VerificationFailedError, match="no longer holds step 311"):
        src.verify(RUN, "heartbeat_step_000000000311")
