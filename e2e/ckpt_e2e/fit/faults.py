"""Test-only fault hooks for FIT trainers and persisters (never imported by the agent).

A fault is a JSON object in ``CKPT_FIT_FAULT``; :func:`install_from_env` applies it in the
process that reads it (the FIT trainer calls :func:`install` after its fork, a persister
subprocess gets it through ``inject/sitecustomize.py``). Hooks sit at the storage's OS
boundary (the ``os`` functions :mod:`ckpt_agent.storage.fs` calls) or at the agent's
public entry points; the agent itself has no fault code.

Keys (all optional):

``kill``
    ``{"point": "blob" | "manifest" | "commit" | "verdict", "after_commits": N,
    "marker": PATH}``: SIGKILL this process at that point of a save once it has published
    ``N`` pulse/full COMMITs itself: half-way through writing a blob, just before the rank
    manifest, just before the COMMIT, or just before the validation verdict. One shot
    across processes: the first to fire creates ``marker``; none fires once it exists.
``delay``
    ``{"seconds": S, "after_commits": N, "marker": PATH, "until_file": PATH,
    "armed_by": PATH}``: sleep ``S`` seconds before writing a blob (once this process
    published ``N`` COMMITs; one shot via ``marker``), so that a snapshot is still
    unpersisted when the harness kills the persister; with ``until_file``, only until that
    file exists (at most ``S``): the test decides when the save goes on; with ``armed_by``,
    only once that file exists: the test decides which save stalls, however fast the
    trainer runs.
``errors``
    a list of ``{"errno": "EIO" | "ENOSPC" | "EROFS", "op": "read" | "write" | "create",
    "names": [substrings] | null, "while_file": PATH | null, "times": N | null}``: the
    storage's ``os`` call fails with that errno (for objects whose file name contains one
    of ``names``; any when null) while ``while_file`` exists (always when null); with
    ``times``, only the first ``N`` calls per file name fail (a transient error).
``crash_on_resume_at_or_after``
    ``STEP``: the process exits with code 3 right after ``Checkpointer.start()`` resumed
    at ``STEP`` or later (a checkpoint that crashes every run resumed from it).
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import signal
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ENV = "CKPT_FIT_FAULT"
NVML_FILE_ENV = "CKPT_FIT_NVML_FILE"
#: Folders the harness puts first on a child's PYTHONPATH.
INJECT_DIR = Path(__file__).resolve().parent / "inject"
FAKE_NVML_DIR = Path(__file__).resolve().parent / "nvml"
#: Exit code of a process the ``crash_on_resume_at_or_after`` fault ended.
CRASH_EXIT = 3

_installed: dict[str, Any] = {}


def install_from_env() -> None:
    raw = os.environ.get(ENV)
    if raw:
        install(json.loads(raw))


def install(spec: Mapping[str, Any]) -> None:
    """Apply ``spec`` in this process (idempotent per process)."""
    if _installed.get("spec") == dict(spec):
        return
    _installed["spec"] = dict(spec)
    if spec.get("kill"):
        _install_kill(dict(spec["kill"]))
    if spec.get("delay"):
        _install_delay(dict(spec["delay"]))
    if spec.get("errors"):
        _install_errors([dict(r) for r in spec["errors"]])
    if spec.get("crash_on_resume_at_or_after") is not None:
        _install_crash_on_resume(int(spec["crash_on_resume_at_or_after"]))


# --------------------------------------------------------------------------- kill points
def _fire(marker: str | None) -> None:
    if _claim(marker):
        os.kill(os.getpid(), signal.SIGKILL)


def _install_kill(kill: dict[str, Any]) -> None:
    from ckpt_agent.format.layout import COMMIT, VALIDATION
    from ckpt_agent.storage import fs, fs_writer

    point = str(kill["point"])
    after = int(kill.get("after_commits", 0))
    marker = kill.get("marker")
    commits = {"n": 0}

    def armed() -> bool:
        return commits["n"] >= after and not (marker and os.path.exists(marker))

    original_commit = fs.LocalStorage.commit
    original_exclusive = fs.LocalStorage.create_exclusive
    original_write = fs_writer.FileWriter._write

    def before(key: str) -> bool:
        """Fire at the point; True when ``key`` is a routine COMMIT (counted once published)."""
        name = key.rsplit("/", 1)[-1]
        routine = "/steps/" in key and "heartbeat" not in key
        if armed() and routine:
            if point == "manifest" and name.startswith("rank") and name.endswith(".json"):
                _fire(marker)
            if point == "commit" and name == COMMIT:
                _fire(marker)
            if point == "verdict" and name == VALIDATION:
                _fire(marker)
        return routine and name == COMMIT

    def commit(self: fs.LocalStorage, key: str, data: bytes) -> None:
        counted = before(key)
        original_commit(self, key, data)
        if counted:
            commits["n"] += 1

    def create_exclusive(self: fs.LocalStorage, key: str, data: bytes) -> bool:
        # the fenced writer publishes its COMMIT and rank manifest this way (issue #28)
        counted = before(key)
        won = original_exclusive(self, key, data)
        if counted and won:
            commits["n"] += 1
        return won

    def write(self: fs_writer.FileWriter, data: memoryview) -> None:
        if point == "blob" and "/blobs/" in self.key and armed() and len(data) > 1:
            original_write(self, data[: len(data) // 2])
            _fire(marker)
        original_write(self, data)

    fs.LocalStorage.commit = commit  # type: ignore[method-assign]
    fs.LocalStorage.create_exclusive = create_exclusive  # type: ignore[method-assign]
    fs_writer.FileWriter._write = write  # type: ignore[method-assign]


def _install_delay(delay: dict[str, Any]) -> None:
    from ckpt_agent.storage import fs, fs_writer

    seconds = float(delay["seconds"])
    after = int(delay.get("after_commits", 0))
    marker = delay.get("marker")
    until = delay.get("until_file")
    armed_by = delay.get("armed_by")
    commits = {"n": 0}
    original_commit = fs.LocalStorage.commit
    original_exclusive = fs.LocalStorage.create_exclusive
    original_write = fs_writer.FileWriter._write

    def commit(self: fs.LocalStorage, key: str, data: bytes) -> None:
        original_commit(self, key, data)
        if "/steps/" in key and key.endswith("/COMMIT"):
            commits["n"] += 1

    def create_exclusive(self: fs.LocalStorage, key: str, data: bytes) -> bool:
        won = original_exclusive(self, key, data)
        if won and "/steps/" in key and key.endswith("/COMMIT"):
            commits["n"] += 1
        return won

    def write(self: fs_writer.FileWriter, data: memoryview) -> None:
        if (
            "/blobs/" in self.key
            and commits["n"] >= after
            and (not armed_by or os.path.exists(armed_by))
            and _claim(marker)
        ):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not (until and os.path.exists(until)):
                time.sleep(min(0.05, seconds))
        original_write(self, data)

    fs.LocalStorage.commit = commit  # type: ignore[method-assign]
    fs.LocalStorage.create_exclusive = create_exclusive  # type: ignore[method-assign]
    fs_writer.FileWriter._write = write  # type: ignore[method-assign]


def _claim(marker: str | None) -> bool:
    """True for the first caller across processes (always when there is no marker)."""
    if not marker:
        return True
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{os.getpid()}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


# --------------------------------------------------------------------------- errno faults
class _Rule:
    def __init__(self, rule: dict[str, Any]) -> None:
        self.errno = int(getattr(errno_mod, str(rule["errno"])))
        self.op = str(rule["op"])
        self.names = [str(n) for n in rule["names"]] if rule.get("names") else None
        self.while_file = rule.get("while_file")
        self.times = int(rule["times"]) if rule.get("times") is not None else None
        self.fired: dict[str, int] = {}

    def hits(self, op: str, name: str) -> bool:
        if op != self.op:
            return False
        if self.names is not None and not any(n in name for n in self.names):
            return False
        if self.while_file is not None and not os.path.exists(self.while_file):
            return False
        if self.times is not None:
            if self.fired.get(name, 0) >= self.times:
                return False
            self.fired[name] = self.fired.get(name, 0) + 1
        return True

    def error(self, name: str) -> OSError:
        return OSError(self.errno, os.strerror(self.errno) + " (FIT fault)", name)


class _FaultyOs(types.ModuleType):
    """``os`` as :mod:`ckpt_agent.storage.fs` sees it: same functions, some fail."""

    def __init__(self, rules: list[_Rule]) -> None:
        super().__init__("os")
        self._rules = rules
        self._names: dict[int, str] = {}

    def __getattr__(self, attr: str) -> Any:
        return getattr(os, attr)

    def _check(self, op: str, name: str) -> None:
        for rule in self._rules:
            if rule.hits(op, name):
                raise rule.error(name)

    def open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        name = os.fsdecode(path)
        creating = bool(flags & os.O_CREAT)
        self._check("create" if creating else "read", name.rsplit("/", 1)[-1])
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
        self._names[fd] = name
        return fd

    def write(self, fd: int, data: Any) -> int:
        self._check("write", self._names.get(fd, "").rsplit("/", 1)[-1])
        return os.write(fd, data)

    def close(self, fd: int) -> None:
        self._names.pop(fd, None)
        os.close(fd)


def _install_errors(rules: list[dict[str, Any]]) -> None:
    from ckpt_agent.storage import fs, fs_writer

    faulty = _FaultyOs([_Rule(r) for r in rules])  # one fd table: opened here, written there
    fs.os = faulty  # type: ignore[attr-defined]
    fs_writer.os = faulty  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- poisoned resume
def _install_crash_on_resume(step: int) -> None:
    from ckpt_agent.runtime import checkpointer

    original: Callable[..., Any] = checkpointer.Checkpointer.start

    def start(self: Any) -> Any:
        resume = original(self)
        if resume.step >= step:
            print(f"FIT fault: crashing after a resume at step {resume.step}", flush=True)
            os._exit(CRASH_EXIT)
        return resume

    checkpointer.Checkpointer.start = start  # type: ignore[method-assign]
