"""JIT saves across a lost node (#31): the dead rank's step heartbeat comes back from a peer.

Every rank of a 4-rank DDP job on its own node, each node's sidecar pushing its snapshots
and its ranks' step heartbeats to the next node (docs/replicas.md, "Just-in-time saves").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest
from test_jit import JIT, STALL_AT, STEPS, VICTIM, WORLD, _finals, _kill_mid_step, reference

from ckpt_agent.flash.replica.marks import MarkStore
from ckpt_e2e.api import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

__all__ = ["reference"]  # the fixture, shared with test_jit


def test_a_lost_node_costs_one_step_with_its_step_heartbeat_from_a_peer(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Every rank on its own node, each node's sidecar pushing its snapshots and step
    heartbeats to the next node. Rank 2's node is lost mid-step (the rank and its sidecar
    killed, its shared memory gone); the survivors save step 17; rank 2 is recreated on a
    fifth node, whose sidecar gets rank 2's step heartbeat (and its last pulse) back from
    node n3. Every rank resumes at step 18: one step lost to a node loss."""
    nodes = ["n0", "n1", "n2", "n3"]
    ports = {n: free_port() for n in [*nodes, "n4"]}
    marks_on_n3 = MarkStore(tmp_path / "shm.n3", w.RUN)

    def pushed() -> bool:  # rank 2's record of the step it finished is on its peer
        held = marks_on_n3.newest(VICTIM)
        return held is not None and held.record.heartbeat.step == STALL_AT - 1

    first = {**JIT, "replicated": {"nodes": nodes, "ports": ports}}
    out = _kill_mid_step(tmp_path, first, pushed)
    shutil.rmtree(tmp_path / "shm.n2")  # the node is lost with its memory
    again = {**JIT, "replicated": {"nodes": ["n0", "n1", "n4", "n3"], "ports": ports}}
    h.codes_ok(h.launch(w.train_ddp, WORLD, out, STEPS, again, timeout=150), out)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["action"] for r in resumed] == ["resume_shm"] * WORLD, resumed
    assert [r["step"] for r in resumed] == [STALL_AT] * WORLD  # one step lost
    assert all(r["exact"] for r in resumed), resumed
    assert [h.losses(out, r) for r in range(WORLD)] == reference["losses"]
    assert _finals(out) == reference["final"]
    events = (out / "work.sidecar.n4" / "sidecar.jsonl").read_text().splitlines()
    (restored,) = [e for e in map(json.loads, events) if e["event"] == "step_mark_restored"]
    assert (restored["rank"], restored["step"]) == (VICTIM, STALL_AT - 1), restored
