"""Checkpoints reported by the pods (termination messages), for storage the operator cannot read."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from ckpt_agent.format.termination import CheckpointReport, encode_report
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_operator.adapters.sources import ReportedCheckpointSource, VerificationFailedError
from ckpt_operator.behaviours.recovery import recover_job
from ckpt_operator.behaviours.retention import reconcile_retention
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import parse_time
from ckpt_operator.planners.reports import (
    known_checkpoints,
    last_verified,
    pod_reports,
    reported_status,
)

FAILED_AT = parse_time("2024-05-02T11:02:17Z") or 0.0
R1_CREATED = parse_time("2024-05-02T11:02:30Z") or 0.0
RUN = "mnist-ddp-5f0c6a7e"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def message(records: list[CheckpointRecord], run_id: str = RUN, at: float = FAILED_AT) -> str:
    return encode_report(CheckpointReport.from_records(run_id, records, at)).decode()


def pod(
    fixture: Any,
    name: str,
    job: str,
    msg: str | None,
    *,
    last_state: bool = False,
    container: str = "pytorch",
) -> dict[str, Any]:
    p: dict[str, Any] = fixture("pod_terminating.json")
    p["metadata"]["name"] = name
    p["metadata"].pop("deletionTimestamp", None)
    p["metadata"]["labels"][c.LABEL_TO_JOB_NAME] = job
    p["metadata"].setdefault("annotations", {})[c.ANN_RUN_ID] = RUN
    terminated: dict[str, Any] = {"exitCode": 137, "reason": "Error"}
    if msg is not None:
        terminated["message"] = msg
    state = {"lastState": {"terminated": terminated}, "state": {"running": {}}}
    if not last_state:
        state = {"state": {"terminated": terminated}}
    p["status"] = {"phase": "Failed", "containerStatuses": [{"name": container, **state}]}
    return p


def reported(rec: Any) -> list[CheckpointRecord]:
    return [
        rec("full", 1000, created_at=FAILED_AT - 900, manifest_hash="a" * 64),
        rec(
            "pulse",
            1100,
            created_at=FAILED_AT - 600,
            manifest_hash="b" * 64,
            prev_hash="a" * 64,
        ),
        rec(
            "pulse",
            1200,
            created_at=FAILED_AT - 300,
            manifest_hash="c" * 64,
            prev_hash="b" * 64,
        ),
        rec("pulse", 1250, status=CheckpointStatus.CORRUPTED, created_at=FAILED_AT - 200),
    ]


# --------------------------------------------------------------------------- pure


def test_pod_reports_reads_state_and_last_state_and_explains_the_rest(
    fixture: Any, rec: Any
) -> None:
    pods = [
        pod(fixture, "w-0", "j", message(reported(rec))),
        pod(fixture, "w-1", "j", message(reported(rec)[:1]), last_state=True),
        pod(fixture, "w-2", "j", "Traceback: CUDA out of memory"),
        pod(fixture, "w-3", "j", None),
    ]
    reports, problems = pod_reports(pods)
    assert [(r.pod, r.container) for r in reports] == [("w-0", "pytorch"), ("w-1", "pytorch")]
    # verdicts: valid ones, and the corrupted one (so that no restart is planned from it)
    assert [(c.step, c.status) for c in reports[0].report.checkpoints] == [
        (1250, "corrupted"),
        (1200, "valid"),
        (1100, "valid"),
        (1000, "valid"),
    ]
    (problem,) = problems
    assert problem.startswith("pod w-2 container pytorch:") and "not JSON" in problem


def test_known_checkpoints_merges_carried_and_reported_of_the_same_run(rec: Any) -> None:
    recs = reported(rec)
    carried = message(recs[:2])
    other_run = pod_reports(
        [
            {
                "metadata": {"name": "x"},
                "status": {
                    "containerStatuses": [
                        {
                            "name": "pytorch",
                            "state": {"terminated": {"message": message(recs, "other-run")}},
                        }
                    ]
                },
            }
        ]
    )[0]
    mine = pod_reports(
        [
            {
                "metadata": {"name": "y"},
                "status": {
                    "containerStatuses": [
                        {"name": "pytorch", "state": {"terminated": {"message": message(recs[2:])}}}
                    ]
                },
            }
        ]
    )[0]
    known = known_checkpoints(RUN, [carried, None, "garbage"], other_run + mine)
    assert [cp.step for cp in known.report.checkpoints] == [1250, 1200, 1100, 1000]
    assert any("annotation ckpt.dev/checkpoints" in p for p in known.problems)
    assert any("reports run 'other-run'" in p for p in known.problems)
    # the annotation is bounded like a termination message and parses back
    assert len(known.annotation) < 4096
    again = known_checkpoints(RUN, [known.annotation], [])
    assert again.report.checkpoints == known.report.checkpoints


def test_last_verified_is_the_newest_weights_checkpoint(rec: Any) -> None:
    recs = [*reported(rec), rec("heartbeat", 1300, created_at=FAILED_AT - 10)]
    report = CheckpointReport.from_records(RUN, recs)
    entry = last_verified(report)
    assert entry is not None
    assert entry["checkpointId"] == "pulse_step_000000001200" and entry["step"] == 1200
    assert entry["source"] == "pods" and entry["time"].endswith("Z")
    assert last_verified(CheckpointReport(RUN)) is None


def test_reported_status_counts_and_names_the_newest(rec: Any) -> None:
    report = CheckpointReport.from_records(RUN, reported(rec))
    status = reported_status(
        {RUN: report, "empty-run": CheckpointReport("empty-run")},
        previous={"deletedByRetention": 4, "bytesStored": 10},
        jobs=2,
        now=FAILED_AT,
    )
    assert status["jobs"] == 2 and status["runs"] == 2
    assert status["checkpoints"] == 4 and status["validCheckpoints"] == 3
    assert status["deletedByRetention"] == 4 and status["bytesStored"] == 10
    assert list(status["lastValid"]) == [RUN]
    newest = status["lastVerifiedCheckpoint"]
    assert newest["checkpointId"] == "pulse_step_000000001200" and newest["runId"] == RUN


def test_reported_source_verifies_nothing_and_deletes_nothing(rec: Any) -> None:
    source = ReportedCheckpointSource(
        CheckpointReport.from_records(RUN, [*reported(rec), rec("heartbeat", 1201)]).records()
    )
    assert not source.reachable()
    assert [r.step for r in source.list_checkpoints(RUN)] == [1000, 1100, 1200, 1201, 1250]
    assert [r.step for r in source.list_checkpoints(RUN, include_heartbeat=False)] == [
        1000,
        1100,
        1200,
        1250,
    ]
    # 1250 has no manifest hash (an unreadable COMMIT): it stays corrupted, verify is moot
    assert source.list_checkpoints(RUN)[-1].status == CheckpointStatus.CORRUPTED
    assert source.verify(RUN, "pulse_step_000000001200")
    assert source.collect_garbage(RUN).deleted == []
    try:
        source.delete_checkpoint(RUN, "pulse_step_000000001200")
    except Exception as e:
        assert "retention of PVC storage runs in the pods" in str(e)
    else:  # pragma: no cover
        raise AssertionError("deleted through a report")


# --------------------------------------------------------------------------- behaviours


def test_unreachable_storage_restarts_from_what_the_pod_reported(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.unreachable = True  # e.g. a PVC: listing it here would say "empty"
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.api.add_pod(pod(fixture, "mnist-ddp-worker-0", "mnist-ddp", message(reported(rec))))
    assert run(recover_job(world.deps, job)) is None
    assert world.api.called("create_job") == ["mnist-ddp-r1"]
    assert world.source.listed == [] and world.source.verified == []  # storage untouched
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]["metadata"]["annotations"]
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001200"
    assert child[c.ANN_RESUME_STEP] == "1200"
    # the restart carries what is known, the failed job says what it last verified
    assert "pulse_step_000000001200" not in child.get(c.ANN_POISONED, "")
    carried = json.loads(child[c.ANN_CHECKPOINTS])
    assert [(e["s"], e["st"]) for e in carried["cps"]] == [
        (1250, "corrupted"),
        (1200, "valid"),
        (1100, "valid"),
        (1000, "valid"),
    ]
    ann = world.api.jobs[("ml-team", "mnist-ddp")]["metadata"]["annotations"]
    last = json.loads(ann[c.ANN_LAST_VERIFIED])
    assert last["checkpointId"] == "pulse_step_000000001200" and last["source"] == "pods"
    assert c.ANN_LAST_VERIFIED not in child  # operator-owned: not copied
    assert world.events.reasons() == ["JobFailed", "LadderStep", "Restarted"]


def test_storage_listing_nothing_falls_back_to_the_reports(
    world: Any, fixture: Any, rec: Any
) -> None:
    # a local path that happens to exist in the operator's pod, but is not the pods' volume
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.api.add_pod(pod(fixture, "mnist-ddp-worker-0", "mnist-ddp", message(reported(rec))))
    run(recover_job(world.deps, job))
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]["metadata"]["annotations"]
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001200"


def test_without_reports_unreachable_storage_restarts_fresh(world: Any, fixture: Any) -> None:
    # nothing reported (no checkpoint yet): the new pod's own ladder still looks at storage
    world.source.unreachable = True
    job = world.api.add_job(fixture("pytorchjob_failed.json"))
    world.api.add_pod(pod(fixture, "mnist-ddp-worker-0", "mnist-ddp", "oom"))
    run(recover_job(world.deps, job))
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]["metadata"]["annotations"]
    assert c.ANN_RESUME_FROM not in child
    assert c.ANN_CHECKPOINTS not in child


def test_crash_loop_is_detected_from_carried_reports(world: Any, fixture: Any, rec: Any) -> None:
    # r1 resumed from 1200 and died before writing anything (its pod reported nothing);
    # what train reported came along on r1's annotation
    world.source.unreachable = True
    job = fixture("pytorchjob_r1_failed.json")
    job["metadata"]["annotations"][c.ANN_CHECKPOINTS] = message(reported(rec)).strip()
    job = world.api.add_job(job)
    world.api.add_pod(pod(fixture, "mnist-ddp-r1-worker-0", "mnist-ddp-r1", None))
    run(recover_job(world.deps, job))
    assert world.events.reasons()[:2] == ["JobFailed", "CrashLoop"]
    child = world.api.jobs[("ml-team", "mnist-ddp-r2")]["metadata"]["annotations"]
    assert child[c.ANN_POISONED] == "pulse_step_000000001200"
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001100"


def test_progress_reported_after_the_restart_is_no_crash_loop(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.unreachable = True
    job = fixture("pytorchjob_r1_failed.json")
    job["metadata"]["annotations"][c.ANN_CHECKPOINTS] = message(reported(rec)).strip()
    job = world.api.add_job(job)
    newer = [*reported(rec), rec("pulse", 1300, created_at=R1_CREATED + 60)]
    world.api.add_pod(pod(fixture, "mnist-ddp-r1-worker-0", "mnist-ddp-r1", message(newer)))
    run(recover_job(world.deps, job))
    assert "CrashLoop" not in world.events.reasons()
    child = world.api.jobs[("ml-team", "mnist-ddp-r2")]["metadata"]["annotations"]
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001300"


def test_retention_of_unreachable_storage_reports_what_the_pods_said(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.source.unreachable = True
    world.source.runs[RUN] = [rec("pulse", 5)]  # would be deleted if it were looked at
    world.api.add_job(fixture("pytorchjob_failed.json"))
    world.api.add_pod(pod(fixture, "mnist-ddp-worker-0", "mnist-ddp", message(reported(rec))))
    status = run(reconcile_retention(world.deps, fixture("checkpointpolicy.json")))
    assert world.source.deleted == [] and world.source.listed == []
    assert [ns for _, _, ns in world.api.called("list_pods")] == ["ml-team"]  # not the cluster
    assert status["lastValid"][RUN]["checkpointId"] == "pulse_step_000000001200"
    newest = status["lastVerifiedCheckpoint"]
    assert newest == {**status["lastValid"][RUN], "runId": RUN}
    reconciled = status["conditions"][-1]
    assert (reconciled["status"], reconciled["reason"]) == ("True", "RetentionInPods")
    stored = world.api.policies[("ml-team", "llm-finetune")]["status"]
    assert stored["lastVerifiedCheckpoint"]["step"] == 1200


def test_retention_of_reachable_storage_names_the_newest_too(
    world: Any, fixture: Any, rec: Any
) -> None:
    world.api.add_job(fixture("pytorchjob_failed.json"))
    world.source.runs[RUN] = reported(rec)
    status = run(reconcile_retention(world.deps, fixture("checkpointpolicy.json")))
    assert status["lastVerifiedCheckpoint"]["checkpointId"] == "pulse_step_000000001200"
    assert status["lastVerifiedCheckpoint"]["source"] == "storage"


# --------------------------------------------------------------------------- hostile reports

HOSTILE = [
    "[" * 3000,  # RecursionError in json, well under the kubelet's 4096 bytes
    "{" * 3000,
    '{"format":"ckpt.dev/checkpoints","v":1,"run":"r","cps":[' + "[" * 1500 + "]" * 1500 + "]}",
    '{"format":"ckpt.dev/checkpoints","v":1,"run":"' + RUN + '","cps":[{"s":1,"t":"pulse",'
    '"st":"valid","at":1e400}]}',
    '{"format":"ckpt.dev/checkpoints","v":1,"run":"' + RUN + '","cps":[],"at":NaN}',
    "9" * 5000,
    "x" * 200_000,
    "\udcff\ud800",
]


def test_a_hostile_message_never_breaks_pod_reports(fixture: Any, rec: Any) -> None:
    pods = [pod(fixture, f"w-{i}", "j", m) for i, m in enumerate(HOSTILE)]
    pods.append(pod(fixture, "w-good", "j", message(reported(rec))))
    pods.append({"metadata": None, "status": {"containerStatuses": [{"state": None}]}})
    reports, problems = pod_reports(pods)
    assert [r.pod for r in reports] == ["w-good"]
    assert len(problems) == len(HOSTILE)
    assert all(len(p) < 400 for p in problems)  # quoted short, whatever the message held


def test_a_hostile_annotation_never_breaks_known_checkpoints(rec: Any) -> None:
    good = message(reported(rec))
    known = known_checkpoints(RUN, [*HOSTILE, good], [])
    assert [cp.step for cp in known.report.checkpoints] == [1250, 1200, 1100, 1000]
    assert len(known.problems) == len(HOSTILE)


def test_a_hostile_report_does_not_stop_a_restart(world: Any, fixture: Any, rec: Any) -> None:
    world.source.unreachable = True
    job = fixture("pytorchjob_failed.json")
    job["metadata"]["annotations"][c.ANN_CHECKPOINTS] = "[" * 3000  # edited by hand
    job = world.api.add_job(job)
    world.api.add_pod(pod(fixture, "mnist-ddp-worker-0", "mnist-ddp", message(reported(rec))))
    world.api.add_pod(pod(fixture, "mnist-ddp-worker-1", "mnist-ddp", "{" * 3000))
    assert run(recover_job(world.deps, job)) is None
    child = world.api.jobs[("ml-team", "mnist-ddp-r1")]["metadata"]["annotations"]
    assert child[c.ANN_RESUME_FROM] == "pulse_step_000000001200"


# --------------------------------------------------------------------------- verdicts, gone


def test_a_pods_corrupted_verdict_wins_over_the_valid_report_it_carried(rec: Any) -> None:
    carried = message(reported(rec))  # the first pod: 1200 valid
    bad = [
        rec("pulse", 1200, status=CheckpointStatus.CORRUPTED, created_at=FAILED_AT - 300),
        *reported(rec)[:2],
    ]
    mine = pod_reports([pod_of("y", message(bad, at=R1_CREATED + 30))])[0]
    known = known_checkpoints(RUN, [carried], mine)
    status = {cp.step: cp.status for cp in known.report.checkpoints}
    assert status[1200] == CheckpointStatus.CORRUPTED and status[1100] == "valid"
    entry = last_verified(known.report)
    assert entry is not None and entry["step"] == 1100  # never the corrupted one
    # an older pod report (stale) cannot bring the valid verdict back either
    stale = pod_reports([pod_of("z", message(reported(rec), at=FAILED_AT - 1))])[0]
    again = known_checkpoints(RUN, [known.annotation], stale)
    assert {cp.step: cp.status for cp in again.report.checkpoints}[1200] == "corrupted"


def test_the_newest_report_drops_what_its_listing_no_longer_holds(rec: Any) -> None:
    carried = message(reported(rec), at=FAILED_AT)  # 1000, 1100, 1200 valid, 1250 corrupted
    old = rec("full", 500, created_at=FAILED_AT - 5000, manifest_hash="9" * 64)
    carried_old = message([old], at=FAILED_AT - 4000)  # left out of newer reports to fit
    # retention in the pod deleted 1100 and 1250; the report starts at 1000
    newer = [reported(rec)[0], reported(rec)[2]]
    mine = pod_reports([pod_of("y", message(newer, at=R1_CREATED + 30))])[0]
    known = known_checkpoints(RUN, [carried, carried_old], mine)
    assert [cp.step for cp in known.report.checkpoints] == [1200, 1000, 500]
    assert known.report.written_at == R1_CREATED + 30
    # a pod report older than what the job carries says nothing about what is gone
    late = known_checkpoints(RUN, [message(reported(rec), at=R1_CREATED + 60)], mine)
    assert [cp.step for cp in late.report.checkpoints] == [1250, 1200, 1100, 1000]
    # nor does an empty one
    empty = pod_reports([pod_of("e", message([], at=R1_CREATED + 90))])[0]
    assert len(known_checkpoints(RUN, [carried], empty).report.checkpoints) == 4


def test_reported_corrupted_checkpoints_fail_verification_in_the_ladder(rec: Any) -> None:
    records = CheckpointReport.from_records(
        RUN,
        [
            rec("full", 1000, created_at=1.0, manifest_hash="a" * 64),
            rec(
                "full",
                1100,
                status=CheckpointStatus.CORRUPTED,
                created_at=2.0,
                manifest_hash="b" * 64,
                prev_hash="a" * 64,
            ),
        ],
        10.0,
    ).records()
    source = ReportedCheckpointSource(records)
    listed = {r.id: r for r in source.list_checkpoints(RUN)}
    assert listed["full_step_000000001100"].status == CheckpointStatus.VALID  # keeps its place
    assert listed["full_step_000000001100"].prev_hash == "a" * 16
    assert source.verify(RUN, "full_step_000000001000")
    try:
        source.verify(RUN, "full_step_000000001100")
    except VerificationFailedError as e:
        assert "a pod found it corrupted" in str(e) and "the pod's verdict" in str(e)
    else:  # pragma: no cover
        raise AssertionError("a corrupted checkpoint verified")


@pytest.mark.parametrize("pin", [1200, 1150])
def test_blind_ladder_reaches_the_heartbeat_rung_from_the_reports(
    world: Any, fixture: Any, rec: Any, pin: int
) -> None:
    """The e2e ``heartbeat-rebuild`` with PVC storage: the first pod reported everything
    valid; r1 was pinned at the newest pulse, found it and the newest full corrupted (and
    the pulse between gone) and reported so before it failed. The operator's next plan skips
    them all at once and rebuilds from the heartbeat with the oldest full's weights.

    r1's failure on its pin is explained by the pin's corruption: the pin is not poisoned
    (that would take it out of the ladder, and with it the newest full's place: the ladder
    would resume from the oldest full instead of rebuilding from the heartbeat) but rejected
    where it stands. ``pin`` 1150: the newest checkpoint was the newest full."""
    world.source.unreachable = True

    def cp(tier: str, step: int, h: str, prev: str | None, **kw: Any) -> CheckpointRecord:
        out: CheckpointRecord = rec(
            tier,
            step,
            created_at=FAILED_AT - 2000 + step,
            manifest_hash=h * 64,
            prev_hash=prev * 64 if prev else None,
            **kw,
        )
        return out

    first = [
        cp("full", 1000, "a", None),
        cp("pulse", 1100, "b", "a"),
        cp("full", 1150, "c", "b"),
        cp("pulse", 1200, "d", "c"),
        rec("heartbeat", 1205, created_at=FAILED_AT - 700),
    ]
    corrupted = CheckpointStatus.CORRUPTED
    r1_saw = [
        cp("full", 1000, "a", None),
        cp("full", 1150, "c", "b", status=corrupted),
        cp("pulse", 1200, "d", "c", status=corrupted),
        rec("heartbeat", 1210, created_at=FAILED_AT - 600),
    ]
    if pin == 1150:
        first, r1_saw = [first[i] for i in (0, 1, 2, 4)], [r1_saw[i] for i in (0, 1, 3)]
    job = fixture("pytorchjob_r1_failed.json")
    job["metadata"]["annotations"][c.ANN_CHECKPOINTS] = message(first).strip()
    pinned = next(r.id for r in first if r.step == pin)
    job["metadata"]["annotations"][c.ANN_RESUME_FROM] = pinned
    job["metadata"]["annotations"][c.ANN_RESUME_STEP] = str(pin)
    job = world.api.add_job(job)
    world.api.add_pod(
        pod(fixture, "mnist-ddp-r1-worker-0", "mnist-ddp-r1", message(r1_saw, at=R1_CREATED + 20))
    )
    run(recover_job(world.deps, job))
    assert world.source.listed == [] and world.source.verified == []
    child = world.api.jobs[("ml-team", "mnist-ddp-r2")]["metadata"]["annotations"]
    assert child[c.ANN_RESUME_FROM] == "heartbeat_step_000000001210"
    assert child[c.ANN_RESUME_WEIGHTS] == "full_step_000000001000"
    assert pinned not in child.get(c.ANN_POISONED, "")
    reasons = world.events.reasons()
    assert "HeartbeatRebuild" in reasons and "CrashLoop" not in reasons
    rejected = [e.message for e in world.events.events if e.reason == "CheckpointRejected"]
    assert any(pinned in m and "a pod found it corrupted" in m for m in rejected), rejected
    carried = {e["s"]: e["st"] for e in json.loads(child[c.ANN_CHECKPOINTS])["cps"]}
    expected = {1210: "valid", 1200: "corrupted", 1150: "corrupted", 1000: "valid"}
    assert carried == {s: v for s, v in expected.items() if s <= pin or s == 1210}


def pod_of(name: str, msg: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {
            "containerStatuses": [{"name": "pytorch", "state": {"terminated": {"message": msg}}}]
        },
    }
