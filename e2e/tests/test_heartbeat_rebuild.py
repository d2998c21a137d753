"""Scenario ``heartbeat-rebuild``: the ladder's heartbeat rung, end to end (issue #11 item 3).

Every weights-bearing checkpoint newer than the oldest full one is corrupted (the
newest full and everything after it rot a byte; those between are gone, so the
prev-hash chain from the newest ends before the oldest full). The operator walks
the ladder down to rung 3: the newest heartbeat's step, data position and RNG with
the oldest full checkpoint's weights. The restarted pods get both
(``CKPT_RESUME_FROM`` = the heartbeat, ``CKPT_RESUME_WEIGHTS`` = the full one); the
run continues at the heartbeat's step, marked not exact, and the job carries a
Warning Event.

This scenario keeps its checkpoints on a volume the operator reads too
(``Scenario.local_storage``): rung 3 is chosen because the operator re-verifies the chain.
Blind to the storage it plans from the pods' reports, which still list the damaged
checkpoints as verified; it would restart from each in turn (one crash loop each) and
never reach the heartbeat rung (see docs/testing.md, "Blind scenarios").
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from typing import Any

import pytest

from ckpt_agent.records import Tier
from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import Training, annotations_of, events, result_path

from .test_recovery import _unique_blob

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=90, seed=11, step_sleep=0.1)


def test_heartbeat_rebuild_continues_at_the_heartbeat_step_not_exact(
    scenario: Scenario,
) -> None:
    scenario.apply_policy(
        "e2e",
        pulse_every=5,
        full_every=10,
        retention={"importantKeep": 50, "routineKeep": 50},
        recovery={"backoffSeconds": 0},
    )
    view = scenario.view()
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
    # heartbeat step), so let it run on a moment and freeze again when it did.
    for _ in range(20):
        first.local.signal_container(signal.SIGSTOP)  # nothing new is written from here
        valid = view.valid(run_id)
        fulls = [r for r in valid if r.tier == Tier.FULL]
        beats = [r for r in view.checkpoints(run_id, heartbeat=True) if r.tier == Tier.HEARTBEAT]
        heartbeat = max(beats, key=lambda r: r.step)
        if heartbeat.step > valid[-1].step:
            break
        first.local.signal_container(signal.SIGCONT)
        time.sleep(0.3)
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

    restart = scenario.wait_restart("train")
    ann = annotations_of(restart)
    assert ann["ckpt.dev/resume-from"] == heartbeat.id, ann
    assert ann["ckpt.dev/resume-weights"] == oldest.id, ann
    decision = json.loads(annotations_of(scenario.job("train"))["ckpt.dev/restart-decision"])
    assert decision["action"] == "rebuild_from_heartbeat"
    warning = events(scenario.cluster, scenario.namespace, name="train", reason="HeartbeatRebuild")
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
