"""Reading recorded PyTorchJobs."""

from __future__ import annotations

import json
from typing import Any

from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import JobStatusAnnotation, job_facts, owner_job_name, run_id_of


def test_running_job(fixture: Any) -> None:
    f = job_facts(fixture("pytorchjob_running.json"))
    assert (f.name, f.namespace, f.policy, f.auto_resume) == (
        "mnist-ddp",
        "ml-team",
        "llm-finetune",
        True,
    )
    assert f.run_id == "mnist-ddp-5f0c6a7e"  # from name + uid until annotated
    assert not f.failed and not f.succeeded and not f.needs_recovery
    assert f.restart_count == 0 and f.resume_from is None and f.status is None


def test_failed_job(fixture: Any) -> None:
    f = job_facts(fixture("pytorchjob_failed.json"))
    assert f.failed and f.needs_recovery
    assert f.failure_message == "PyTorchJob mnist-ddp is failed because 1 Worker replica(s) failed."
    assert f.failed_at is not None and f.status is not None and f.status.state == "Watching"


def test_restarted_job(fixture: Any) -> None:
    f = job_facts(fixture("pytorchjob_r1_failed.json"))
    assert f.restart_count == 1 and f.resume_from == "pulse_step_000000001200"
    assert f.resume_step == 1200 and f.run_id == "mnist-ddp-5f0c6a7e"


def test_succeeded_job_never_needs_recovery(fixture: Any) -> None:
    job = fixture("pytorchjob_succeeded.json")
    assert job_facts(job).succeeded and not job_facts(job).needs_recovery


def test_run_id_prefers_the_annotation(fixture: Any) -> None:
    job = fixture("pytorchjob_running.json")
    job["metadata"]["annotations"][c.ANN_RUN_ID] = "shared-run"
    assert run_id_of(job) == "shared-run"


def test_owner_of_a_training_operator_pod(fixture: Any) -> None:
    pod = fixture("admission_review_pod.json")["request"]["object"]
    assert owner_job_name(pod) == "mnist-ddp"
    pod["metadata"]["ownerReferences"] = []
    assert owner_job_name(pod) == "mnist-ddp"  # from the label
    pod["metadata"]["labels"] = {}
    assert owner_job_name(pod) is None


def test_garbage_annotations_are_tolerated(fixture: Any) -> None:
    job = fixture("pytorchjob_failed.json")
    job["metadata"]["annotations"].update(
        {c.ANN_RESTART_COUNT: "many", c.ANN_STATUS: "{not json", c.ANN_RESTART_DECISION: "[]"}
    )
    f = job_facts(job)
    assert f.restart_count == 0 and f.status is None and f.restart_decision is None


def test_status_annotation_round_trip() -> None:
    s = JobStatusAnnotation("GaveUp", "LadderExhausted", "nothing verified", "2024-05-02T11:00:00Z")
    assert JobStatusAnnotation.parse(s.to_json()) == s
    assert json.loads(s.to_json())["state"] == "GaveUp"
