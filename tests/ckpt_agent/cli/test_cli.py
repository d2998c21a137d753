"""``ckpt`` and ``ckpt-recover``: ls, verify, recover, gc, and their error messages."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_agent.cli import common
from ckpt_agent.cli.main import app, recover_app
from ckpt_agent.format.layout import audit_key, blob_key, recover_request_key, validation_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"
runner = CliRunner()


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables as wide as COLUMNS=200 says (the console is built at import, in whichever
    test imported it first: its width must not depend on the test order)."""
    monkeypatch.setattr(common.console, "_width", 200)


def _populate(store: LocalStorage, steps: tuple[int, ...] = (10, 20, 30)) -> list[str]:
    w = CheckpointWriter(store, RUN, chunk_bytes=4096)
    ids = []
    prev = None
    for step in steps:
        data = b"".join(struct.pack("<f", i * step) for i in range(4096))
        meta = CheckpointMeta(
            run_id=RUN,
            step=step,
            tier=Tier.PULSE,
            created_at=1e9 + step,
            sections=("model",),
            prev_hash=prev,
        )
        state = {"model": {"w": {"__tensor__": "model/w"}}}
        done = w.commit(
            meta,
            [
                w.write_rank(
                    meta, 0, state, [TensorSource("model/w", "float32", (4096,), memoryview(data))]
                )
            ],
        )
        cid = checkpoint_id(Tier.PULSE, step)
        store.commit(
            validation_key(RUN, cid),
            ValidationVerdict(cid, done.manifest_hash, CheckpointStatus.VALID).to_bytes(),
        )
        ids.append(cid)
        prev = done.manifest_hash
    return ids


def _invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    res = runner.invoke(app, list(args), env={"COLUMNS": "200", **(env or {})})
    return res.exit_code, res.output


def _corrupt(store: LocalStorage, cid: str) -> None:
    _, m = read_checkpoint(store, RUN, cid)
    path = store.root / blob_key(RUN, m.tensors["model/w"].chunks[0])
    data = bytearray(path.read_bytes())
    data[11] ^= 0x20
    path.write_bytes(bytes(data))


def test_help_teaches() -> None:
    code, out = _invoke("--help")
    assert code == 0
    for word in ("ls", "verify", "recover", "gc", "CKPT_STORAGE_URL"):
        assert word in out
    code, out = _invoke("recover", "--help")
    assert code == 0 and "--manual" in out and "--dry-run" in out and "--force" in out


def test_ls_table_and_json_from_env(ck_store: LocalStorage) -> None:
    ids = _populate(ck_store)
    env = {"CKPT_STORAGE_URL": str(ck_store.root), "CKPT_RUN_ID": RUN}
    code, out = _invoke("ls", env=env)
    assert code == 0, out
    for cid in ids:
        assert cid in out
    assert "valid" in out and "routine" in out
    code, out = _invoke("ls", "--json", env=env)
    rows = json.loads(out)
    assert [r["id"] for r in rows] == ids and rows[0]["size_bytes"] > 0


def test_clear_errors_for_missing_dir_unknown_run_and_step(
    ck_store: LocalStorage, tmp_path: Path
) -> None:
    _populate(ck_store)
    code, out = _invoke("ls", "--storage", str(tmp_path / "nope"), "--run-id", RUN)
    assert code == 2 and "storage directory" in out and "does not exist" in out
    code, out = _invoke("ls", "--storage", str(ck_store.root), "--run-id", "other")
    assert code == 2 and "run 'other' has no checkpoints" in out and "runs there: run1" in out
    code, out = _invoke(
        "recover", "--storage", str(ck_store.root), "--run-id", RUN, "--manual", "--step", "15"
    )
    assert code == 2 and "no checkpoint at step 15" in out and "10, 20, 30" in out
    code, out = _invoke(
        "verify", "pulse_step_000000000099", "--storage", str(ck_store.root), "--run-id", RUN
    )
    assert code == 2 and "no committed checkpoint pulse_step_000000000099" in out
    code, out = _invoke("ls", "--storage", str(ck_store.root))
    assert code == 2 and "--run-id" in out


def test_verify_reports_corrupted_data(ck_store: LocalStorage) -> None:
    ids = _populate(ck_store)
    args = ("--storage", str(ck_store.root), "--run-id", RUN)
    code, out = _invoke("verify", "--all", *args)
    assert code == 0, out
    assert out.count("ok") >= 3
    _corrupt(ck_store, ids[1])
    code, out = _invoke("verify", "--all", *args)
    assert code == 1
    assert "CORRUPTED" in out and "does not match its SHA-256" in out
    code, out = _invoke("verify", ids[0], *args)
    assert code == 0


def test_recover_manual_dry_run_force_and_audit(ck_store: LocalStorage) -> None:
    ids = _populate(ck_store)
    args = ("--storage", str(ck_store.root), "--run-id", RUN)
    code, out = _invoke("recover", "--manual", "--step", "20", "--dry-run", *args)
    assert code == 0, out
    assert "add --force" in out and f"with --force it would resume from {ids[1]}" in out
    assert not ck_store.exists(recover_request_key(RUN))
    code, out = _invoke("recover", "--manual", "--step", "20", *args)
    assert code == 1 and "--force" in out  # a named step needs force
    code, out = _invoke(
        "recover", "--manual", "--step", "20", "--force", "--reason", "loss spike at 25", *args
    )
    assert code == 0, out
    assert f"resumes from {ids[1]}" in out.replace("\n", " ")
    req = json.loads(ck_store.read(recover_request_key(RUN)))
    assert req["checkpoint_id"] == ids[1] and req["force"] and req["requested_by"]
    audit = [json.loads(line) for line in ck_store.read(audit_key(RUN)).splitlines()]
    assert audit[-1]["checkpoint"] == ids[1] and audit[-1]["reason"] == "loss spike at 25"
    assert audit[-1]["who"] and audit[-1]["time"] > 0


def test_recover_automatic_plan_skips_corrupted(ck_store: LocalStorage) -> None:
    ids = _populate(ck_store)
    _corrupt(ck_store, ids[2])
    code, out = _invoke("recover", "--dry-run", "--storage", str(ck_store.root), "--run-id", RUN)
    assert code == 0, out
    assert f"rejected {ids[2]}" in out
    assert f"would resume from {ids[1]}" in out


def test_ckpt_recover_entry_point(ck_store: LocalStorage) -> None:
    ids = _populate(ck_store)
    res = runner.invoke(
        recover_app,
        env={"COLUMNS": "200"},
        args=[
            "--storage",
            str(ck_store.root),
            "--run-id",
            RUN,
            "--manual",
            "--step",
            "10",
            "--force",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(ck_store.read(recover_request_key(RUN)))["checkpoint_id"] == ids[0]


def test_gc_dry_run_then_real(ck_store: LocalStorage, tmp_path: Path) -> None:
    ids = _populate(ck_store)
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"retention": {"routineKeep": 1}}))
    args = ("--storage", str(ck_store.root), "--run-id", RUN, "--config", str(cfg), "--grace", "0")
    code, out = _invoke("gc", "--dry-run", *args)
    assert code == 0, out
    assert "would delete 2 checkpoint(s)" in out
    assert len(list_checkpoints(ck_store, RUN)) == 3
    code, out = _invoke("gc", *args)
    assert code == 0, out
    assert [r.id for r in list_checkpoints(ck_store, RUN)] == [ids[2]]
    assert "deleted 2 checkpoint(s)" in out


def test_console_scripts_are_installed_and_torch_free(ck_store: LocalStorage) -> None:
    _populate(ck_store, (5,))
    code = (
        "import sys\n"
        "from ckpt_agent.cli.main import main\n"
        "try:\n"
        f"    main(['ls', '--storage', {str(ck_store.root)!r}, '--run-id', 'run1'])\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "pulse_step_000000000005" in out.stdout


@pytest.mark.parametrize("cmd", ["ls", "verify", "gc"])
def test_every_command_has_help(cmd: str) -> None:
    code, out = _invoke(cmd, "--help")
    assert code == 0 and "--storage" in out and "--run-id" in out


@pytest.mark.parametrize("cmd", ["ls", "verify", "gc"])
def test_the_configs_s3_section_opens_the_storage(
    cmd: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config``'s S3 section (endpoint, attempts) applies, as in the trainer: the command
    goes to the configured endpoint (here a closed port: refused at once, one attempt)."""
    for var in [v for v in os.environ if v.startswith(("CKPT_S3_", "AWS_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"s3": {"endpoint": endpoint, "maxAttempts": 1}}))
    storage = "s3://bucket/prefix"
    code, out = _invoke(cmd, "--storage", storage, "--run-id", RUN, "--config", str(cfg))
    assert code == 3, out  # the storage failed (exit code 3) ...
    assert endpoint in out and "after 1 attempt" in out, out  # ... at the configured endpoint
    with common.open_store(storage, common.load_policy(cfg)) as store:
        assert store.options.max_attempts == 1  # type: ignore[attr-defined]
