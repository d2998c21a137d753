"""Background work yields to training: lower CPU and I/O priority, sized to the usable cores.

The agent's own threads (persister, validator, heartbeat writer, and the pools they
start) and the validation process call :func:`lower_thread_priority` /
:func:`lower_process_priority` first: a nice value :data:`BACKGROUND_NICE` above the
trainer's and the lowest best-effort I/O priority, so that where the cores are
shared the scheduler runs the training thread first. Both are per thread on Linux
and inherited by the threads and processes started afterwards; where the kernel
refuses (another OS, a seccomp profile) nothing changes and nothing fails.

:func:`usable_cpus` is what the container may actually run on: the CPU affinity
mask, capped by the cgroup's CPU quota (v2 ``cpu.max``, v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``) — not ``os.cpu_count()``, which
counts the node's cores. Torch-free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import platform
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

__all__ = [
    "BACKGROUND_NICE",
    "background_threads",
    "libc",
    "lower_process_priority",
    "lower_thread_priority",
    "start_background",
    "usable_cpus",
]

BACKGROUND_NICE = 10
"""Nice increment of the agent's background work over the trainer's (CFS weight ~1/9)."""

_IOPRIO_CLASS_BE = 2
_IOPRIO_LOWEST = 7
_IOPRIO_WHO_PROCESS = 1
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30}
_CGROUP = Path("/sys/fs/cgroup")


def _quota_cpus(root: Path = _CGROUP) -> float | None:
    """The cgroup's CPU quota in cores (None: unlimited or unknown)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return q / p if q > 0 and p > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(cgroup_root: Path = _CGROUP) -> int:
    """Cores this process may use: the affinity mask capped by the cgroup CPU quota (≥ 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _quota_cpus(cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def background_threads(limit: int) -> int:
    """How many threads a background pool may run: ``limit``, at most the usable cores
    less the one the trainer runs on (at least 1)."""
    return max(1, min(limit, usable_cpus() - 1))


@cache
def libc() -> ctypes.CDLL | None:
    """The C library (None where it cannot be loaded); loaded once per process."""
    try:
        return ctypes.CDLL(None, use_errno=True)  # the process's own symbols: no ldconfig
    except (OSError, TypeError):
        pass
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def _syscall() -> object | None:
    lib = libc()
    return getattr(lib, "syscall", None) if lib is not None else None


def _lower_io(who: int) -> bool:
    fn = _syscall()
    nr = _SYS_IOPRIO_SET.get(platform.machine())
    if fn is None or nr is None:
        return False
    prio = (_IOPRIO_CLASS_BE << 13) | _IOPRIO_LOWEST
    try:
        return int(fn(nr, _IOPRIO_WHO_PROCESS, who, prio)) == 0  # type: ignore[operator]
    except (OSError, ctypes.ArgumentError):
        return False


def _lower_cpu(who: int) -> bool:
    try:
        now = os.getpriority(os.PRIO_PROCESS, who)
        os.setpriority(os.PRIO_PROCESS, who, min(19, now + BACKGROUND_NICE))
        return True
    except (AttributeError, OSError):
        return False


def lower_thread_priority() -> bool:
    """Lower the calling thread's CPU and I/O priority (Linux: per thread); True when the
    CPU priority was lowered. Call it first thing in a background thread."""
    tid = threading.get_native_id()
    if platform.system() != "Linux":
        return False
    _lower_io(tid)
    return _lower_cpu(tid)


def start_background(work: Callable[[], None], name: str, what: str) -> threading.Thread:
    """Run ``work`` on a new daemon thread at lower priority; a failure is logged (``what``
    failed), never raised: it is work that only saves time later."""

    def run() -> None:
        lower_thread_priority()
        try:
            work()
        except Exception:
            logging.getLogger(__name__).warning("%s failed", what, exc_info=True)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def lower_process_priority() -> bool:
    """Lower this whole process's CPU and I/O priority (a background child process, at its
    start, before it starts threads); True when the CPU priority was lowered."""
    try:
        os.nice(BACKGROUND_NICE)
        ok = True
    except (AttributeError, OSError):
        ok = False
    if platform.system() == "Linux":
        _lower_io(0)
    return ok
