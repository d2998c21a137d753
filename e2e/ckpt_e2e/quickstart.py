"""The cluster-free quick start (``scripts/demo.sh --local``): a newcomer's first minutes.

No control plane, no Go tools: the example trainer (``examples/train_mnist_like.py``) runs
as a plain local process with the agent checkpointing to a local folder, exactly as in a
pod (the same environment variables the operator's webhook would inject):

1. an uninterrupted reference run of the same numbers (no agent), beside step 2;
2. the run with the agent, paced, SIGKILLed once a checkpoint past ``--kill-after`` is
   valid (heartbeats every step, pulses adaptive, a full every 50 steps);
3. the same command again, as a controller restarts a failed pod: the agent finds the
   run's newest valid checkpoint and resumes from it, and the run ends;
4. the check: every step's loss and the final parameters equal the reference's bit for
   bit; then ``ckpt report`` of the run (HTML and JSON) from its storage and logs.

Output under ``demo-output/<time>-local/`` (``latest-local`` points there). A couple of
minutes on 2 cores after the Python install; exit 1 when the resume is not exact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt_agent.cli.main import main as ckpt_main
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage.fs import LocalStorage

from .demo import DEFAULT_OUTPUT, Printer
from .procs import clean_env
from .tools import REPO_ROOT
from .training import Training, reference_run

TRAIN_SCRIPT = REPO_ROOT / "examples" / "train_mnist_like.py"
RUN_ID = "quickstart"
QUICK_TRAINING = Training(steps=120, seed=0, step_sleep=0.05)
#: The agent's policy (what a CheckpointPolicy would give the pod): demo-sized tiers.
CONFIG: dict[str, Any] = {
    "tiers": {
        "heartbeat": {"everySteps": 1},
        "pulse": {"baseInterval": 10, "minInterval": 5, "maxInterval": 20},
        "full": {"everySteps": 50},
    },
}


def _losses(loss_log: Path) -> dict[int, float]:
    """Every step's loss from the loss log, the last run of a step winning (a resume
    re-runs the steps after its checkpoint)."""
    out: dict[int, float] = {}
    for line in loss_log.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            d = json.loads(line)
            out[int(d["step"])] = float.fromhex(d["loss"])
    return out


def _last_step(loss_log: Path) -> int:
    try:
        return max(_losses(loss_log), default=-1)
    except OSError:
        return -1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/demo.sh --local",
        description="Train, SIGKILL, resume bit-exact and `ckpt report`, without a cluster.",
    )
    p.add_argument("--steps", type=int, default=QUICK_TRAINING.steps, help="training steps")
    p.add_argument(
        "--kill-after",
        type=int,
        default=None,
        help="SIGKILL once a checkpoint past this step is valid (default: steps / 2)",
    )
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="output root folder")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each phase")
    args = p.parse_args(argv)
    training = Training(
        steps=args.steps, seed=QUICK_TRAINING.seed, step_sleep=QUICK_TRAINING.step_sleep
    )
    kill_after = args.kill_after if args.kill_after is not None else args.steps // 2
    say = Printer()
    out = args.output.resolve() / (time.strftime("%Y%m%d-%H%M%S") + "-local")
    store, work = out / "storage", out / "work"
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        latest = args.output.resolve() / "latest-local"
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(out.name)
    (out / "ckpt-config.json").write_text(json.dumps(CONFIG, indent=1) + "\n")
    env = clean_env(
        {
            "CKPT_STORAGE_URL": store.as_uri(),
            "CKPT_RUN_ID": RUN_ID,
            "CKPT_WORK_DIR": str(work),
            "CKPT_CONFIG": str(out / "ckpt-config.json"),
            "PYTHONPATH": os.pathsep.join(
                [str(REPO_ROOT / "agent"), os.environ.get("PYTHONPATH", "")]
            ).rstrip(os.pathsep),
        }
    )
    loss_log = out / "losses.jsonl"

    def trainer(n: int, pace: float) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            str(TRAIN_SCRIPT),
            *training.numeric_args(),
            "--step-sleep",
            str(pace),
            "--out",
            str(out / f"attempt{n}.json"),
            "--loss-log",
            str(loss_log),
        ]
        log = (out / f"attempt{n}.log").open("wb")
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    say("ckpt-operator quick start (no cluster)", style="title")
    say(f"output: {out}")
    say(f"1. reference: {training.steps} steps without checkpointing (beside step 2) ...")
    # its own process, started now: its interpreter start overlaps the first run's
    pool = ThreadPoolExecutor(max_workers=1)
    reference = pool.submit(reference_run, training, out / "reference", args.timeout)
    pool.shutdown(wait=False)

    say(
        f"2. training with the agent (storage {store}), SIGKILL once a checkpoint past "
        f"step {kill_after} is valid ..."
    )
    first = trainer(1, training.step_sleep)
    storage = LocalStorage(store)
    deadline = time.monotonic() + args.timeout
    newest = None
    while time.monotonic() < deadline and first.poll() is None:
        valid = [
            r
            for r in list_checkpoints(storage, RUN_ID)
            if r.status == CheckpointStatus.VALID and r.tier in (Tier.PULSE, Tier.FULL)
        ]
        newest = max(valid, key=lambda r: r.step, default=None)
        if newest is not None and newest.step >= kill_after:
            break
        time.sleep(0.2)
    if first.poll() is not None or newest is None or newest.step < kill_after:
        first.kill()
        say(
            f"the first run ended or stalled before a checkpoint past step {kill_after} "
            f"(exit {first.poll()}); see {out / 'attempt1.log'}",
            style="bad",
        )
        return 1
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = _last_step(loss_log)
    say(f"   SIGKILL at step {killed_at}; newest valid checkpoint then: {newest.id}", style="warn")

    ref = reference.result()
    say(
        f"   reference done: final loss {float.fromhex(ref['losses'][str(training.steps - 1)]):.6f}"
    )
    say("3. the same command again (as a controller restarts a failed pod) ...")
    t_restart = time.monotonic()
    second = trainer(2, 0.0)
    try:
        code = second.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        second.kill()
        code = -1
    if code != 0:
        say(f"the resumed run failed (exit {code}); see {out / 'attempt2.log'}", style="bad")
        return 1
    res = json.loads((out / "attempt2.json").read_text())
    resume = res.get("resume") or {}
    say(
        f"   resumed from {resume.get('checkpoint_id')} at step {resume.get('step')} "
        f"({resume.get('action')}), finished in {time.monotonic() - t_restart:.1f}s"
    )

    got = _losses(loss_log)
    want = {int(s): float.fromhex(v) for s, v in ref["losses"].items()}
    differ = [s for s in sorted(want) if got.get(s) != want[s]]
    same_params = res.get("final_params_sha256") == ref.get("final_params_sha256")
    exact = not differ and same_params
    say("4. check against the uninterrupted run ...")
    say(
        f"   every step's loss bit-exact: {not differ}"
        + (f" (first difference at step {differ[0]})" if differ else ""),
        style="ok" if not differ else "bad",
    )
    say(f"   final parameters identical: {same_params}", style="ok" if same_params else "bad")

    html, doc = out / "checkpointing.html", out / "checkpointing.json"
    report = ["report", "--storage", str(store), "--run-id", RUN_ID, "--work-dir", str(work)]
    for extra in (["--out", str(html)], ["--json", "--out", str(doc)]):
        try:  # the real command line, in this process (it may end in SystemExit(0))
            ckpt_main([*report, *extra])
        except SystemExit as e:
            if e.code:
                say(f"ckpt {' '.join([*report, *extra])} failed (exit {e.code})", style="bad")
                return 1
    by_tier: dict[str, int] = {}
    for r in list_checkpoints(storage, RUN_ID, include_heartbeat=True):
        by_tier[r.tier.value] = by_tier.get(r.tier.value, 0) + 1
    print(
        f"""
Summary
  run              {RUN_ID}: {training.steps} steps, SIGKILLed at step {killed_at}
  resumed from     {resume.get("checkpoint_id")} (step {resume.get("step")}), exact: {exact}
  checkpoints      {", ".join(f"{k} {v}" for k, v in sorted(by_tier.items()))}
  report           {html} (`ckpt report`: open in a browser; JSON: {doc.name})
  made by          ckpt {" ".join(report)}
  storage, logs    {store}, {work}
  next             scripts/demo.sh: the same on a local Kubernetes control plane, with the
                   operator restarting the job (builds its Go tools once: see README)""",
        flush=True,
    )
    say("done", style="ok" if exact else "bad")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
