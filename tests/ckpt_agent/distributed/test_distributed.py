"""Multi-rank agreement, two-phase commit, exact DDP resume and SIGTERM (real gloo jobs)."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest

from ckpt_agent.flash.area import ShmArea
from ckpt_agent.flash.replica.store import ReplicaStore
from ckpt_agent.format import jsontree
from ckpt_agent.format.layout import commit_key, rank_manifest_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.persist.validate import Validator
from ckpt_agent.policy.models import Tier, ValidationSpec
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage.fs import LocalStorage
from ckpt_e2e.api import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

STEPS = 30
HOLD_AT = 17
"""test_ddp_resume_after_sigkill_is_bitwise_exact holds both ranks before this step."""


def _persister_logs(out: Path) -> str:
    """What the persisters said (their log and events, tails): for a failed assertion."""
    parts = []
    for path in sorted((out / "work").glob("sidecar*")):
        if path.suffix in (".log", ".jsonl"):
            lines = path.read_text(errors="replace").splitlines()[-25:]
            parts.append(f"== {path.name}\n" + "\n".join(line[:400] for line in lines))
    return "\n".join(parts) or "(no persister logs)"


def _storage(root: Path) -> LocalStorage:
    return LocalStorage(root / "store")


_losses = h.losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 2-rank DDP run without checkpointing (what every resumed run must reproduce)."""
    out = tmp_path_factory.mktemp("reference") / "job"
    codes = h.launch(w.train_ddp, 2, out, STEPS, {"checkpoint": False}, timeout=120)
    h.codes_ok(codes, out)
    return {
        "losses": [_losses(out, r) for r in range(2)],
        "final": [json.loads((out / f"final.rank{r}.json").read_text()) for r in range(2)],
    }


def test_agreement_under_skewed_losses_and_restart(tmp_path: Path) -> None:
    """Per-rank losses differ (a spike on one rank only, a save-now signal on one rank):
    every rank takes the same decision at every step, every checkpoint has both parts,
    and after a restart (profiles swapped between ranks) both schedulers start from the
    same saved state and keep agreeing."""
    out1 = tmp_path / "phase1"
    h.codes_ok(h.launch(w.agree, 2, out1, 0, 40, False, timeout=120), out1)
    r = [json.loads((out1 / f"agree.rank{i}.json").read_text()) for i in range(2)]
    assert r[0]["decisions"] == r[1]["decisions"]
    # every counter agrees; only the locally measured costs (stall, persist, step time) differ
    local = {"costs", "step_time"}
    assert {k: v for k, v in r[0]["final"].items() if k not in local} == {
        k: v for k, v in r[1]["final"].items() if k not in local
    }
    saved = [d for d in r[0]["decisions"] if d["save"] and d["tier"] in ("pulse", "full")]
    assert len(saved) >= 3
    # the loss spike on rank 1 is seen by both (mean loss) and the signal on rank 1 makes
    # both take an emergency full checkpoint at step 25
    by_step = {d["step"]: d for d in r[0]["decisions"]}
    assert by_step[32]["anomaly"] == "loss_spike"
    assert by_step[25]["tier"] == "full" and by_step[25]["emergency"]
    assert "rank(s) [1]" in by_step[25]["reason"]

    store = _storage(tmp_path)
    records = [x for x in list_checkpoints(store, w.RUN) if x.tier != Tier.HEARTBEAT]
    assert {x.step for x in records} >= {d["step"] for d in saved[-3:]}
    for rec in records:
        assert rec.world_size == 2
        committed, m0 = read_checkpoint(store, w.RUN, rec.id, 0)
        assert [ref.rank for ref in committed.commit.ranks] == [0, 1]
        _, m1 = read_checkpoint(store, w.RUN, rec.id, 1)
        assert "model" in m0.meta.sections and "scheduler" in m0.meta.sections
        assert set(m1.meta.sections) == {"progress", "rng"}  # shared state written once
        assert rec.status == CheckpointStatus.VALID
    # rank 0's `committed` events count every rank's bytes (the report's per-save row)
    logs = [(out1 / "work" / f"decisions.rank{i}.jsonl").read_text().splitlines() for i in (0, 1)]
    done = [{e["checkpoint"]: e for e in map(json.loads, log) if e["event"] == "committed"}
            for log in logs]  # fmt: skip
    for rec in records:
        raw = read_checkpoint(store, w.RUN, rec.id, 0)[0].commit.raw_bytes
        assert done[0][rec.id]["raw_bytes"] == raw > done[1][rec.id]["raw_bytes"] > 0
        assert done[0][rec.id]["bytes_new"] > rec.size_bytes  # the parts + the COMMIT

    # restart: the loss profiles swap ranks; both start from rank 0's saved scheduler state
    out2 = tmp_path / "phase2"
    h.codes_ok(h.launch(w.agree, 2, out2, 0, 60, True, timeout=120), out2)
    q = [json.loads((out2 / f"agree.rank{i}.json").read_text()) for i in range(2)]
    assert q[0]["resume"] == q[1]["resume"] == records[-1].step + 1
    assert q[0]["after_start"] == q[1]["after_start"]
    _, m0 = read_checkpoint(store, w.RUN, records[-1].id, 0)
    saved_state = jsontree.decode(m0.state["scheduler"])
    assert isinstance(saved_state, dict)
    saved_state["last_now"] = None
    assert q[0]["after_start"] == saved_state
    assert q[0]["decisions"] == q[1]["decisions"]


def test_rank_killed_mid_save_leaves_previous_valid_and_no_commit(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while publishing its part of the third checkpoint: rank 0 never
    commits it (the vote fails), the second checkpoint stays valid."""
    out = tmp_path / "job"
    # every agreed save is taken (a loaded machine must not defer the third one past the run)
    opts = {
        "kill_rank": 1,
        "kill_suffix": "/rank_00001.json",
        "kill_after": 2,
        "backpressure": "wait",
    }
    codes = h.launch(w.train_ddp, 2, out, STEPS, opts, timeout=120)
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0  # rank 0 fails too (its collectives lose the peer)
    store = _storage(tmp_path)
    records = [x for x in list_checkpoints(store, w.RUN) if x.tier != Tier.HEARTBEAT]
    assert len(records) == 2, [x.id for x in records]
    folders = {i.key.split("/")[2] for i in store.list(f"{w.RUN}/steps/") if "/steps/" in i.key}
    started = sorted(folders - {x.id for x in records})
    # the third save: parts maybe written, never committed; on a loaded machine rank 0 may
    # not have written its part yet when rank 1 dies at its first write, so no folder at all
    assert len(started) <= 1, started
    for third in started:
        assert not store.exists(commit_key(w.RUN, third))
        assert not store.exists(rank_manifest_key(w.RUN, third, 1))
    prev = records[-1]
    assert prev.status in (CheckpointStatus.VALID, CheckpointStatus.PENDING)
    v = Validator(store, w.RUN, ValidationSpec(load_in_subprocess=False))
    for rank in (0, 1):
        assert v.validate(prev.id, rank=rank).valid


def test_ddp_resume_after_sigkill_is_bitwise_exact(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Kill a rank of a 2-rank DDP run mid-training, restart both: the stitched losses of
    both ranks and the final parameters equal the uninterrupted run's, bit for bit."""
    out = tmp_path / "job"

    def committed() -> bool:
        store = _storage(tmp_path)
        return any(r.tier != Tier.HEARTBEAT for r in list_checkpoints(store, w.RUN))

    def kill_later(job: h.Job) -> None:
        # Both ranks hold before step HOLD_AT until rank 1 is killed, so the kill lands
        # mid-run however fast or slow the machine is; and only after a checkpoint
        # committed: under load the background commit of the first pulses can still be in
        # flight when the ranks reach the hold (a kill then leaves nothing to resume from).
        deadline = time.monotonic() + 90
        while job.running() and time.monotonic() < deadline:
            if len(_losses(out, 1)) >= HOLD_AT and committed():
                break
            time.sleep(0.01)
        job.kill(1)
        (out / "hold").unlink()  # rank 0 goes on and fails at its next collective

    out.mkdir(parents=True)
    (out / "hold").touch()
    codes = h.launch(
        w.train_ddp, 2, out, STEPS, {"hold_at": HOLD_AT}, timeout=120, during=kill_later
    )
    assert codes[1] == -signal.SIGKILL
    assert len(_losses(out, 1)) == HOLD_AT  # killed while held
    assert len(_losses(out, 0)) < STEPS
    h.codes_ok(h.launch(w.train_ddp, 2, out, STEPS, {}, timeout=120), out)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(2)]
    assert resumed[0]["step"] == resumed[1]["step"] > 0
    assert resumed[0]["exact"] and resumed[1]["exact"]
    for rank in range(2):
        assert _losses(out, rank) == reference["losses"][rank]
        got = json.loads((out / f"final.rank{rank}.json").read_text())
        assert got == reference["final"][rank]


def test_a_lost_nodes_rank_resumes_from_its_peers_replica_bitwise(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """Two ranks, each on its own node with a sidecar that pushes its snapshots to the other
    node (#31). Rank 1's node is lost (the rank SIGKILLed with its sidecar, its shared
    memory gone); both ranks restart: rank 0 in place on its node, rank 1 recreated on a
    third node, whose sidecar fetches rank 1's replica from rank 0's node. Both resume from
    memory at the same step (the in-place restart), and the stitched losses and the final
    parameters equal the uninterrupted run's, bit for bit."""
    out = tmp_path / "job"
    ports = {n: free_port() for n in ("n0", "n1", "n2")}
    replicas_on_n0 = ReplicaStore(tmp_path / "shm.n0", w.RUN)

    def newest(node: str, rank: int) -> int | None:
        desc = ShmArea(tmp_path / f"shm.{node}", w.RUN, rank).latest()
        return None if desc is None else desc.step

    def kill_when_replicated(job: h.Job) -> None:
        # both ranks hold before HOLD_AT; rank 1 is killed once its newest snapshot is
        # replicated on n0 and rank 0 holds the same save (the in-place restart's common one)
        deadline = time.monotonic() + 90
        while job.running() and time.monotonic() < deadline:
            held = {r.rank: r.desc.step for r in replicas_on_n0.replicas()}
            ready = len(_losses(out, 1)) >= HOLD_AT and held.get(1) is not None
            if ready and held[1] == newest("n1", 1) == newest("n0", 0):
                break
            time.sleep(0.02)
        job.kill(1)
        (out / "hold").unlink()

    out.mkdir(parents=True)
    (out / "hold").touch()
    first = {"replicated": {"nodes": ["n0", "n1"], "ports": ports}, "hold_at": HOLD_AT}
    codes = h.launch(w.train_ddp, 2, out, STEPS, first, timeout=120, during=kill_when_replicated)
    assert codes[1] == -signal.SIGKILL
    replicated = {r.rank: r.desc.step for r in replicas_on_n0.replicas()}[1]
    shutil.rmtree(tmp_path / "shm.n1")  # node n1 is lost with its shared memory
    again = {"replicated": {"nodes": ["n0", "n2"], "ports": ports}}
    h.codes_ok(h.launch(w.train_ddp, 2, out, STEPS, again, timeout=120), out)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(2)]
    assert [r["action"] for r in resumed] == ["resume_shm", "resume_shm"], resumed
    assert resumed[0]["step"] == resumed[1]["step"] == replicated + 1
    assert resumed[0]["exact"] and resumed[1]["exact"]
    for rank in range(2):
        assert _losses(out, rank) == reference["losses"][rank]
        got = json.loads((out / f"final.rank{rank}.json").read_text())
        assert got == reference["final"][rank]
    events = (out / "work.sidecar.n2" / "sidecar.jsonl").read_text().splitlines()
    (rehydrated,) = [e for e in map(json.loads, events) if e["event"] == "rehydrated"]
    assert (rehydrated["rank"], rehydrated["step"], rehydrated["source"]) == (1, replicated, "n1")


def test_sigterm_on_one_rank_saves_everywhere_and_stops(tmp_path: Path) -> None:
    """SIGTERM to rank 1 only: both ranks take the emergency full checkpoint at the same step
    (committed with both parts) and exit with 143."""
    out = tmp_path / "job"

    def term(job: h.Job) -> None:
        deadline = time.monotonic() + 90
        while job.running() and time.monotonic() < deadline and len(_losses(out, 1)) < 8:
            time.sleep(0.01)
        job.kill(1, signal.SIGTERM)

    codes = h.launch(w.train_ddp, 2, out, 10_000, {"sigterm": True}, timeout=120, during=term)
    assert codes == [143, 143], (
        codes,
        (out / "error.rank0.txt").exists() and h.Job([], out, 0).errors(),
    )
    store = _storage(tmp_path)
    records = [x for x in list_checkpoints(store, w.RUN) if x.tier != Tier.HEARTBEAT]
    last = records[-1]
    assert last.tier == Tier.FULL and last.emergency and last.world_size == 2
    assert "SIGTERM" in last.reason
    steps = [max(_losses(out, r)) for r in range(2)]
    assert steps[0] == steps[1] == last.step


def test_flash_ddp_rank_sigkilled_after_snapshot_is_committed_by_the_persisters(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """2-rank DDP with shared-memory snapshots and one local persister per rank: rank 1 is
    SIGKILLed right after an agreed snapshot (rank 0 then dies on its next collective).
    Each persister writes its rank's part; rank 0's persister commits once both parts are
    in storage with the same save token. The restart resumes exactly from that step."""
    out = tmp_path / "job"
    # "wait": a save due at >= 12 is taken even when a loaded machine slows the persisters
    # (deferred ones took no snapshot, and the kill must follow one)
    opts = {"shm": True, "die_rank": 1, "die_after_save_at": 12, "backpressure": "wait"}
    codes = h.launch(w.train_ddp, 2, out, STEPS, opts, timeout=120)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0
    died = int((out / "died_after.txt").read_text())
    store = _storage(tmp_path)
    deadline = time.monotonic() + 60
    newest = None
    while time.monotonic() < deadline:
        records = [x for x in list_checkpoints(store, w.RUN) if x.tier != Tier.HEARTBEAT]
        newest = records[-1] if records else None
        if newest is not None and newest.step == died and newest.status != CheckpointStatus.PENDING:
            break
        time.sleep(0.1)
    if newest is None or newest.step != died:
        print(_persister_logs(out))  # whole, under "Captured stdout" (-q truncates the message)
    assert newest is not None and newest.step == died, (newest, died)
    assert newest.world_size == 2 and newest.status == CheckpointStatus.VALID
    for rank in range(2):  # the persisters exit once their trainer is gone
        pid = int((out / "work" / f"sidecar.rank{rank}.pid").read_text())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
    h.codes_ok(h.launch(w.train_ddp, 2, out, STEPS, {"shm": True}, timeout=120), out)
    resumed = [json.loads((out / f"resume.rank{r}.json").read_text()) for r in range(2)]
    assert resumed[0]["step"] == resumed[1]["step"] == died + 1
    for rank in range(2):
        assert _losses(out, rank) == reference["losses"][rank]
        assert json.loads((out / f"final.rank{rank}.json").read_text()) == reference["final"][rank]
