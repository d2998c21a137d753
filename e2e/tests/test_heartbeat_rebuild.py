"""Scenario ``heartbeat-rebuild``: the ladder's heartbeat rung, end to end (issue #11 item 3).

Every weights-bearing checkpoint newer than the oldest full one is corrupted (the
newest full and everything after it rot a byte; those between are gone, so the
prev-hash chain from the newest ends before the oldest full). The checkpoints live on a
PVC the operator cannot read (``Scenario.pvc_storage``): it knows only what the pods
report in their termination messages, and the first pod, frozen and killed after the
damage, reported them all as verified. So:

1. the operator restarts ``train`` as ``train-r1`` from the newest reported checkpoint;
2. ``train-r1``'s agent finds its pin corrupted, tries the checkpoints the ladder would
   take next (corrupted too, or gone), reports the verdicts and fails the start;
3. from that report alone the operator walks the ladder down to rung 3: the newest
   heartbeat's step, data position and RNG with the oldest full checkpoint's weights.
   ``train-r2``'s pods get both (``CKPT_RESUME_FROM`` = the heartbeat,
   ``CKPT_RESUME_WEIGHTS`` = the full one); the run continues at the heartbeat's step,
   marked not exact, and the job carries a Warning Event.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.format.termination import parse_report
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_e2e.kubelet import PodRun
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import Training, annotations_of, events, result_path

from .test_recovery import _unique_blob

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=90, seed=11, step_sleep=0.1)


def _reported(run: PodRun) -> set[str]:
    """The checkpoints the pod's termination message names as verified."""
    assert run.local is not None
    text = run.local.termination_log.read_bytes()
    report = parse_report(text) if text.strip() else None
    return {c.id for c in report.checkpoints if c.status == "valid"} if report else set()


def test_heartbeat_rebuild_continues_at_the_heartbeat_step_not_exact(
    scenario: Scenario,
) -> None:
    assert not Path(scenario.pod_only_path).exists()
    scenario.apply_policy(
        "e2e",
        storage=scenario.pvc_storage(),
        pulse_every=5,
        full_every=10,
        retention={"importantKeep": 50, "routineKeep": 50},
        recovery={"backoffSeconds": 0},
    )
    view = scenario.view()  # the test may look at the claim's folder; the operator cannot
    runner = scenario.runner()
    scenario.submit("train", TRAINING)
    first = runner.wait_run("train")
    run_id = scenario.run_id("train")

    def enough() -> bool:
        assert first.running, first.local and first.local.log_text()
        valid = view.valid(run_id)
        fulls = [r for r in valid if r.tier == Tier.FULL]
        return len(fulls) >= 3 and valid[-1].step >= fulls[-1].step + 3

    scenario.cluster.wait_for(enough, timeout=150, what="three valid full checkpoints")
    assert first.local is not None
    # Freeze the trainer at an instant where the newest heartbeat is ahead of the
    # newest checkpoint: a stop can land on a step that saved both (pulse step ==
    # heartbeat step), so let it run on a moment and freeze again when it did. Nor may
    # a checkpoint be committed and not yet validated (r1's agent would verify it: a
    # good checkpoint newer than the damage), nor the newest not yet reported.
    for _ in range(30):
        first.local.signal_container(signal.SIGSTOP)  # nothing new is written from here
        listed = view.checkpoints(run_id, heartbeat=True)
        valid = view.valid(run_id)
        fulls = [r for r in valid if r.tier == Tier.FULL]
        beats = [r for r in listed if r.tier == Tier.HEARTBEAT]
        heartbeat = max(beats, key=lambda r: r.step)
        settled = all(r.status == CheckpointStatus.VALID for r in listed)
        if heartbeat.step > valid[-1].step and settled and valid[-1].id in _reported(first):
            break
        first.local.signal_container(signal.SIGCONT)
        time.sleep(0.3)
    else:
        pytest.fail("the trainer never froze at a settled point (30 tries)")
    oldest, newest_full = fulls[0], fulls[-1]
    assert heartbeat.step > valid[-1].step >= newest_full.step > oldest.step
    steps = scenario.store / run_id / "steps"
    for r in valid:
        if r.step <= oldest.step:
            continue
        if r.step >= newest_full.step:  # listed, fails verification
            blob = _unique_blob(scenario.store, run_id, r.id)
            data = bytearray(blob.read_bytes())
            data[len(data) // 2] ^= 0xFF
            blob.write_bytes(bytes(data))
        else:  # gone: the chain from the newest ends here
            shutil.rmtree(steps / r.id)
    first.local.kill()
    first.local.signal_container(signal.SIGCONT)
    assert first.wait(30) == 137
    damaged = {r.id for r in valid if r.step > oldest.step}
    assert damaged <= _reported(first)  # the pod's last word: all of them verified

    # 1. blind, the operator restarts from the newest checkpoint the pod reported verified
    r1 = scenario.wait_restart("train")
    pin = annotations_of(r1)["ckpt.dev/resume-from"]
    assert pin in damaged, pin
    # 2. r1's agent finds it corrupted, probes the ladder, reports the verdicts, fails
    run1 = runner.wait_run(r1["metadata"]["name"])
    assert run1.wait(120) != 0
    assert run1.local is not None
    verdicts = parse_report(run1.local.termination_log.read_bytes())
    status = {c.id: c.status for c in verdicts.checkpoints}
    assert status[pin] == CheckpointStatus.CORRUPTED, status
    assert status[newest_full.id] == CheckpointStatus.CORRUPTED, status
    assert status[oldest.id] == CheckpointStatus.VALID and status[heartbeat.id] == "valid"
    assert not damaged & {i for i, s in status.items() if s == CheckpointStatus.VALID}
    assert all(c.verdict_at > 0 for c in verdicts.checkpoints if c.status == "corrupted")

    # 3. from the reports alone: the heartbeat rung
    restart = scenario.wait_restart("train-r1")
    ann = annotations_of(restart)
    assert ann["ckpt.dev/resume-from"] == heartbeat.id, ann
    assert ann["ckpt.dev/resume-weights"] == oldest.id, ann
    decision = json.loads(annotations_of(scenario.job("train-r1"))["ckpt.dev/restart-decision"])
    assert decision["action"] == "rebuild_from_heartbeat"
    warning = events(
        scenario.cluster, scenario.namespace, name="train-r1", reason="HeartbeatRebuild", wait=30
    )
    assert warning and warning[0]["type"] == "Warning", warning
    assert "not exact" in warning[0]["message"] and oldest.id in warning[0]["message"]

    second = runner.wait_run(restart["metadata"]["name"])
    env = {e["name"]: e.get("value") for e in second.pod["spec"]["containers"][0]["env"]}
    assert (env["CKPT_RESUME_FROM"], env["CKPT_RESUME_WEIGHTS"]) == (heartbeat.id, oldest.id)
    assert second.wait(180) == 0, second.local.log_text()[-3000:] if second.local else ""
    res: dict[str, Any] = json.loads(result_path(scenario.results, second.pod).read_text())
    assert res["first_step"] == heartbeat.step + 1
    assert res["resume"]["checkpoint_id"] == heartbeat.id
    assert res["resume"]["exact"] is False
    assert res["resume"]["action"] == "resume_from"
    assert not Path(scenario.pod_only_path).exists()  # the operator never saw the storage
