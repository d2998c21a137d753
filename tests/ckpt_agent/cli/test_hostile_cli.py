"""``ckpt`` against storage someone tampered with (issue #17): real checkpoints, then edited.

Stored strings with rich markup or terminal escape sequences are shown escaped;
absurd numbers are formatted, not crashed on; bad option values are usage
errors; every failure is one ``error:`` line and a documented exit code, never
a traceback.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ckpt_agent.cli.common import ExitCode, guarded, human_size, plain, safe, when
from ckpt_agent.cli.main import app
from ckpt_agent.errors import (
    CheckpointFormatError,
    IntegrityError,
    NotFoundError,
    PermanentStorageError,
    RetryableStorageError,
    UnsafePathError,
)
from ckpt_agent.format.layout import (
    AUDIT_TAIL_BYTES,
    audit_key,
    blob_key,
    commit_key,
    rank_manifest_key,
    validation_key,
)
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.housekeeping import append_audit, read_audit_tail
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.report.data import load_run
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"
runner = CliRunner()
#: Markup rich cannot parse ("[/]" closes nothing), a colour, a screen clear, a window title,
#: a newline and a right-to-left override.
EVIL = "[/][bold red]pwned[/bold red]\x1b[31mred\x1b[2J\x1b]0;title\x07\nnext\u202eevil"


def _commit(store: LocalStorage, step: int, *, anomaly: str | None = None, key: str = "w") -> str:
    """A committed, validated one-rank pulse checkpoint holding one 16 KiB tensor ``model/w``,
    at ``model/<key>`` of its state tree (with another key the tree references a tensor
    the manifest does not hold: it does not decode)."""
    writer = CheckpointWriter(store, RUN, chunk_bytes=1 << 20)
    meta = CheckpointMeta(
        RUN, step, Tier.PULSE, created_at=1e9 + step, sections=("model",), anomaly=anomaly
    )
    data = memoryview(struct.pack("<4096f", *(float(i * step) for i in range(4096))))
    ref = "model/w" if key == "w" else f"model/{key}"
    state = {"model": {key: {"__tensor__": ref}}}
    rank = writer.write_rank(meta, 0, state, [TensorSource("model/w", "float32", (4096,), data)])
    done = writer.commit(meta, [rank])
    cid = checkpoint_id(Tier.PULSE, step)
    verdict = ValidationVerdict(cid, done.manifest_hash, CheckpointStatus.VALID)
    store.commit(validation_key(RUN, cid), verdict.to_bytes())
    return cid


def _invoke(store: LocalStorage, *args: str) -> tuple[int, str]:
    res = runner.invoke(
        app,
        list(args),
        env={"COLUMNS": "250", "CKPT_STORAGE_URL": str(store.root), "CKPT_RUN_ID": RUN},
    )
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    return res.exit_code, res.output


def _error_line(out: str) -> str:
    """The one ``error:`` line of a failed command."""
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out
    return lines[0]


def _assert_defused(out: str) -> None:
    """Nothing from storage reached the terminal as a control character."""
    assert not any(c in out for c in "\x1b\x07\u202e"), out
    assert "\\x1b[2J" in out and "\\x07" in out and "\\u202e" in out
    assert "[/][bold red]pwned[/bold red]" in out  # shown as text, not styled


def _set_verdict(store: LocalStorage, cid: str, status: CheckpointStatus, reason: str) -> None:
    commit_hash = json.loads(store.read(validation_key(RUN, cid)))["commit_sha256"]
    store.commit(
        validation_key(RUN, cid), ValidationVerdict(cid, commit_hash, status, reason).to_bytes()
    )


def _edit_commit(store: LocalStorage, cid: str, old: bytes, new: bytes) -> None:
    raw = store.read(commit_key(RUN, cid))
    assert old in raw
    (store.root / commit_key(RUN, cid)).write_bytes(raw.replace(old, new))


# --------------------------------------------------------------------------- escaping


def test_ls_escapes_markup_and_escape_sequences_from_storage(ck_store: LocalStorage) -> None:
    cid = _commit(ck_store, 10, anomaly=EVIL)
    _set_verdict(ck_store, cid, CheckpointStatus.CORRUPTED, EVIL)
    code, out = _invoke(ck_store, "ls")
    assert code == 0, out
    assert cid in out and "corrupted" in out
    _assert_defused(out)
    code, out = _invoke(ck_store, "ls", "--json")
    assert code == 0, out
    rows = json.loads(out)
    assert rows[0]["flags"] == EVIL and rows[0]["reason"] == EVIL  # verbatim, JSON-escaped
    assert "\x1b" not in out


def test_verify_and_recover_escape_stored_names_and_reasons(ck_store: LocalStorage) -> None:
    good = _commit(ck_store, 10)
    bad = _commit(ck_store, 20, key=EVIL)  # hashes fine, does not decode: the key is quoted
    code, out = _invoke(ck_store, "verify", "--all")
    assert code == ExitCode.PROBLEM and f"CORRUPTED {bad}" in out, out
    _assert_defused(out)
    code, out = _invoke(ck_store, "recover", "--dry-run")  # no prev-hash chain: one rung
    assert code == ExitCode.PROBLEM, out
    assert f"rejected {bad}" in out
    _assert_defused(out)
    assert "nothing to recover from" in _error_line(out)
    _set_verdict(ck_store, bad, CheckpointStatus.CORRUPTED, EVIL)
    code, out = _invoke(ck_store, "recover", "--dry-run")
    assert code == 0, out
    assert f"skipped {bad}" in out and f"would resume from {good}" in out


def test_error_messages_escape_what_they_quote(ck_store: LocalStorage) -> None:
    _commit(ck_store, 10)
    code, out = _invoke(ck_store, "verify", "[/]\x1b[2J")
    assert code == ExitCode.USAGE
    line = _error_line(out)
    assert "no committed checkpoint [/]\\x1b[2J" in line and "\x1b" not in out


def test_safe_and_plain() -> None:
    assert plain("ok [b]x[/b] ünïcode") == "ok [b]x[/b] ünïcode"
    assert plain("a\x1b[2Jb\nc\x00\x9b\u202e") == "a\\x1b[2Jb\\nc\\x00\\x9b\\u202e"
    assert safe("[/]") == "\\[/]" and safe("[bold]x") == "\\[bold]x"
    long = plain("x" * 10_000)
    assert len(long) == 500 and long.endswith("(9524 more characters)")
    assert plain("x" * 10_000, None) == "x" * 10_000


# --------------------------------------------------------------------------- absurd numbers


@pytest.mark.parametrize("created_at", [b"1e400", b"-1e400", b"NaN", b"-5", b"1e300", b"0"])
def test_ls_survives_absurd_timestamps(ck_store: LocalStorage, created_at: bytes) -> None:
    cid = _commit(ck_store, 10)
    _edit_commit(ck_store, cid, b'"created_at":1000000010.0', b'"created_at":' + created_at)
    code, out = _invoke(ck_store, "ls")
    assert code == 0, out
    assert cid in out
    code, out = _invoke(ck_store, "ls", "--json")
    assert code == 0, out

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    rows = json.loads(out, parse_constant=no_constants)
    assert rows[0]["id"] == cid


def test_ls_survives_an_absurd_size(ck_store: LocalStorage) -> None:
    cid = _commit(ck_store, 10)
    raw = ck_store.read(commit_key(RUN, cid))
    size = json.loads(raw)["size_bytes"]
    huge = b'"size_bytes":' + b"9" * 400
    _edit_commit(ck_store, cid, b'"size_bytes":%d' % size, huge)
    code, out = _invoke(ck_store, "ls")
    assert code == 0, out
    assert cid in out


@pytest.mark.parametrize(
    ("t", "shown"),
    [(0, ""), (float("inf"), "? (inf)"), (float("nan"), "? (nan)"), (-5.0, "? (-5.0)")],
)
def test_when_is_defensive(t: float, shown: str) -> None:
    assert when(t) == shown
    assert when(1e300).startswith("?") and when(1e9).startswith("2001-")


def test_human_size_is_defensive() -> None:
    assert human_size(2048) == "2.0 KiB"
    assert human_size(-1) == "? (-1)"
    assert human_size(10**400).startswith("? (1000")
    assert human_size(float("nan")) == "? (nan)"  # type: ignore[arg-type]


# --------------------------------------------------------------------------- option values


@pytest.mark.parametrize("grace", ["nan", "-1", "inf", "-inf"])
def test_gc_refuses_a_grace_that_is_not_a_finite_non_negative_number(
    ck_store: LocalStorage, grace: str
) -> None:
    _commit(ck_store, 10)
    orphan = ck_store.root / blob_key(RUN, "ab" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"a blob a writer is about to commit")
    code, out = _invoke(ck_store, "gc", "--grace", grace)
    assert code == ExitCode.USAGE
    assert "--grace" in out and "finite number of seconds >= 0" in out
    assert orphan.exists()  # nothing ran


@pytest.mark.parametrize(
    "args",
    [
        ("sidecar", "--poll-s", "nan"),
        ("sidecar", "--grace-s", "-1"),
        ("sidecar", "--commit-timeout-s", "inf"),
        ("sidecar", "--wait-for-trainer-s", "-0.5"),
        ("sidecar", "--probe-every-s", "nan"),
        ("sidecar", "--metrics-port", "70000"),
        ("sidecar", "--rank", "-1"),
        ("recover", "--manual", "--step", "-1"),
    ],
)
def test_other_numeric_options_are_checked(ck_store: LocalStorage, args: tuple[str, ...]) -> None:
    code, out = _invoke(ck_store, *args)
    assert code == ExitCode.USAGE, out
    assert args[-2] in out


def test_sidecar_refuses_a_bad_grace_from_the_environment(tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["sidecar"], env={"CKPT_SHM_DIR": str(tmp_path), "CKPT_GRACE_S": "nan"}
    )
    assert res.exit_code == ExitCode.USAGE, res.output
    assert "CKPT_GRACE_S='nan' is not a finite number" in _error_line(res.output)


def test_sidecar_config_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "cfg.json"
    bad.write_text("{not json")
    for args in (["--config", str(bad)], ["--config", str(tmp_path / "missing.json")]):
        res = runner.invoke(app, ["sidecar", *args], env={"CKPT_SHM_DIR": str(tmp_path)})
        assert res.exit_code == ExitCode.USAGE, res.output
        assert "cannot load the agent config from --config" in _error_line(res.output)
        assert "Traceback" not in res.output


# --------------------------------------------------------------------------- errors


def test_gc_with_a_symlinked_blobs_folder_is_one_line_and_exit_4(
    ck_store: LocalStorage, tmp_path: Path
) -> None:
    _commit(ck_store, 10)
    outside = tmp_path / "outside" / "sha256" / "ab"
    outside.mkdir(parents=True)
    (outside / ("ab" * 32)).write_bytes(b"not yours")
    blobs = ck_store.root / RUN / "blobs"
    os.rename(blobs, ck_store.root / RUN / "old-blobs")
    os.symlink(tmp_path / "outside", blobs)
    code, out = _invoke(ck_store, "gc", "--grace", "0")
    assert code == ExitCode.UNSAFE
    line = _error_line(out)
    assert "unsafe storage" in line and "symbolic link" in line and "remove it" in line
    assert (outside / ("ab" * 32)).read_bytes() == b"not yours"


def test_recover_with_a_planted_audit_log_is_one_line(ck_store: LocalStorage) -> None:
    _commit(ck_store, 10)
    os.mkfifo(ck_store.root / RUN / "audit.log")
    code, out = _invoke(ck_store, "recover", "--manual", "--step", "10", "--force")
    assert code == ExitCode.UNSAFE, out
    assert "unsafe storage" in _error_line(out)


def test_report_skips_hostile_audit_lines(ck_store: LocalStorage) -> None:
    """Nesting past the recursion limit, huge numbers, a list, bad UTF-8: skipped, never
    ``internal error``; the good entries are reported."""
    _commit(ck_store, 10)
    good = {"time": 1e9, "who": "me@host", "what": "manual recovery requested"}
    lines = [
        json.dumps(good).encode(),
        b"[" * 100_000,
        b'{"time": ' + b"9" * 5000 + b"}",
        b'{"time": 1e400}',
        b"[1, 2]",
        b"\xff\xfe",
    ]
    ck_store.commit(audit_key(RUN), b"\n".join(lines) + b"\n")
    assert load_run(ck_store, RUN).audit == [good]
    page = ck_store.root.parent / "report.html"
    code, out = _invoke(
        ck_store, "report", "--storage", str(ck_store.root), "--run-id", RUN, "--out", str(page)
    )
    assert code == 0 and "internal error" not in out, out
    assert page.is_file()


def test_the_audit_log_is_read_from_its_tail_only(
    ck_store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged multi-MiB audit log: readers take its last whole lines, within the limit,
    and an append keeps the log bounded instead of growing it."""
    line = b'{"what":"old"}\n'
    ck_store.commit(audit_key(RUN), b"x" * 100 + line * (AUDIT_TAIL_BYTES // len(line) + 10))
    tail, cut = read_audit_tail(ck_store, RUN, limit=10 * len(line) + 3)
    assert cut and tail == line * 10  # whole lines only
    asked: list[int | None] = []
    real = LocalStorage.read

    def spy(self: LocalStorage, key: str, start: int = 0, length: int | None = None) -> bytes:
        asked.append(length)
        return real(self, key, start, length)

    monkeypatch.setattr(LocalStorage, "read", spy)
    append_audit(ck_store, RUN, {"what": "new"})
    assert asked and all(n is not None and n <= AUDIT_TAIL_BYTES + 1 for n in asked)
    log = ck_store.root.joinpath(audit_key(RUN)).read_bytes()
    assert len(log) <= AUDIT_TAIL_BYTES + 100 and log.startswith(line)
    assert log.endswith(b'{"what":"new"}\n')


def test_recover_when_the_request_cannot_be_written(ck_store: LocalStorage) -> None:
    _commit(ck_store, 10)
    (ck_store.root / RUN / "RECOVER.json").mkdir()
    (ck_store.root / RUN / "RECOVER.json" / "keep").write_bytes(b"x")
    code, out = _invoke(ck_store, "recover", "--manual", "--step", "10", "--force")
    assert code == ExitCode.STORAGE, out
    assert "storage failed" in _error_line(out) and "RECOVER.json" in _error_line(out)


def test_gc_skips_blob_collection_while_a_manifest_is_unreadable(ck_store: LocalStorage) -> None:
    cid = _commit(ck_store, 10)
    orphan = ck_store.root / blob_key(RUN, "cd" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"unreferenced, but who knows")
    (ck_store.root / rank_manifest_key(RUN, cid, 0)).write_bytes(b"{not json")
    code, out = _invoke(ck_store, "gc", "--grace", "0")
    assert code == ExitCode.PROBLEM
    line = _error_line(out)
    assert "blob collection skipped" in line and "rank_00000.json" in line
    assert orphan.exists()


@pytest.mark.parametrize(
    ("error", "code", "words"),
    [
        (UnsafePathError("x is a symbolic link"), ExitCode.UNSAFE, "unsafe storage"),
        (RetryableStorageError("timed out"), ExitCode.STORAGE, "try again"),
        (PermanentStorageError("permission denied"), ExitCode.STORAGE, "permissions"),
        (NotFoundError("gone"), ExitCode.STORAGE, "storage failed"),
        (OSError(5, "Input/output error"), ExitCode.STORAGE, "storage failed"),
        (CheckpointFormatError("bad \x1b[2J manifest"), ExitCode.DATA, "ckpt verify --all"),
        (IntegrityError("flipped"), ExitCode.DATA, "malformed checkpoint data"),
        (ZeroDivisionError("oops"), ExitCode.INTERNAL, "CKPT_DEBUG=1"),
    ],
)
def test_guarded_maps_every_error_to_one_line_and_an_exit_code(
    error: Exception, code: ExitCode, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = typer.Typer()

    @demo.command()
    @guarded
    def boom(name: str = "") -> None:
        """Fail."""
        raise error

    monkeypatch.delenv("CKPT_DEBUG", raising=False)
    res = runner.invoke(demo, [])
    assert res.exit_code == code and isinstance(res.exception, SystemExit)
    assert words in _error_line(res.output) and "\x1b" not in res.output
    monkeypatch.setenv("CKPT_DEBUG", "1")
    res = runner.invoke(demo, [])
    assert res.exception is error  # the traceback, for whoever debugs


def test_help_lists_the_exit_codes() -> None:
    res = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    for words in ("2 bad usage", "3 storage failed", "4 unsafe storage", "70 internal"):
        assert words in " ".join(res.output.split())
    res = runner.invoke(app, ["gc", "--help"], env={"COLUMNS": "200"})
    assert "finite, >= 0" in res.output and "unreadable" in " ".join(res.output.split())


def test_a_planted_file_name_in_a_warning_reaches_the_terminal_escaped(
    ck_store: LocalStorage,
) -> None:
    """A link named with ANSI/OSC escapes and a bidi override, skipped by the listing: the
    warning names it, escaped (the real ``ckpt``: logging's last resort prints it)."""
    import subprocess
    import sys

    cid = _commit(ck_store, 10)
    name = "x\x1b[2J\x1b]0;pwned\x07\u202eevil\nline"
    (ck_store.root / RUN / "steps" / cid / name).symlink_to("/etc/hostname")
    for args in (["ls"], ["gc", "--grace", "0"]):
        res = subprocess.run(
            [sys.executable, "-m", "ckpt_agent.cli", *args],
            env={**os.environ, "CKPT_STORAGE_URL": str(ck_store.root), "CKPT_RUN_ID": RUN},
            capture_output=True,
            text=True,
            errors="surrogateescape",
            timeout=120,
            check=False,
        )
        assert "skipped" in res.stderr, (args, res.stdout, res.stderr)
        assert not any(c in res.stderr + res.stdout for c in "\x1b\x07\u202e"), res.stderr
        assert "x\\x1b[2J\\x1b]0;pwned\\x07\\u202eevil\\nline" in res.stderr
