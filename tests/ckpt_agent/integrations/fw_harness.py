"""The zygote's client: start trainers in it, watch and kill them (see zygote.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Child:
    pid: int
    out: Path

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout: float) -> int | None:
        """The exit code (None: killed, or still running at the deadline)."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive():
            return None
        exit_file = self.out / f"exit.{self.pid}"
        return int(exit_file.read_text()) if exit_file.exists() else None

    def error(self) -> str:
        err = self.out / f"error.{self.pid}.txt"
        return err.read_text() if err.exists() else ""


class Zygote:
    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().strip()
        if first != "ready":
            raise RuntimeError(f"the zygote did not start: {first!r}")

    def start(self, fn: str, out: Path, *args: object, env: dict[str, str]) -> Child:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        out.mkdir(parents=True, exist_ok=True)
        cmd = {"fn": fn, "args": list(args), "env": env, "out": str(out)}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return Child(int(self.proc.stdout.readline()), out)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def wait_for(cond: Callable[[], bool], timeout: float, children: list[Child]) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if not any(c.alive() for c in children):
            return cond()
        time.sleep(0.005)
    return False
