"""FIT scenarios of peer replication and the memory tier (issue #31): real gloo DDP jobs.

The job is the distributed tests' (``tests/ckpt_agent/distributed``: ``ckpt_dist_workers.
train_ddp``, launched by ``ckpt_dist_harness.launch``): 2 ranks, one per "node"; a node is
a shared-memory directory ``shm.<node>`` with its sidecar (a thread of its rank's process,
so it dies with the node) pushing every snapshot to its peer. The memory tier snapshots
every :data:`EVERY` steps, a pulse goes to storage every :data:`PULSE`. A lost node is its
rank (and sidecar) SIGKILLed and its directory wiped; the other rank is SIGKILLed too (its
collective would fail) and restarts in place; the lost rank restarts on a new node ``n2``,
whose sidecar asks the peers for its replica. Where a scenario must kill or freeze the peer
alone, rank 1's peer is a bare replica server in its own process (``p``).

The job, the peer process and the shared checks are :mod:`.replica_job`'s. Every scenario
checks the run ends bitwise equal to the uninterrupted one (stitched losses
of every rank and the final parameters) and that no checkpoint valid at the fault is lost.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

from ckpt_agent.records import CheckpointRecord

from ..api import free_port
from .core import FitContext, Outcome, scenario
from .replica_job import (
    COMPUTE_S,
    EVERY,
    MAX_LAG_STEPS,
    PARTITION_TIMEOUT_S,
    STALL_LIMIT_S,
    STEPS,
    WORLD,
    NodeJob,
    StepClock,
    check_acknowledged,
    check_bitwise,
    check_fell_back_to_storage,
    connected,
    kill_all,
    losses,
    peer_process,
    pushes,
    restart,
    setup,
    wait_for,
)


# --------------------------------------------------------------------------- node loss
def _lose_n1_at_random(
    ctx: FitContext, outcome: Outcome, job: NodeJob
) -> tuple[float, int, int | None, int | None, list[CheckpointRecord]]:
    """Run the job on n0, n1 and lose n1 at a random instant; returns the kill's time, the
    steps every rank finished, rank 1's newest snapshot step, the step of its replica on n0
    and what storage held."""
    rng = random.Random(ctx.seed)
    at, frac = rng.randint(12, STEPS - 12), rng.random()
    state: dict[str, Any] = {}

    def lose_n1(running: Any) -> None:
        wait_for(f"step {at}", lambda: len(losses(job.out)[0]) >= at, 120, running.running)
        time.sleep(frac * COMPUTE_S)
        kill_all(running)
        state["at"] = time.monotonic()

    codes = job.launch(["n0", "n1"], during=lose_n1)
    outcome.check("the node was lost", codes == [-signal.SIGKILL] * WORLD, f"{codes}")
    done = min(len(x) for x in losses(job.out))
    latest = job.latest_step("n1")
    held = job.replica(job.shm("n0"))
    job.lose("n1")
    outcome.injected_at = f"n1 lost after step {done - 1} (+{frac:.2f} of a step)"
    return state["at"], done, latest, None if held is None else held.desc.step, job.records()


@scenario(
    "node-loss",
    "#31 a node lost at a random instant: its rank resumes from the peer's replica",
    expected_s=25,
)
def node_loss(ctx: FitContext) -> Outcome:
    outcome, ref, job = setup(ctx, "node-loss")
    killed, done, latest, replica, at_fault = _lose_n1_at_random(ctx, outcome, job)
    outcome.notes.append(f"rank 1's newest snapshot: step {latest}; its replica on n0: {replica}")
    restart(outcome, job, ["n0", "n2"], killed, done)
    resumed = job.resumed()
    want = None if replica is None else replica + 1
    outcome.check(
        "every rank resumed from memory at the replica's step",
        replica is not None
        and [(r["action"], r["step"], r["exact"]) for r in resumed]
        == [("resume_shm", want, True)] * WORLD,
        str([(r["action"], r["step"]) for r in resumed]),
    )
    installed = [e for e in job.sidecar_events("n2") if e["event"] == "rehydrated"]
    outcome.check(
        "n2's sidecar installed rank 1's replica from n0",
        [(e["rank"], e["step"], e["source"]) for e in installed] == [(1, replica, "n1")],
        str([e.get("why") for e in installed]),
    )
    lag = None if latest is None or replica is None else latest - replica
    outcome.steps_lost = done - int(resumed[0]["step"])
    outcome.recovered_from = f"memory; rank 1 from n0's replica of step {replica}"
    outcome.check(
        "steps lost <= the memory interval + the replica's lag (at most 2 snapshots)",
        lag is not None and outcome.steps_lost <= EVERY + lag and lag <= MAX_LAG_STEPS,
        f"{outcome.steps_lost} lost (interval {EVERY}, the replica {lag} step(s) behind rank "
        f"1's newest snapshot; limit {MAX_LAG_STEPS})",
    )
    check_acknowledged(outcome, job, at_fault)
    check_bitwise(outcome, job, ref)
    return outcome


# --------------------------------------------------------------------------- corrupted replica
@scenario(
    "replica-corrupted",
    "#31 a byte of the lost rank's replica flipped on the peer: skipped, storage instead",
    expected_s=15,
)
def replica_corrupted(ctx: FitContext) -> Outcome:
    outcome, ref, job = setup(ctx, "replica-corrupted")
    killed, done, _, replica, at_fault = _lose_n1_at_random(ctx, outcome, job)
    held = job.replica(job.shm("n0"))
    if not outcome.check("n0 held a replica of rank 1", held is not None, f"step {replica}"):
        return outcome
    assert held is not None
    info = next(iter(held.desc.tensors.values()))
    with open(held.data_path, "r+b") as f:  # a bit flipped at rest on the peer
        f.seek(info.offset + info.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x08]))
    outcome.injected_at += f"; a byte of n0's replica (step {replica}) flipped"
    restart(outcome, job, ["n0", "n2"], killed, done)
    check_fell_back_to_storage(
        outcome, job, ref, at_fault, done,
        "the recreated rank's rehydration refused the corrupted replica", why_has="corrupted",
    )  # fmt: skip
    return outcome


# --------------------------------------------------------------------------- peer loss
@scenario(
    "peer-loss-during-replication",
    "#31 the peer dies with a push in flight: training goes on, a later node loss uses storage",
    expected_s=15,
)
def peer_loss(ctx: FitContext) -> Outcome:
    metrics = free_port()
    outcome, ref, job = setup(ctx, "peer-loss-during-replication", hold_at=STEPS - 4)
    peer, address = peer_process(job, ctx)
    job.extra = {"peers": {"n1": address, "n2": address}, "metrics_ports": {"n1": metrics}}
    job.hold.touch()
    clock = StepClock(job.out)
    ctx.cleanups.append(clock.close)
    state: dict[str, Any] = {}

    def kill_peer_then_n1(running: Any) -> None:
        wait_for(
            "rank 1's replica on p",
            lambda: job.replica(job.shm("p")) is not None,
            120,
            running.running,
        )
        os.kill(peer.pid, signal.SIGSTOP)  # the next push hangs in its handshake ...
        wait_for(
            "a push in flight", lambda: connected(int(address.split(":")[1])), 30, running.running
        )
        state["in_flight"] = True
        peer.kill()  # ... and the peer dies under it
        peer.wait(10)
        state["dead"], state["step"] = time.monotonic(), clock.steps()
        wait_for(
            "a failed push counted and a pulse committed after the peer's death",
            lambda: (
                pushes(metrics).get("failed", 0) >= 1
                and any(r.step > state["step"] + 1 for r in job.records())
            ),
            60,
            running.running,
        )
        state["pushes"] = pushes(metrics)
        # n1 is lost a few steps past that pulse: n0's memory is newer than storage
        pulse = max(r.step for r in job.records())
        wait_for(
            "steps past the pulse", lambda: clock.steps() > pulse + 2 * EVERY, 30, running.running
        )
        state["gap"] = clock.max_gap(state["dead"], time.monotonic())
        kill_all(running)
        state["at"] = time.monotonic()

    codes = job.launch(["n0", "n1"], during=kill_peer_then_n1)
    outcome.check("the peer died with a push in flight", state.get("in_flight", False))
    counted = state.get("pushes", {})
    outcome.check(
        "the failed push was counted (ckpt_sidecar_replica_pushes_total)",
        counted.get("failed", 0) >= 1 and counted.get("pushed", 0) >= 1,
        str(counted),
    )
    gap, steps = state.get("gap", (float("inf"), 0))
    outcome.check(
        "training went on without stalling, saving to storage",
        codes == [-signal.SIGKILL] * WORLD and steps >= 2 and gap <= STALL_LIMIT_S,
        f"{steps} steps after the peer died, longest gap {gap:.2f} s (limit {STALL_LIMIT_S} s)"
        f"; exits {codes}",
    )
    done = min(len(x) for x in losses(job.out))
    at_fault = job.records()
    job.lose("n1")
    outcome.injected_at = f"p killed mid-push at step {state.get('step')}; n1 lost at {done - 1}"
    restart(outcome, job, ["n0", "n2"], state["at"], done)
    check_fell_back_to_storage(
        outcome, job, ref, at_fault, done, "the recreated rank found no replica (its peer is gone)"
    )
    return outcome


# --------------------------------------------------------------------------- partition
@scenario(
    "partition",
    "#31 the peer unreachable (frozen): pushes time out, training goes on, replication resumes",
    expected_s=10,
)
def partition(ctx: FitContext) -> Outcome:
    metrics = free_port()
    outcome, ref, job = setup(ctx, "partition", hold_at=STEPS - 4)
    peer, address = peer_process(job, ctx)
    job.extra = {
        "peers": {"n1": address},
        "metrics_ports": {"n1": metrics},
        "timeout_s": PARTITION_TIMEOUT_S,
    }
    job.hold.touch()
    clock = StepClock(job.out)
    ctx.cleanups.append(clock.close)
    on_p, port = job.shm("p"), int(address.rsplit(":", 1)[1])
    state: dict[str, Any] = {}

    def partition_and_heal(running: Any) -> None:
        wait_for(
            "rank 1's replica on p", lambda: job.replica(on_p) is not None, 120, running.running
        )
        wait_for("n1's metrics", lambda: bool(pushes(metrics)), 30, running.running)
        failed = pushes(metrics).get("failed", 0)
        os.kill(peer.pid, signal.SIGSTOP)  # p takes connections and never answers
        state["cut"], state["step"] = time.monotonic(), clock.steps()
        wait_for("a push to p", lambda: connected(port), 30, running.running)
        pushing = time.monotonic()
        wait_for(
            "a push timing out",
            lambda: pushes(metrics).get("failed", 0) > failed,
            PARTITION_TIMEOUT_S * 4,
            running.running,
        )
        state["timed_out"] = time.monotonic() - pushing
        healed = time.monotonic()
        state["gap"] = clock.max_gap(state["cut"], healed)
        os.kill(peer.pid, signal.SIGCONT)  # the partition heals
        newest = job.latest_step("n1")
        state["newest"] = newest

        def caught_up() -> bool:
            held = job.replica(on_p)
            return held is not None and newest is not None and held.desc.step >= newest

        wait_for("the newest snapshot on p", caught_up, 60, running.running)
        state["healed_in"] = time.monotonic() - healed
        held = job.replica(on_p)
        state["held"] = None if held is None else held.desc.step
        job.hold.unlink()

    codes = job.launch(["n0", "n1"], during=partition_and_heal)
    outcome.injected_at = f"p frozen (SIGSTOP) at step {state.get('step')}"
    timed_out = state.get("timed_out")
    outcome.check(
        "a push to the unreachable peer timed out within its timeout",
        timed_out is not None and timed_out <= PARTITION_TIMEOUT_S + 1.0,
        f"failed {timed_out:.1f} s after it connected (timeout {PARTITION_TIMEOUT_S:g} s)"
        if timed_out is not None
        else "no failed push",
    )
    gap, steps = state.get("gap", (float("inf"), 0))
    outcome.check(
        "training went on during the partition without stalling",
        steps >= 2 and gap <= STALL_LIMIT_S,
        f"{steps} steps during it, longest gap {gap:.2f} s (limit {STALL_LIMIT_S} s)",
    )
    outcome.check(
        "replication resumed once healed: the newest snapshot reached the peer",
        state.get("held") is not None,
        f"rank 1's snapshot of step {state.get('newest')} on p {state.get('healed_in', 0):.1f} s"
        f" after the heal (p holds step {state.get('held')})",
    )
    outcome.check("the job finished", codes == [0] * WORLD, f"{codes} {job.errors()}")
    outcome.steps_lost = 0
    outcome.recovered_from = "-"
    check_bitwise(outcome, job, ref)
    return outcome
