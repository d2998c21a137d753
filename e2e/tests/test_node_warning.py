"""Scenario: a node warning shortens the pulse interval; its clearing relaxes it again.

The job runs on its own kwok node under a policy sized for a realistic failure rate
(``mtbfSeconds`` one hour, half the failures announced by a warning): while calm the
pulse interval is the Young/Daly optimum for the unannounced failures, long. ``kubectl
cordon`` makes the operator relay a node *warning* through ``ckpt.dev/save-now`` (the
harness refreshes the downward-API file like the kubelet): the agent saves once (one
emergency save per warning episode, however long it holds) and sizes its interval for a
failure expected within ``warningMtbfSeconds`` — much shorter — at every step while the
warning holds (a warning older than ``warningMtbfSeconds`` decays; this one is younger).
``kubectl uncordon`` makes the operator clear it; the interval relaxes
``warningHoldSeconds`` later. All of it is read back from the pod's
decision log (``$CKPT_WORK_DIR/decisions.rank0.jsonl``), where every decision records the
hazard it was sized for and the warning that held.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from ckpt_e2e.scenario import Scenario
from ckpt_e2e.training import Training, events
from ckpt_operator.model.constants import WORK_DIR

pytestmark = pytest.mark.e2e

TRAINING = Training(steps=220, seed=11, step_sleep=0.2)
HOLD_S = 4.0
"""``risk.warningHoldSeconds``: short, so the relaxing is seen within the run."""
RISK = {
    "mtbfSeconds": 3600,
    "warnedFraction": 0.5,
    "warningMtbfSeconds": 120,
    "warningHoldSeconds": HOLD_S,
}


def _decisions(path: Any) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:  # a line being written
            continue
        if e.get("event") == "decision":
            out.append(e)
    return out


def test_cordon_shortens_the_pulse_interval_and_uncordon_relaxes_it(scenario: Scenario) -> None:
    cluster, ns = scenario.cluster, scenario.namespace
    node = f"kwok-warn-{uuid.uuid4().hex[:5]}"
    cluster.create_node(node, labels={"e2e.ckpt.dev/pool": node})
    try:
        scenario.apply_policy(
            "e2e",
            full_every=1000,
            extra={
                "tiers": {
                    "heartbeat": {"everySteps": 1},
                    # the first pulse (step 10) measures its cost; then Young/Daly sizes it
                    "pulse": {"baseInterval": 10, "minInterval": 2, "maxInterval": 1000},
                    "full": {"everySteps": 1000},
                },
                # the node warning's alarm alone: on a loaded machine every small fsync'd
                # write can take over 15 ms for 5 s, the system layer's own latency alarm
                # (a separate episode, with its own emergency save; not this test's subject)
                "scheduler": {"risk": RISK, "system": {"writeLatencyMs": 60_000}},
            },
        )
        runner = scenario.runner()
        scenario.submit("train", TRAINING, node_selector={"e2e.ckpt.dev/pool": node})
        first = runner.wait_run("train")
        assert first.pod["spec"]["nodeName"] == node and first.local is not None
        log = first.local.local_path(f"{WORK_DIR}/decisions.rank0.jsonl")
        scenario.wait_step(first, 40)

        def pod_event(reason: str) -> None:
            cluster.wait_for(
                lambda: events(cluster, ns, name=first.name, reason=reason),
                timeout=30,
                what=f"{reason} on the pod",
            )

        # 1. cordon: a warning, relayed to the pod; the agent saves once and the hazard rises
        t_cordon = time.time()
        cluster.kubectl("cordon", node)
        pod_event("SaveNowRequested")
        pod = cluster.get_json("pod", first.name, "-n", ns)
        assert " warning " in pod["metadata"]["annotations"]["ckpt.dev/save-now"]
        warned_at = cluster.wait_for(
            lambda: [d for d in _decisions(log) if d["warning"] and d["time"] >= t_cordon],
            timeout=30,
            what="a decision sized for the node warning",
        )
        scenario.wait_step(first, warned_at[0]["step"] + 15)

        # 2. uncordon: the operator clears the warning; it lapses HOLD_S later
        t_uncordon = time.time()
        cluster.kubectl("uncordon", node)
        pod_event("NodeWarningCleared")
        relaxed_at = cluster.wait_for(
            lambda: [
                d for d in _decisions(log) if d["time"] > t_uncordon + HOLD_S and not d["warning"]
            ],
            timeout=60,
            what="a calm decision after the warning lapsed",
        )
        assert first.wait(180) == 0, first.local.log_text()[-3000:]
        decisions = _decisions(log)

        calm = [d for d in decisions if d["time"] < t_cordon and d["interval_rule"] != "base"]
        assert calm, "the pulse cost was measured before the cordon"
        warned = [d for d in decisions if d["warning"]]
        after = [d for d in decisions if d["step"] >= relaxed_at[0]["step"]]
        assert all(not d["warning"] for d in after)
        # within a few steps of the cordon the warning holds, with an emergency save
        steps_before = [d["step"] for d in decisions if d["time"] < t_cordon]
        assert warned[0]["step"] - max(steps_before) <= 40
        assert any(d["emergency"] and "save-now" in d["reason"] for d in warned)
        # once per request: the warning that holds at every step is one episode, not a
        # system alarm that saves again (each new request id, e.g. a taint after the
        # cordon, is a new episode and carries "save-now")
        again = [d for d in warned if d["emergency"] and "save-now" not in d["reason"]]
        assert not again, [(d["step"], d["reason"]) for d in again]
        assert "cordon" in warned[0]["warning"] or "unschedulable" in warned[0]["warning"]
        # the hazard: 1 − warned share while calm, mtbf / warningMtbf while warned
        assert calm[-1]["hazard"] == pytest.approx(0.5)
        assert warned[-1]["hazard"] == pytest.approx(3600 / 120)
        assert after[-1]["hazard"] == pytest.approx(0.5)
        # the interval: sqrt(60) ≈ 7.7x shorter while warned (less the system score), back after
        calm_interval, warned_interval = calm[-1]["interval"], warned[-1]["interval"]
        assert warned_interval * 3 <= calm_interval, (calm_interval, warned_interval)
        assert after[-1]["interval"] >= 3 * warned_interval, (after[-1], warned_interval)
        assert "Traceback" not in first.local.log_text()
    finally:
        cluster.kubectl("delete", "node", node, "--ignore-not-found", check=False)
