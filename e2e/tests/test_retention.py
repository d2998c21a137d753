"""Scenario 8: after a run, S3 (a real MinIO) holds exactly what the retention classes keep.

The policy stores checkpoints in a MinIO bucket; the pod gets the credentials through
``secretKeyRef`` and the operator reads the same Secret (its ``secrets get`` right).
While the run writes a pulse every 5 steps, the test records every ``COMMIT`` it sees
(with the retention class the agent assigned at save time). Expected contents are
computed from the rules, independently of the implementation: per tier, the newest
``importantKeep`` important and ``routineKeep`` routine checkpoints (and every critical
one). Then the policy is tightened with ``kubectl apply``; the *operator's* retention
loop deletes what no longer qualifies, collects the blobs nothing references, and the
policy status reports it.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest

from ckpt_agent.format.verify import verify_hashes
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import StorageView, Training, condition, events, s3_storage

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=90, seed=11, step_sleep=0.1)
# Only the loss layer scores (no anomalies, so no last-known-good pins): fast-descent
# checkpoints score 0.6 (important), the others 0.0 (routine).
SCHEDULER = {
    "loss": {"weight": 0.6, "spikeDecades": 10},
    "gradient": {"weight": 0.0, "stdMultiplier": 1000},
    "system": {"weight": 0.0, "writeLatencyMs": 100000},
}
RETENTION = {"criticalScore": 0.9, "importantScore": 0.5, "reconcileIntervalSeconds": 10}


class CommitRecorder:
    """Polls storage and keeps a copy of every COMMIT that ever appeared (some are deleted
    by retention soon after)."""

    def __init__(self, view: StorageView, run_id: str) -> None:
        self.view, self.run_id = view, run_id
        self.commits: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CommitRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                for info in self.view.storage.list(f"{self.run_id}/steps/"):
                    ckpt = info.key.split("/")[-2]
                    if info.key.endswith("/COMMIT") and ckpt not in self.commits:
                        self.commits[ckpt] = json.loads(self.view.storage.read(info.key))
            except Exception:
                pass  # deleted between list and read: it was seen in an earlier round
            self._stop.wait(0.1)


def expected_kept(
    commits: dict[str, dict[str, Any]], important_keep: int, routine_keep: int
) -> set[str]:
    """The retention classes, applied by hand: per tier, newest first."""
    kept: set[str] = set()
    for tier in {c["tier"] for c in commits.values()}:
        newest_first = sorted(
            (c for c in commits.values() if c["tier"] == tier), key=lambda c: -c["step"]
        )
        quota = {"critical": len(newest_first), "important": important_keep}
        quota["routine"] = routine_keep
        for c in newest_first:
            cls = c["retention_class"]
            if quota[cls] > 0:
                quota[cls] -= 1
                kept.add(c["checkpoint_id"])
    return kept


def stored(view: StorageView, run_id: str) -> set[str]:
    return {r.id for r in view.checkpoints(run_id)}


def test_storage_holds_exactly_what_the_retention_classes_keep(
    scenario: Scenario, minio: Any
) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    bucket = f"ckpt-e2e-{uuid.uuid4().hex[:10]}"
    minio.client().create_bucket(Bucket=bucket)
    cluster.kubectl(
        "create",
        "secret",
        "generic",
        "s3-creds",
        "-n",
        ns,
        f"--from-literal=AWS_ACCESS_KEY_ID={minio.access_key}",
        f"--from-literal=AWS_SECRET_ACCESS_KEY={minio.secret_key}",
    )
    storage = s3_storage(bucket, minio.endpoint, "s3-creds", prefix="team-a")
    keep = {"importantKeep": 2, "routineKeep": 3}
    scenario.apply_policy(
        "e2e",
        storage,
        pulse_every=5,
        full_every=30,
        scheduler=SCHEDULER,
        retention=RETENTION | keep,
    )
    view = scenario.view(
        f"s3://{bucket}/team-a",
        options=minio.storage_options(),
    )
    runner = scenario.runner()
    scenario.submit("long", TRAINING)
    run = runner.wait_run("long")
    run_id = scenario.run_id("long")
    env = {e["name"]: e for e in run.pod["spec"]["containers"][0]["env"]}
    assert env["CKPT_STORAGE_URL"]["value"] == f"s3://{bucket}/team-a"
    assert env["CKPT_S3_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"

    with CommitRecorder(view, run_id) as recorder:
        assert run.wait(240) == 0, run.local.log_text()[-3000:] if run.local else ""
        assert condition(scenario.wait_finished("long"), "Succeeded") is not None
        recorder._stop.wait(1.0)  # one more round after the last commit
    commits = recorder.commits
    history = sorted((c["step"], c["tier"], c["retention_class"]) for c in commits.values())
    print("checkpoints written (step, tier, class):", history)
    classes = sorted({c["retention_class"] for c in commits.values()})
    assert {"important", "routine"} <= set(classes), history
    assert all(c["anomaly"] is None and not c["lightweight"] for c in commits.values())
    assert len(commits) >= 8, history

    # 1. the run's own storage after the run: exactly the classes' picks
    assert stored(view, run_id) == expected_kept(commits, **_keeps(keep))

    # the operator's view agrees (policy status, written by its retention loop)
    def status_counts() -> dict[str, Any] | None:
        pol = cluster.get_json("checkpointpolicy", "e2e", "-n", ns)
        st = pol.get("status") or {}
        return st if st.get("checkpoints") == len(stored(view, run_id)) else None

    cluster.wait_for(status_counts, timeout=60, what="policy status counting the run")

    # 2. tighten the policy: the operator deletes what no longer qualifies
    keep = {"importantKeep": 1, "routineKeep": 1}
    before = cluster.get_json("checkpointpolicy", "e2e", "-n", ns)["status"]
    scenario.apply_policy(
        "e2e",
        storage,
        pulse_every=5,
        full_every=30,
        scheduler=SCHEDULER,
        retention=RETENTION | keep,
        metrics_port=int(
            cluster.get_json("checkpointpolicy", "e2e", "-n", ns)["spec"]["agent"]["metricsPort"]
        ),
    )
    want = expected_kept(commits, **_keeps(keep))
    cluster.wait_for(
        lambda: stored(view, run_id) == want,
        timeout=90,
        what=f"the operator's retention leaving exactly {sorted(want)}",
    )
    applied = cluster.wait_for(
        lambda: events(cluster, ns, name="e2e", reason="RetentionApplied"),
        timeout=30,
        what="RetentionApplied Event",
    )
    assert isinstance(applied, list) and run_id in applied[-1]["message"]

    # the newest valid checkpoint of each tier survived and still verifies byte for byte
    for ckpt in want:
        assert verify_hashes(view.storage, run_id, ckpt).ok, ckpt
    # no blob left that nothing references (the operator's GC), none missing
    referenced: set[str] = set()
    for info in view.storage.list(f"{run_id}/steps/"):
        if info.key.split("/")[-1].startswith("rank_"):
            referenced |= set(json.loads(view.storage.read(info.key))["blobs"])
    blobs = {i.key.split("/")[-1] for i in view.storage.list(f"{run_id}/blobs/")}

    def gc_done() -> bool:
        return {i.key.split("/")[-1] for i in view.storage.list(f"{run_id}/blobs/")} == referenced

    cluster.wait_for(gc_done, timeout=60, what="unreferenced blobs collected")
    assert referenced <= blobs

    def final_status() -> dict[str, Any] | None:
        st = cluster.get_json("checkpointpolicy", "e2e", "-n", ns).get("status") or {}
        return st if st.get("checkpoints") == len(want) else None

    status = cluster.wait_for(final_status, timeout=60, what="policy status after retention")
    assert isinstance(status, dict)
    assert status["deletedByRetention"] > before.get("deletedByRetention", 0)
    assert status["validCheckpoints"] == len(want)
    newest = max(
        (c for c in commits.values() if c["checkpoint_id"] in want), key=lambda c: c["step"]
    )
    assert status["lastValid"][run_id]["checkpointId"] == newest["checkpoint_id"]
    reconciled = {c["type"]: c for c in status["conditions"]}["Reconciled"]
    assert reconciled["status"] == "True"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert {"Ready", "Reconciled"} <= set(conditions), conditions
    # the tenancy and agent checks add their own conditions: both must be healthy
    assert conditions.get("StorageAccess", "True") == "True", conditions
    assert conditions.get("AgentReporting", "True") == "True", conditions
    assert set(conditions) <= {"Ready", "Reconciled", "StorageAccess", "AgentReporting"}


def _keeps(keep: dict[str, int]) -> dict[str, int]:
    return {"important_keep": keep["importantKeep"], "routine_keep": keep["routineKeep"]}
