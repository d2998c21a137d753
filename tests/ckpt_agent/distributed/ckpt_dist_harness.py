"""Launch a ``torch.distributed`` job of N ranks from a test, bounded and cleaned up.

:func:`launch` starts the ranks (forkserver: torch is imported once, in the
server), lets the caller act on the running job (``during``: kill a rank, send
SIGTERM…), waits with a deadline and kills whatever is left. Each worker runs
``fn(rank, world_size, *args)`` after ``init_process_group("gloo")`` and
reports its exit code; tracebacks go to ``<out>/error.rank<r>.txt``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from ckpt_e2e.api import free_port

_CTX: ForkServerContext | None = None


def context() -> ForkServerContext:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        assert isinstance(ctx, ForkServerContext)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "ckpt_dist_workers"])
        _CTX = ctx
    return _CTX


@dataclass
class Job:
    procs: list[BaseProcess]
    out: Path
    started: float

    def pid(self, rank: int) -> int:
        pid = self.procs[rank].pid
        assert pid is not None
        return pid

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        if self.procs[rank].is_alive():
            os.kill(self.pid(rank), sig)

    def running(self) -> bool:
        """Every rank is still alive (a test waiting for progress stops when one died)."""
        return all(p.is_alive() for p in self.procs)

    def alive(self, rank: int) -> bool:
        return self.procs[rank].is_alive()

    def wait_file(self, path: Path, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return True
            if not any(p.is_alive() for p in self.procs):
                return path.exists()
            time.sleep(0.01)
        return False

    def errors(self) -> str:
        return "\n".join(
            p.read_text() for p in sorted(self.out.glob("error.rank*.txt")) if p.exists()
        )


def launch(
    fn: Callable[..., Any],
    world_size: int,
    out: Path,
    *args: Any,
    timeout: float = 60.0,
    during: Callable[[Job], None] | None = None,
) -> list[int | None]:
    """Run the job; returns every rank's exit code (-9: SIGKILL). Kills leftovers on timeout."""
    import ckpt_dist_workers as w

    out.mkdir(parents=True, exist_ok=True)
    ctx = context()
    port = free_port()
    procs: list[BaseProcess] = [
        ctx.Process(target=w.entry, args=(fn.__name__, r, world_size, port, str(out), args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    job = Job(procs, out, time.monotonic())
    deadline = time.monotonic() + timeout
    try:
        if during is not None:
            during(job)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout:g} s\n{job.errors()}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return [p.exitcode for p in procs]


def losses(out: Path, rank: int) -> dict[int, str]:
    """step → loss (hex) of ``losses.rank<r>.txt``; a resumed run's later lines win."""
    got: dict[int, str] = {}
    path = out / f"losses.rank{rank}.txt"
    if path.exists():
        for line in path.read_text().splitlines():
            step, loss = line.split()
            got[int(step)] = loss
    return got


def codes_ok(codes: Sequence[int | None], out: Path) -> None:
    if any(c != 0 for c in codes):
        errs = "\n".join(p.read_text() for p in sorted(out.glob("error.rank*.txt")))
        raise AssertionError(f"exit codes {list(codes)}\n{errs}")
