"""FIT scenarios that need no control plane: real trainers and persisters on this machine.

Each scenario starts the example trainer with the agent (:class:`~.trainer.FitRun`),
injects its fault, restarts the trainer the way a controller restarts a failed pod,
and checks the shared pass criteria (:func:`~.trainer.verify_recovery`). Numbers refer
to issue #14; 4-8 (operator, node, S3) live in :mod:`ckpt_e2e.fit.cluster`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_agent.decide.recovery import is_poisoned, plan_recovery
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.format.layout import blob_key, rank_manifest_key
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.records import CheckpointRecord, CheckpointStatus

from ..training import Training
from .core import FitContext, Outcome, restart_may_resume, scenario
from .disk import SmallDisk
from .faults import CRASH_EXIT, FAKE_NVML_DIR, NVML_FILE_ENV
from .trainer import (
    RUN_ID,
    SMALL,
    Expectations,
    FitRun,
    corrupt_valid,
    fit_config,
    reference,
    verify_recovery,
    with_suppress_kill,
)

#: A run long enough to fill a disk, wait for a probe, or crash in a loop and still finish.
LONG = replace(SMALL, steps=48, step_sleep=0.03)


def _setup(
    ctx: FitContext,
    name: str,
    training: Training = SMALL,
    *,
    env: Mapping[str, str] | None = None,
    pythonpath: tuple[Path, ...] = (),
    **config: Any,
) -> tuple[Outcome, dict[str, Any], FitRun]:
    """A scenario's outcome, its reference run and its training run (config: fit_config's)."""
    root = ctx.work_dir / name
    run = FitRun(root, training, fit_config(root, **config), dict(env or {}), pythonpath)
    ctx.cleanups.append(run.close)
    return Outcome(name), reference(ctx, training), run


def _wait_valid(run: FitRun, count: int, *, min_step: int = -1, timeout: float = 90.0) -> None:
    run.wait_for(
        f"{count} valid checkpoint(s) and step >= {min_step}",
        lambda: run.last_step() >= min_step and len(run.valid()) >= count,
        timeout,
    )


def _kill_and_recover(outcome: Outcome, run: FitRun, ref: dict[str, object]) -> None:
    """SIGKILL the trainer now, restart it, verify (the body of scenario 1)."""
    last = run.last_step()
    detected = run.kill()
    outcome.injected_at = outcome.injected_at or f"step {last}"
    acknowledged = [r.id for r in run.valid()]
    outcome.check_recovery_time(run.restart_and_time(detected))
    verify_recovery(outcome, run, ref, Expectations(acknowledged, last_step_before=last))


# --------------------------------------------------------------------------- 1
@scenario("trainer-sigkill", "1. trainer SIGKILL at a random step", expected_s=15)
def trainer_sigkill(ctx: FitContext) -> Outcome:
    outcome, ref, run = _setup(ctx, "trainer-sigkill")
    at = random.Random(ctx.seed).randint(6, SMALL.steps - 6)
    run.start()
    _wait_valid(run, 1, min_step=at)
    _kill_and_recover(outcome, run, ref)
    return outcome


# --------------------------------------------------------------------------- 2
def _kill_in_persist(ctx: FitContext, name: str, point: str, what: str) -> Outcome:
    outcome, ref, run = _setup(ctx, name)
    marker = run.root / "killed.marker"
    run.start(fault={"kill": {"point": point, "after_commits": 2, "marker": str(marker)}})
    code = run.wait_exit(120)
    detected = time.monotonic()
    last = run.last_step()
    outcome.injected_at = f"{what}, step {last}"
    outcome.check("died at the injected point", code == -9 and marker.exists(), f"exit {code}")
    acknowledged = [r.id for r in run.valid()]
    listed = [(r.id, r.status.value) for r in run.records()]
    outcome.notes.append(f"at death: {listed}")
    outcome.check(
        "torn save not committed",
        all(r.status != CheckpointStatus.VALID or r.id in acknowledged for r in run.records())
        and len(acknowledged) >= 2,
        f"{len(acknowledged)} valid at death",
    )
    outcome.check_recovery_time(run.restart_and_time(detected))
    verify_recovery(outcome, run, ref, Expectations(acknowledged, last_step_before=last))
    return outcome


@scenario("kill-mid-blob", "2a. trainer SIGKILL half-way through writing a blob", expected_s=15)
def kill_mid_blob(ctx: FitContext) -> Outcome:
    return _kill_in_persist(ctx, "kill-mid-blob", "blob", "mid-blob")


@scenario(
    "kill-before-manifest", "2b. trainer SIGKILL between the blobs and the manifest", expected_s=15
)
def kill_before_manifest(ctx: FitContext) -> Outcome:
    return _kill_in_persist(ctx, "kill-before-manifest", "manifest", "blobs written, no manifest")


@scenario(
    "kill-before-commit", "2c. trainer SIGKILL between the manifest and COMMIT", expected_s=15
)
def kill_before_commit(ctx: FitContext) -> Outcome:
    return _kill_in_persist(ctx, "kill-before-commit", "commit", "manifest written, no COMMIT")


# --------------------------------------------------------------------------- 3
@scenario(
    "persister-sigkill",
    "3. persister SIGKILL with an unpersisted snapshot in shared memory",
    expected_s=25,
)
def persister_sigkill(ctx: FitContext) -> Outcome:
    outcome, ref, run = _setup(ctx, "persister-sigkill", LONG, shm=True)
    marker = run.root / "delayed.marker"
    run.start(fault={"delay": {"seconds": 30, "after_commits": 2, "marker": str(marker)}})
    reader = ShmReader(run.root / "shm", RUN_ID, 0)

    def stuck() -> bool:  # the persister sleeps inside a blob write of a newer snapshot
        latest, mark = reader.latest(), reader.persisted()
        return marker.exists() and latest is not None and mark is not None and latest.seq > mark.seq

    run.wait_for("a snapshot the persister has not persisted yet", stuck, 90)
    latest = reader.latest()
    assert latest is not None
    pid = run.persister_pid()
    outcome.check("a persister process served the trainer", pid is not None, f"pid {pid}")
    if pid is None:
        return outcome
    with_suppress_kill(pid)
    detected = time.monotonic()
    outcome.injected_at = f"snapshot of step {latest.step} in shared memory, unpersisted"
    acknowledged = [r.id for r in run.valid()]

    def persisted() -> bool:
        return any(r.step >= latest.step for r in run.valid())

    deadline = time.monotonic() + 90
    while not persisted() and time.monotonic() < deadline and run.current.alive():
        time.sleep(0.02)
    ok = persisted()
    outcome.check_recovery_time(time.monotonic() - detected if ok else None)
    outcome.check(
        "the orphaned snapshot was persisted by a new persister",
        ok,
        f"step {latest.step}; persister now pid {run.persister_pid()}",
    )
    verify_recovery(outcome, run, ref, Expectations(acknowledged))
    outcome.steps_lost = 0  # the trainer never stopped
    outcome.recovered_from = next(
        (f"{r.id} (new persister)" for r in run.valid() if r.step >= latest.step), "-"
    )
    return outcome


# --------------------------------------------------------------------------- 9
#: Long enough to fill a disk, see a save fail, free it and see saves commit again.
DISK_RUN = replace(SMALL, steps=64, step_sleep=0.05)


def _storage_fault(ctx: FitContext, name: str, fault: str) -> Outcome:
    """Scenario 9: the checkpoint disk fills up / turns read-only mid-run, then recovers."""
    disk = SmallDisk(ctx.work_dir / f"{name}-disk")
    with disk:
        store = (disk.path / "store").as_uri()
        outcome, ref, run = _setup(ctx, name, DISK_RUN, storageUrl=store)
        outcome.notes.append(f"disk: {disk.kind}")
        run.start(fault=disk.fault() or None)
        _wait_valid(run, 2)
        errors_before = len(run.events("error"))
        step = run.last_step()
        if fault == "full":
            disk.fill()
        else:
            disk.read_only()
        outcome.injected_at = (
            f"step {step} ({'ENOSPC' if fault == 'full' else 'EROFS'}, "
            f"{'real tmpfs' if disk.real else 'simulated'})"
        )
        # The agent fails the run on a permanent storage error ("nothing was published"):
        # the pod fails, the controller restarts it once the volume is usable again.
        code = run.wait_exit(90)
        detected = time.monotonic()
        errors = [e.get("error", "") for e in run.events("error")[errors_before:]]
        outcome.check(
            "the failed save stopped the run with what to do",
            code not in (0, None) and any("nothing was published" in e for e in errors),
            f"exit {code}: {(errors or ['no error event'])[-1][:160]}",
        )
        valid_at_fault = {r.id for r in run.valid()}
        last = run.last_step()
        if fault == "full":
            disk.free()
        else:
            disk.writable()
        outcome.check_recovery_time(run.restart_and_time(detected))
        verify_recovery(
            outcome, run, ref, Expectations(sorted(valid_at_fault), last_step_before=last)
        )
    return outcome


@scenario("disk-full", "9a. checkpoint disk full (ENOSPC) mid-run", expected_s=25)
def disk_full(ctx: FitContext) -> Outcome:
    return _storage_fault(ctx, "disk-full", "full")


@scenario(
    "disk-read-only", "9b. checkpoint filesystem turns read-only (EROFS) mid-run", expected_s=25
)
def disk_read_only(ctx: FitContext) -> Outcome:
    return _storage_fault(ctx, "disk-read-only", "read-only")


# --------------------------------------------------------------------------- 10
def _own_blobs(run: FitRun, ckpt_id: str) -> list[str]:
    """Blob digests only ``ckpt_id`` references (damaging them touches no other checkpoint)."""
    _, mine = read_checkpoint(run.store, RUN_ID, ckpt_id)
    others: set[str] = set()
    for r in run.records():
        if r.id != ckpt_id:
            others |= set(read_checkpoint(run.store, RUN_ID, r.id)[1].referenced_blobs())
    return sorted(set(mine.referenced_blobs()) - others)


@scenario(
    "io-errors",
    "10a. I/O errors: EIO on blob writes mid-run, transient EIO reading the newest checkpoint",
    expected_s=20,
)
def io_errors(ctx: FitContext) -> Outcome:
    outcome, ref, run = _setup(ctx, "io-errors", DISK_RUN)
    outcome.notes.append("EIO simulated at the storage's os boundary (no FUSE binding here)")
    flag = run.root / "eio.on"
    write_eio = {"errno": "EIO", "op": "write", "names": [".ckpt-tmp."], "while_file": str(flag)}
    run.start(fault={"errors": [write_eio]})
    _wait_valid(run, 2)
    errors_before = len(run.events("error"))
    step = run.last_step()
    flag.touch()
    run.wait_for(
        "a save failing with EIO",
        lambda: len(run.events("error")) > errors_before or not run.current.alive(),
        60,
    )
    flag.unlink()  # a burst: later saves must commit again (or the run stops and restarts)
    after = run.last_step()
    deadline = time.monotonic() + 60
    while run.current.alive() and time.monotonic() < deadline:
        if any(r.step > after for r in run.valid()):
            break
        time.sleep(0.02)
    errors = [e.get("error", "") for e in run.events("error")[errors_before:]]
    outcome.check(
        "the EIO was reported, nothing half-written published",
        any("input/output error" in e.lower() for e in errors) and not corrupt_valid(run),
        (errors or ["no error event"])[-1][:160],
    )
    last = run.last_step()
    detected = run.kill()
    at_fault = run.records()
    acknowledged = [r.id for r in run.valid()]
    # the checkpoint the restart takes first: the newest valid one, or a newer one still
    # pending (validation lags under load) that the restart verifies itself
    newest = restart_may_resume(at_fault)[0].id
    outcome.injected_at = f"EIO on writes at step {step}; EIO reading {newest} at the restart"
    # transient: each of the newest checkpoint's own blobs fails its first read only
    read_eio = {"errno": "EIO", "op": "read", "names": _own_blobs(run, newest), "times": 1}
    outcome.check_recovery_time(run.restart_and_time(detected, fault={"errors": [read_eio]}))
    verify_recovery(
        outcome, run, ref, Expectations(acknowledged, last_step_before=last, at_fault=at_fault)
    )
    # a transient EIO says nothing about the bytes: re-read, never skipped for an older one
    outcome.check(
        "the transient EIO was retried: resumed from the newest",
        outcome.recovered_from == newest,
        f"newest {newest}, resumed from {outcome.recovered_from}",
    )
    return outcome


@scenario(
    "silent-corruption",
    "10b. bit flip, truncated blob and torn manifest in the three newest checkpoints",
    expected_s=15,
)
def silent_corruption(ctx: FitContext) -> Outcome:
    outcome, ref, run = _setup(ctx, "silent-corruption")
    run.start()
    _wait_valid(run, 4, min_step=18)
    last = run.last_step()
    detected = run.kill()
    valid = sorted(run.valid(), key=lambda r: r.step)
    flip, cut, torn = valid[-1].id, valid[-2].id, valid[-3].id
    root = run.root / "store"
    blob = root / blob_key(RUN_ID, _own_blobs(run, flip)[0])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x10
    blob.write_bytes(bytes(data))
    blob = root / blob_key(RUN_ID, _own_blobs(run, cut)[0])
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    manifest = root / rank_manifest_key(RUN_ID, torn, 0)
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    outcome.injected_at = f"step {last}: flip {flip[-4:]}, truncate {cut[-4:]}, tear {torn[-4:]}"
    acknowledged = [r.id for r in valid if r.id not in (flip, cut, torn)]
    outcome.check_recovery_time(run.restart_and_time(detected))
    verify_recovery(
        outcome,
        run,
        ref,
        Expectations(acknowledged, damaged={flip, cut, torn}, last_step_before=last),
    )
    marked = {e.get("checkpoint") for e in run.events("corrupted")}
    outcome.check(
        "the damaged checkpoints were marked corrupted at the resume",
        {flip, cut, torn} <= marked,
        f"marked: {sorted(str(m)[-4:] for m in marked)}",
    )
    return outcome


# --------------------------------------------------------------------------- 11
@scenario(
    "crash-loop-poisoned",
    "11. crash loop on a poisoned checkpoint: the ladder skips it, the budget ends it",
    expected_s=25,
)
def crash_loop(ctx: FitContext) -> Outcome:
    """The controller's loop at process level: each failed start before advancing poisons
    the checkpoint it resumed from (:func:`is_poisoned`), the next start takes the ladder
    without it (:func:`plan_recovery`), and ``recovery.maxRestarts`` ends the loop (the
    operator-level version: e2e/tests/test_recovery.py)."""
    outcome, ref, run = _setup(ctx, "crash-loop-poisoned", recovery={"maxRestarts": 2})
    config = run.config
    assert config is not None
    run.start()
    _wait_valid(run, 4, min_step=18)
    last = run.last_step()
    run.kill()
    valid = sorted(run.valid(), key=lambda r: r.step)
    acknowledged = [r.id for r in valid]
    poison_from = valid[-2].step + 1  # any resume from the two newest crashes the trainer
    outcome.injected_at = f"resumes at step >= {poison_from} crash (2 poisoned checkpoints)"
    poisoned: set[str] = set()
    starts: list[tuple[str, int | None]] = []
    budget = config.recovery.max_restarts
    while len(starts) < budget:
        plan = plan_recovery(run.records(heartbeat=True), config.recovery, poisoned=poisoned)
        step = next(s for s in plan.steps if s.action == "resume")
        run.start(
            fault={"crash_on_resume_at_or_after": poison_from}, resume_from=step.checkpoint_id
        )
        code = run.wait_exit(120)
        starts.append((step.checkpoint_id, code))
        if code == 0:
            break
        reached = run.last_step() if run.stepped_since_start() else None
        if is_poisoned(step.step, reached):
            poisoned.add(step.checkpoint_id)
    ids = [s[0] for s in starts]
    outcome.notes.append(f"starts: {starts}")
    outcome.check(
        "the ladder never restarted from a poisoned checkpoint twice",
        len(ids) == len(set(ids)) and ids[:2] == [valid[-1].id, valid[-2].id],
        " -> ".join(i[-4:] for i in ids),
    )
    outcome.check(
        "the restart budget ended the crash loop",
        len(starts) == budget and all(code == CRASH_EXIT for _, code in starts),
        f"{len(starts)} restarts (budget {budget}), exits {[c for _, c in starts]}",
    )
    # the fix is in (a new image, a raised budget): the next start skips both poisoned ones
    plan = plan_recovery(run.records(heartbeat=True), config.recovery, poisoned=poisoned)
    good = next(s for s in plan.steps if s.action == "resume")
    detected = time.monotonic()
    outcome.check_recovery_time(run.restart_and_time(detected, resume_from=good.checkpoint_id))
    # the poisoned ones are retired on purpose (the run resumed before them): not "lost"
    kept = [c for c in acknowledged if c not in poisoned]
    verify_recovery(
        outcome, run, ref, Expectations(kept, unreadable=poisoned, last_step_before=last)
    )
    return outcome


# --------------------------------------------------------------------------- 12
#: Runs past two sidecar health probes (every 10 s): the first is the NVML baseline.
GPU_RUN = replace(SMALL, steps=320, step_sleep=0.05)


@scenario(
    "gpu-fault",
    "12. GPU fault: an ECC burst from NVML triggers an emergency save, then the process dies",
    expected_s=40,
)
def gpu_fault(ctx: FitContext) -> Outcome:
    ecc = ctx.work_dir / "gpu-fault-nvml-ecc"
    outcome, ref, run = _setup(
        ctx,
        "gpu-fault",
        GPU_RUN,
        env={NVML_FILE_ENV: str(ecc)},
        pythonpath=(FAKE_NVML_DIR,),
        shm=True,
        pulse_every=1000,
        # only the GPU may raise the alarm (this loaded machine's disk latency must not)
        scheduler={
            "risk": {"enabled": False},
            "system": {"writeLatencyMs": 1e6, "emergencyCooldownSteps": 0},
        },
    )
    outcome.notes.append("NVML simulated: a fake pynvml module first on the persister's path")
    run.start()
    run.wait_for(
        "the persister", lambda: run.persister_pid() is not None and run.last_step() >= 5, 60
    )
    before = {r.id for r in run.records()}
    ecc.write_text("8\n")  # 8 uncorrected ECC errors appear
    outcome.injected_at = f"8 ECC errors at step {run.last_step()}"

    def emergencies() -> list[CheckpointRecord]:
        return [r for r in run.valid() if r.emergency and r.id not in before]

    run.wait_for("an emergency checkpoint", lambda: bool(emergencies()), 60)
    saved = emergencies()[0]
    outcome.check(
        "the GPU errors triggered an emergency (high-risk) save",
        "gpu_errors" in saved.reason,
        f"{saved.id}: {saved.reason}",
    )
    ecc.unlink()  # "the GPU is replaced": the restarted process sees a healthy one
    last = run.last_step()
    detected = run.kill()
    pid = run.persister_pid()
    if pid is not None:
        with_suppress_kill(pid)
    acknowledged = [r.id for r in run.valid()]
    outcome.check_recovery_time(run.restart_and_time(detected))
    verify_recovery(outcome, run, ref, Expectations(acknowledged, last_step_before=last))
    return outcome
