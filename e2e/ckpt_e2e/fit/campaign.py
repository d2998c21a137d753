"""The random-crash campaign (``ckpt-fit --campaign N``).

Each trial trains a small model with a pulse every 3 steps, SIGKILLs the trainer at a
uniformly random instant (a random step, then a random fraction of that step's time, so
kills land inside persisting and validation as often as those take time) — in flash
trials the persister too, some of the time — restarts it like a controller would and
runs it to the end. Counted: corrupt checkpoints marked valid (right after the kill and
at the end), acknowledged (valid at the kill) checkpoints lost, resumes whose losses or
final parameters differ from the uninterrupted run, failed trials; recovery time
percentiles; where the kills landed. *Zombie writer* trials (``ZOMBIE_SHARE``) freeze the
trainer instead of killing it, restart it beside the frozen one and wake the frozen one
after the restart committed: it must stop with FencedError, losing nothing acknowledged.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ckpt_agent.format.layout import COMMIT, VALIDATION
from ckpt_agent.storage.base import TEMP_PREFIX

from .core import FitContext
from .trainer import RUN_ID, SMALL, FitRun, corrupt_valid, fit_config, reference, with_suppress_kill

#: ~20 steps, a pulse every 3: a trial takes a few seconds here.
CAMPAIGN = replace(SMALL, steps=20, step_sleep=0.03)
#: Share of trials with the flash persister (shared memory + persister process).
FLASH_SHARE = 0.3
#: Share of "zombie writer" trials: the trainer is frozen (SIGSTOP, a partitioned node)
#: instead of killed, restarted beside it, and woken once the restart has committed: it
#: must be fenced (FencedError) and lose the holder nothing (issue #28).
ZOMBIE_SHARE = 0.2


@dataclass
class Trial:
    number: int
    flash: bool
    persister_killed: bool
    kill_step: int
    phase: str = ""
    recovery_s: float | None = None
    corrupt_valid: int = 0
    acknowledged_lost: int = 0
    exact: bool = False
    error: str = ""
    zombie: bool = False


def phase_of(store_root: Path) -> str:
    """Where a kill landed, from what it left in storage."""
    steps = store_root / RUN_ID / "steps"
    if any(p.name.startswith(TEMP_PREFIX) for p in store_root.rglob(f"{TEMP_PREFIX}*")):
        return "mid-write (temp file left)"
    for ckpt in sorted(steps.glob("*")) if steps.is_dir() else []:
        if ckpt.name.startswith("heartbeat"):
            continue
        names = {p.name for p in ckpt.iterdir()}
        if COMMIT not in names and any(n.startswith("rank") for n in names):
            return "manifest written, no COMMIT"
        if COMMIT in names and VALIDATION not in names:
            return "committed, not validated"
    return "between saves"


def _zombie_trial(n: int, rng: random.Random, root: Path, ref: dict[str, Any]) -> Trial:
    """Freeze the trainer at a random instant, restart it beside the frozen one, wake the
    frozen one once the restart committed: it must stop with FencedError, and nothing
    valid at any point (the holder's acknowledged checkpoints) may be lost."""
    trial = Trial(n, False, False, rng.randint(2, CAMPAIGN.steps - 9), zombie=True)
    folder = root / f"trial-{n:04d}"
    run = FitRun(folder, CAMPAIGN, fit_config(folder, pulse_every=3))
    try:
        zombie = run.start()
        run.wait_for(f"step {trial.kill_step}", lambda: run.last_step() >= trial.kill_step, 120)
        time.sleep(rng.random() * (CAMPAIGN.step_sleep + 0.01))
        os.kill(zombie.proc.pid, signal.SIGSTOP)  # its node is lost: frozen, not dead
        detected = time.monotonic()
        trial.phase = phase_of(folder / "store")
        acknowledged = {r.id for r in run.valid()}
        restart = fit_config(folder, pulse_every=3, workDir=str(folder / "work-restart"))
        run.config_path = folder / "ckpt-config.restart.json"  # its own pod, its own work dir
        run.config_path.write_text(restart.to_json())
        trial.recovery_s = run.restart_and_time(detected, pace=CAMPAIGN.step_sleep)
        deadline = time.monotonic() + 120  # until the restart committed (or finished)
        while run.current.alive() and time.monotonic() < deadline:
            if {r.id for r in run.valid()} - acknowledged:
                break
            time.sleep(0.01)
        acknowledged |= {r.id for r in run.valid()}
        os.kill(zombie.proc.pid, signal.SIGCONT)
        zombie.proc.join(120)
        if zombie.alive():
            trial.error = f"the woken zombie did not stop (log {zombie.log})"
        elif "FencedError" not in zombie.log.read_text(errors="replace"):
            trial.error = f"the woken zombie exited {zombie.exitcode} unfenced (log {zombie.log})"
        acknowledged |= {r.id for r in run.valid()}
        code = run.wait_exit(180)
        result = run.result()
        trial.acknowledged_lost = len(acknowledged - {r.id for r in run.valid()})
        trial.corrupt_valid = len(corrupt_valid(run))
        trial.exact = (
            code == 0
            and result is not None
            and run.losses() == ref["losses"]
            and result.get("final_params_sha256") == ref["params"]
        )
        if code != 0 and not trial.error:
            trial.error = f"restarted trainer exited {code} (log {run.current.log})"
    except Exception as e:
        trial.error = f"{type(e).__name__}: {e}"
    finally:
        run.close()
    if not trial.error and not trial.corrupt_valid and not trial.acknowledged_lost and trial.exact:
        shutil.rmtree(folder, ignore_errors=True)
    return trial


def _trial(n: int, rng: random.Random, root: Path, ref: dict[str, Any]) -> Trial:
    flash = rng.random() < FLASH_SHARE
    trial = Trial(n, flash, flash and rng.random() < 0.5, rng.randint(2, CAMPAIGN.steps - 3))
    folder = root / f"trial-{n:04d}"
    run = FitRun(folder, CAMPAIGN, fit_config(folder, shm=flash, pulse_every=3))
    try:
        run.start()
        run.wait_for(f"step {trial.kill_step}", lambda: run.last_step() >= trial.kill_step, 120)
        time.sleep(rng.random() * (CAMPAIGN.step_sleep + 0.01))
        if trial.persister_killed and (pid := run.persister_pid()) is not None:
            with_suppress_kill(pid)
        detected = run.kill()
        trial.phase = phase_of(folder / "store")
        acknowledged = {r.id for r in run.valid()}
        trial.corrupt_valid = len(corrupt_valid(run))
        trial.recovery_s = run.restart_and_time(detected)
        code = run.wait_exit(180)
        result = run.result()
        valid = {r.id for r in run.valid()}
        trial.acknowledged_lost = len(acknowledged - valid)
        trial.corrupt_valid += len(corrupt_valid(run))
        trial.exact = (
            code == 0
            and result is not None
            and run.losses() == ref["losses"]
            and result.get("final_params_sha256") == ref["params"]
        )
        if code != 0:
            trial.error = f"restarted trainer exited {code} (log {run.current.log})"
    except Exception as e:
        trial.error = f"{type(e).__name__}: {e}"
    finally:
        run.close()
    if not trial.error and not trial.corrupt_valid and not trial.acknowledged_lost and trial.exact:
        shutil.rmtree(folder, ignore_errors=True)  # keep only the folders of bad trials
    return trial


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def run_campaign(
    trials: int,
    work_dir: Path,
    *,
    seed: int,
    log: Any = print,
    ctx: FitContext | None = None,
    zombie_share: float = ZOMBIE_SHARE,
) -> dict[str, Any]:
    """Run ``trials`` trials (``zombie_share`` of them zombie-writer trials); returns the
    counts, percentiles and a one-paragraph summary."""
    ctx = ctx or FitContext(work_dir=work_dir, seed=seed, log=log)
    rng = random.Random(seed)
    ref = reference(ctx, CAMPAIGN)
    t0 = time.monotonic()
    results: list[Trial] = []
    for n in range(trials):
        if rng.random() < zombie_share:
            trial = _zombie_trial(n, rng, work_dir, ref)
        else:
            trial = _trial(n, rng, work_dir, ref)
        results.append(trial)
        bad = trial.error or trial.corrupt_valid or trial.acknowledged_lost or not trial.exact
        rec = "-" if trial.recovery_s is None else f"{trial.recovery_s:.1f}s"
        log(
            f"  trial {n + 1}/{trials}: "
            f"{'zombie' if trial.zombie else 'flash' if trial.flash else 'thread'}"
            f"{' +persister' if trial.persister_killed else ''} kill@{trial.kill_step} "
            f"[{trial.phase}] recovery {rec} {'FAIL ' + trial.error if bad else 'ok'}"
        )
    times = [t.recovery_s for t in results if t.recovery_s is not None]
    counts = {
        "trials": trials,
        "corrupt_marked_valid": sum(t.corrupt_valid for t in results),
        "acknowledged_lost": sum(t.acknowledged_lost for t in results),
        "resume_not_exact": sum(1 for t in results if not t.exact),
        "failed_trials": sum(1 for t in results if t.error),
        "persister_killed": sum(1 for t in results if t.persister_killed),
        "flash_trials": sum(1 for t in results if t.flash),
        "zombie_trials": sum(1 for t in results if t.zombie),
    }
    p50, p99 = percentile(times, 50), percentile(times, 99)
    phases = dict(Counter(t.phase for t in results if t.phase))
    elapsed = time.monotonic() - t0
    passed = not (
        counts["corrupt_marked_valid"]
        or counts["acknowledged_lost"]
        or counts["resume_not_exact"]
        or counts["failed_trials"]
    )
    summary = (
        f"campaign: {trials} trials (seed {seed}) in {elapsed:.0f}s: "
        f"{counts['corrupt_marked_valid']} corrupt marked valid, "
        f"{counts['acknowledged_lost']} acknowledged lost, "
        f"{counts['resume_not_exact']} inexact resumes, {counts['failed_trials']} failed; "
        f"recovery p50 {_s(p50)} p99 {_s(p99)} (mean "
        f"{_s(statistics.fmean(times) if times else None)}); kills landed: "
        + ", ".join(f"{k} {v}" for k, v in sorted(phases.items()))
        + f" -> {'PASS' if passed else 'FAIL'}"
    )
    return {
        **counts,
        "recovery_p50_s": p50,
        "recovery_p99_s": p99,
        "phases": phases,
        "elapsed_s": elapsed,
        "seed": seed,
        "passed": passed,
        "summary": summary,
        "trials_detail": [asdict(t) for t in results],
    }


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"
