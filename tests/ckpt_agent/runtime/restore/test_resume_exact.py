"""Bit-exact resume after a real SIGKILL of a separate training process.

The example script (AdamW, warm-up + step LR schedule, a GradScaler whose scale
changes, dropout, per-epoch shuffling seeded from the global RNG, gradient
clipping) is run three ways:

1. straight through (the reference);
2. with checkpointing, killed with SIGKILL at a random step, then resumed
   from the same storage (the ladder picks the newest checkpoint);
3. the same killed storage, but with the newest checkpoint's bytes corrupted:
   the ladder must reject it and fall back to an older one.

In every case the stitched loss trajectory and the final parameters are
bitwise identical to the straight run. Set ``CKPT_TEST_SEED`` to replay a
kill step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.format.layout import blob_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage.fs import LocalStorage

pytestmark = pytest.mark.slow

STEPS = 48
RUN = "run1"
POLICY = {
    "tiers": {
        "heartbeat": {"everySteps": 1},
        "pulse": {"baseInterval": 6, "minInterval": 3, "maxInterval": 8},
        "full": {"everySteps": 20},
    },
    "validation": {"loadInSubprocess": True},
    "retention": {"routineKeep": 4, "importantKeep": 4},
}


def _env(config: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env["CKPT_CONFIG"] = str(config)
    env["PYTHONHASHSEED"] = "0"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(
    example: Path, out: Path, *, config: Path | None, extra: list[str]
) -> subprocess.Popen[bytes]:
    """Start the example; its output goes to ``<out>.log``."""
    cmd = [
        sys.executable,
        str(example),
        "--steps",
        str(STEPS),
        "--seed",
        "3",
        "--out",
        str(out),
        *extra,
    ]
    if config is None:
        cmd.append("--no-checkpoint")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    else:
        env = _env(config)
    with open(f"{out}.log", "wb") as log:
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _finish(proc: subprocess.Popen[bytes], out: Path, timeout: float = 240) -> dict[str, Any]:
    try:
        proc.wait(timeout=timeout)
    finally:
        _reap(proc)
    log = Path(f"{out}.log").read_text(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill what is left of the process group this test started (the loader child)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(10)


def _log_steps(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue  # the line being written when the process died
        out[int(d["step"])] = str(d["loss"])
    return out


def _weights(store: LocalStorage) -> list[Any]:
    return [
        r
        for r in list_checkpoints(store, RUN)
        if r.has_weights and not r.lightweight and r.status != CheckpointStatus.CORRUPTED
    ]


def _stitch(killed: dict[int, str], resumed: dict[str, Any]) -> tuple[dict[int, str], int]:
    first = int(resumed["first_step"])
    stitched = {s: v for s, v in killed.items() if s < first}
    stitched.update({int(s): v for s, v in resumed["losses"].items()})
    return stitched, first


def test_bitwise_identical_resume_after_sigkill(
    tmp_path: Path, ck_config_file: Callable[..., Path], ck_example: Path
) -> None:
    seed = int(os.environ.get("CKPT_TEST_SEED", time.time_ns() % 1_000_000))
    kill_at = random.Random(seed).randint(20, 34)
    note = f"(CKPT_TEST_SEED={seed}, kill at step >= {kill_at})"

    killed_root = tmp_path / "killed"
    killed_cfg = ck_config_file("killed.json", root=killed_root, **POLICY)
    loss_log = tmp_path / "killed-losses.jsonl"
    straight = _start(ck_example, tmp_path / "straight.json", config=None, extra=[])
    victim = _start(
        ck_example,
        tmp_path / "killed.json.out",
        config=killed_cfg,
        extra=["--loss-log", str(loss_log), "--step-sleep", "0.08"],
    )
    store = LocalStorage(killed_root / "store")
    try:
        deadline = time.monotonic() + 180
        while True:
            assert victim.poll() is None, "training ended before it could be killed " + note
            assert time.monotonic() < deadline, "no checkpoint before the deadline " + note
            steps = _log_steps(loss_log)
            if steps and max(steps) >= kill_at and len(_weights(store)) >= 2:
                break
            time.sleep(0.02)
        os.kill(victim.pid, signal.SIGKILL)  # a real, unannounced death
        victim.wait(30)
    finally:
        _reap(victim)
    assert victim.returncode == -signal.SIGKILL
    reference = _finish(straight, tmp_path / "straight.json")
    killed_losses = _log_steps(loss_log)
    assert max(killed_losses) < STEPS - 1, "the victim must die before the end " + note

    # Two copies of the dead run's storage: one as is, one with its newest checkpoint damaged.
    shutil.copytree(killed_root / "store", tmp_path / "a" / "store")
    shutil.copytree(killed_root / "store", tmp_path / "b" / "store")
    store_b = LocalStorage(tmp_path / "b" / "store")
    newest = max(_weights(store_b), key=lambda r: r.step)
    _, manifest = read_checkpoint(store_b, RUN, newest.id)
    digest = manifest.tensors["model/0.weight"].chunks[0]
    blob = store_b.root / blob_key(RUN, digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 3] ^= 0x04
    blob.write_bytes(bytes(data))

    proc_a = _start(
        ck_example,
        tmp_path / "a.json",
        config=ck_config_file("a.json", root=tmp_path / "a", **POLICY),
        extra=[],
    )
    proc_b = _start(
        ck_example,
        tmp_path / "b.json",
        config=ck_config_file("b.json", root=tmp_path / "b", **POLICY),
        extra=[],
    )
    res_a = _finish(proc_a, tmp_path / "a.json")
    res_b = _finish(proc_b, tmp_path / "b.json")

    expected = {int(s): v for s, v in reference["losses"].items()}
    assert sorted(expected) == list(range(STEPS))

    # 1. resumed from the newest checkpoint
    assert res_a["resume"]["checkpoint_id"] == newest.id, note
    assert res_a["resume"]["exact"] is True
    stitched_a, first_a = _stitch(killed_losses, res_a)
    assert first_a == newest.step + 1
    assert stitched_a == expected, note
    assert res_a["final_params_sha256"] == reference["final_params_sha256"], note

    # 2. newest corrupted: rejected, the ladder falls back to an older one
    rejected = dict(map(tuple, res_b["resume"]["rejected"]))
    assert newest.id in rejected and "IntegrityError" in rejected[newest.id], (rejected, note)
    assert res_b["resume"]["checkpoint_id"] != newest.id
    stitched_b, first_b = _stitch(killed_losses, res_b)
    assert first_b < first_a
    assert stitched_b == expected, note
    assert res_b["final_params_sha256"] == reference["final_params_sha256"], note
    statuses = {r.id: r.status for r in list_checkpoints(store_b, RUN)}
    assert statuses.get(newest.id, CheckpointStatus.EXPIRED) in (
        CheckpointStatus.CORRUPTED,
        CheckpointStatus.EXPIRED,
    )
    # the resumed runs went on checkpointing after the resume
    store_a = LocalStorage(tmp_path / "a" / "store")
    assert (
        max(r.step for r in list_checkpoints(store_a, RUN) if r.tier != Tier.HEARTBEAT)
        > newest.step
    )
