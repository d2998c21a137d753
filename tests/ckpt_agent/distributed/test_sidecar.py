"""Flash checkpoints end to end: a real trainer, a real persister process, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest
import torch

from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.runtime.shm.writer import ShmWriter
from ckpt_agent.storage.fs import LocalStorage

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

RUN = w.RUN
STEPS = 30


def _losses(out: Path) -> dict[int, str]:
    got: dict[int, str] = {}
    path = out / "losses.rank0.txt"
    if path.exists():
        for line in path.read_text().splitlines():
            step, loss = line.split()
            got[int(step)] = loss
    return got


def _sidecar_pids(work: Path) -> list[int]:
    """The local persister the trainer started (its pid file)."""
    path = work / "sidecar.rank0.pid"
    return [int(path.read_text())] if path.exists() else []


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def _cleanup(work: Path) -> None:
    for pid in _sidecar_pids(work):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("flash-ref") / "job"
    h.codes_ok(h.launch(w.train_flash, 1, out, STEPS, {"checkpoint": False}, timeout=90), out)
    return {"losses": _losses(out), "final": json.loads((out / "final.rank0.json").read_text())}


def test_sigkill_right_after_snapshot_loses_nothing(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    """The trainer dies (SIGKILL) right after a snapshot returned: the persister — a
    separate process — commits exactly that step, valid; the restarted trainer loads it
    from shared memory (verified) and the stitched run is bitwise the uninterrupted one."""
    out = tmp_path / "job"
    work = out / "work"
    try:
        # "wait": the save due at >= 12 is taken even when a loaded machine slows the
        # persister (a deferred one took no snapshot, and the kill must follow one)
        opts = {"die_after_save_at": 12, "backpressure": "wait"}
        codes = h.launch(w.train_flash, 1, out, STEPS, opts, timeout=90)
        assert codes == [-signal.SIGKILL]
        died = int((out / "died_after.txt").read_text())
        pids = _sidecar_pids(work)
        assert pids, "no local persister was started"
        assert _wait_gone(pids[-1], 60), "the persister did not finish after the trainer died"
        store = LocalStorage(tmp_path / "store")
        records = list_checkpoints(store, RUN, include_heartbeat=False)
        newest = records[-1]
        assert newest.step == died
        assert newest.status == CheckpointStatus.VALID
        events = [json.loads(x) for x in (work / "sidecar.jsonl").read_text().splitlines()]
        assert any(e["event"] == "trainer_died" for e in events)

        h.codes_ok(h.launch(w.train_flash, 1, out, STEPS, {}, timeout=90), out)
        resume = json.loads((out / "resume.rank0.json").read_text())
        assert resume["step"] == died + 1
        assert resume["action"] == "resume_shm", resume
        assert resume["exact"]
        assert _losses(out) == reference["losses"]
        assert json.loads((out / "final.rank0.json").read_text()) == reference["final"]
    finally:
        _cleanup(work)


def test_trainer_sigterm_takes_an_emergency_flash_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "job"
    work = out / "work"

    def term(job: h.Job) -> None:
        deadline = time.monotonic() + 60
        while job.running() and time.monotonic() < deadline and len(_losses(out)) < 9:
            time.sleep(0.01)
        job.kill(0, signal.SIGTERM)

    try:
        codes = h.launch(w.train_flash, 1, out, 100_000, {"sigterm": True}, timeout=90, during=term)
        assert codes == [143]
        store = LocalStorage(tmp_path / "store")
        last = list_checkpoints(store, RUN, include_heartbeat=False)[-1]
        assert last.tier == Tier.FULL and last.emergency
        assert last.step == max(_losses(out))
        assert "SIGTERM" in last.reason
        for pid in _sidecar_pids(work):
            assert _wait_gone(pid, 30)
        assert list_checkpoints(store, RUN, include_heartbeat=False)[-1].status == (
            CheckpointStatus.VALID
        )
    finally:
        _cleanup(work)


def _config(tmp_path: Path) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "runId": RUN,
            "storageUrl": (tmp_path / "store").as_uri(),
            "shmDir": str(tmp_path / "shm"),
            "workDir": str(tmp_path / "sidecar-work"),
            "validation": {"loadInSubprocess": False},
        }
    )


def test_sidecar_sigterm_drains_what_is_pending(tmp_path: Path) -> None:
    """``ckpt sidecar`` (a real process) gets SIGTERM while a snapshot waits: it persists
    it before exiting, well within the grace period."""
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(_config(tmp_path).to_json())
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_agent.cli", "sidecar", "--config", str(cfg_path),
         "--poll-s", "30", "--grace-s", "20", "--metrics-port", "0"],
        env=env, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        log = tmp_path / "sidecar-work" / "sidecar.jsonl"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not log.exists():
            time.sleep(0.02)
        assert log.exists(), "the sidecar did not start"
        time.sleep(0.3)  # it is now asleep for --poll-s
        writer = ShmWriter(tmp_path / "shm", RUN, 0)
        d = writer.write(7, Tier.FULL, {"model": {"w": torch.randn(256, 256)}})
        assert d is not None
        writer.close()  # the trainer is gone too
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    events = [json.loads(x) for x in log.read_text().splitlines()]
    assert any(e["event"] == "drain" for e in events)
    persisted = [e for e in events if e["event"] == "persisted"]
    assert persisted and persisted[-1]["step"] == 7 and persisted[-1]["committed"]
    store = LocalStorage(tmp_path / "store")
    assert [r.step for r in list_checkpoints(store, RUN, include_heartbeat=False)] == [7]
    mark = ShmReader(tmp_path / "shm", RUN, 0).persisted()
    assert mark is not None and mark.ok and mark.step == 7


def test_sidecar_serves_metrics_health_and_signals(tmp_path: Path) -> None:
    sidecar = Sidecar(_config(tmp_path), SidecarOptions(probe_every_s=0.05, poll_s=0.01))
    port = sidecar.serve_http(0, "127.0.0.1")
    stop = threading.Event()
    t = threading.Thread(target=sidecar.run, kwargs={"until": stop.is_set}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        health: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    health = json.loads(r.read())
                    if health.get("write_latency_ms") is not None:
                        break
            except urllib.error.HTTPError:
                pass
            time.sleep(0.05)
        assert health["healthy"] and health["storage_ok"]
        assert health["write_latency_ms"] > 0
        assert health["nvml"] in (True, False)  # no GPU here: not measured = healthy
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "ckpt_storage_write_latency_seconds" in text
        assert "ckpt_sidecar_healthy 1.0" in text
        published = json.loads((tmp_path / "shm" / RUN / "health.json").read_text())
        assert published["write_latency_ms"] > 0
    finally:
        stop.set()
        t.join(10)
        sidecar.close()


def test_ckpt_sidecar_runs_with_the_environment_the_operator_injects(tmp_path: Path) -> None:
    """The exact command the webhook injects (``ckpt sidecar``, no flags) with the injected
    ``CKPT_*`` variables: it serves health and metrics on ``CKPT_METRICS_PORT`` and exits
    cleanly on SIGTERM."""
    from ckpt_agent.policy import CheckpointPolicySpec
    from ckpt_agent.policy.agent_config import (
        ENV_CONFIG,
        ENV_METRICS_PORT,
        ENV_RUN_ID,
        ENV_SHM_DIR,
        ENV_SIGNAL_FILE,
        ENV_STORAGE_URL,
        ENV_WORK_DIR,
    )
    from ckpt_operator.planners.injection import InjectionContext

    command = list(InjectionContext(policy_name="p", run_id=RUN).sidecar_command)
    assert command == ["ckpt", "sidecar"]
    exe = Path(sys.executable).with_name(command[0])
    cfg = AgentConfig.from_policy(CheckpointPolicySpec(), run_id=RUN)
    (tmp_path / "config.json").write_text(cfg.to_json())
    port = h.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(
        {
            ENV_CONFIG: str(tmp_path / "config.json"),
            ENV_RUN_ID: RUN,
            ENV_STORAGE_URL: (tmp_path / "store").as_uri(),
            ENV_SHM_DIR: str(tmp_path / "shm"),
            ENV_SIGNAL_FILE: str(tmp_path / "signal"),
            ENV_METRICS_PORT: str(port),
            ENV_WORK_DIR: str(tmp_path / "work"),
        }
    )
    proc = subprocess.Popen([str(exe), *command[1:]], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        health = None
        while time.monotonic() < deadline and health is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    health = json.loads(r.read())
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.1)
        assert health is not None and health["healthy"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert b"ckpt_sidecar_healthy" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_sidecar_storage_gets_the_policys_s3_transfer_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persister opens storage with the policy's S3 part size, concurrency and attempts
    (from the mounted config, like the trainer), not only the ``CKPT_S3_*`` variables."""
    from ckpt_agent.storage.options import StorageOptions
    from ckpt_agent.storage.s3 import S3Storage

    for var in list(os.environ):
        if var.startswith("CKPT_S3_"):
            monkeypatch.delenv(var)
    seen: list[StorageOptions | None] = []

    def fake_from_url(cls: type, url: str, options: StorageOptions | None = None) -> LocalStorage:
        seen.append(options)
        return LocalStorage(tmp_path / "store")

    monkeypatch.setattr(S3Storage, "from_url", classmethod(fake_from_url))
    cfg = _config(tmp_path).model_copy(
        update={
            "storage_url": "s3://bucket/prefix",
            "s3": AgentConfig.model_validate(
                {
                    "s3": {
                        "endpoint": "http://minio:9000",
                        "partSizeMb": 64,
                        "maxConcurrency": 9,
                        "maxAttempts": 7,
                    }
                }
            ).s3,
        }
    )
    sidecar = Sidecar(cfg, SidecarOptions(probe_every_s=1000, metrics_port=0))
    try:
        (opts,) = seen
        assert opts is not None
        assert opts.part_size_bytes == 64 * 1024 * 1024
        assert opts.max_concurrency == 9
        assert opts.max_attempts == 7
        assert opts.endpoint_url == "http://minio:9000" and opts.use_path_style
    finally:
        sidecar.close()


def test_a_sigterm_while_the_sidecar_is_being_built_starts_the_drain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded node the sidecar's log exists seconds before its catalog and storage are
    open; a SIGTERM then (an eviction right after the start) must drain, not kill it."""
    from ckpt_agent.flash.sidecar import loop

    built = loop.Sidecar.__init__
    reasons: list[str] = []

    def slow_init(self: Any, *args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-construction
        built(self, *args, **kwargs)

    def drain(self: Any, reason: str) -> None:
        reasons.append(reason)
        self.drain.request(reason)

    monkeypatch.setattr(loop.Sidecar, "__init__", slow_init)
    monkeypatch.setattr(loop.Sidecar, "request_drain", drain)
    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        code = loop.run_sidecar(_config(tmp_path), SidecarOptions(poll_s=0.05, grace_s=5))
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    assert reasons == ["SIGTERM"]
    assert code == 0
