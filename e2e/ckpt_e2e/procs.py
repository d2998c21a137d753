"""Child processes that never outlive the harness.

Every process runs in its own process group (``start_new_session``), with stdout and
stderr going to a log file. ``stop()`` signals the whole group (SIGTERM, then SIGKILL
after a grace period). Live processes are tracked in a registry that an ``atexit`` hook
and SIGTERM/SIGHUP handlers drain, and, on Linux, children started from the main
thread also get ``PR_SET_PDEATHSIG=SIGKILL`` so that even a SIGKILLed harness leaves no
orphans behind (the death signal fires when the *thread* that forked them exits, which
is why it is only set from the main thread).

Processes that outlive their group are found too: :func:`container_pids` finds a local
container's processes by the ``CKPT_E2E_CONTAINER`` marker in their environment, and
:func:`stop_workdir` stops the detached processes a persistent cluster recorded with
:func:`record_pid`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1
#: Environment marker of every process a local container started (``<pod uid>/<container>``).
CONTAINER_ENV = "CKPT_E2E_CONTAINER"
#: File under a cluster workdir listing ``<pid> <name>`` of each component it started.
PIDS_FILE = "pids"
_registry: set[ManagedProcess] = set()
_released: list[ManagedProcess] = []  # detached processes left running: never garbage-collected
_registry_lock = threading.Lock()


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The harness environment without proxy variables (everything here is 127.0.0.1)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.lower() not in {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}
    }
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra or {})
    return env


class ManagedProcess:
    """One child process in its own process group, logging to ``log_path``.

    ``detached=True``: no parent-death signal and no atexit kill, so the process may
    outlive the harness (``LocalCluster(persistent=True)``); stop it with ``stop()`` or
    by its process group id.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str | os.PathLike[str]],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        stop_signal: int = signal.SIGTERM,
        grace: float = 10.0,
        detached: bool = False,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.env = dict(env) if env is not None else clean_env()
        self.cwd = cwd
        self.stop_signal = stop_signal
        self.grace = grace
        self.detached = detached
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._stopped = False

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"$ {' '.join(self.argv)}\n".encode())
        self._log.flush()
        main = threading.current_thread() is threading.main_thread()
        preexec: Callable[[], None] | None = (
            _set_pdeathsig if main and sys.platform == "linux" and not self.detached else None
        )
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=preexec,  # noqa: PLW1509 - only prctl(), async-signal-safe
        )
        if not self.detached:
            with _registry_lock:
                _registry.add(self)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group (the child and anything it spawned)."""
        if self.proc is None or self._stopped:
            return
        self._killpg(sig)

    def _killpg(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.wait(timeout=timeout)

    def stop(self, grace: float | None = None) -> int | None:
        """Stop the whole process group: ``stop_signal``, then SIGKILL after ``grace`` s."""
        if self.proc is None:
            return None
        if self._stopped:  # never signal a (possibly recycled) process group twice
            return self.proc.returncode
        self._stopped = True
        grace = self.grace if grace is None else grace
        if self.proc.poll() is None:
            self._killpg(self.stop_signal)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Always sweep the group: children may outlive a leader that exited.
        self._killpg(signal.SIGKILL)
        try:
            rc: int | None = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        with _registry_lock:
            _registry.discard(self)
        return rc

    def release(self) -> None:
        """Leave the process running and stop managing it (closes our copy of the log fd)."""
        if self._log is not None:
            self._log.close()
            self._log = None
        with _registry_lock:
            _registry.discard(self)
            _released.append(self)  # a collected Popen of a live child warns

    def tail(self, max_bytes: int = 6000) -> str:
        """The end of this process's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_bytes))
                data = f.read()
        except OSError as e:
            return f"<no log: {e}>"
        return data.decode(errors="replace")

    def __repr__(self) -> str:
        state = "running" if self.running else f"exited {self.poll()}"
        return f"<ManagedProcess {self.name} pid={self.proc and self.proc.pid} {state}>"


def stop_all(grace: float = 3.0) -> None:
    """Kill every process still registered (last resort at exit)."""
    with _registry_lock:
        procs = list(_registry)
    for p in reversed(procs):
        with contextlib.suppress(Exception):
            p.stop(grace=grace)


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    interval: float = 0.25,
    on_poll: Callable[[], None] | None = None,
) -> object:
    """Poll ``predicate`` until it returns something truthy; TimeoutError after ``timeout``.

    Exceptions raised by the predicate count as "not yet" (the last one is reported).
    ``on_poll`` runs each round and may raise to abort early (e.g. a process died).
    """
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        if on_poll is not None:
            on_poll()
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:
            last_exc = e
        if time.monotonic() > deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


atexit.register(stop_all)


def container_pids(marker: str) -> list[int]:
    """Processes (other than this one) whose environment carries ``CONTAINER_ENV=marker``."""
    needle = f"{CONTAINER_ENV}={marker}".encode() + b"\0"
    out: list[int] = []
    me = os.getpid()
    with contextlib.suppress(OSError):
        entries = os.listdir("/proc")
        for entry in entries:
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if needle in env or env.endswith(needle[:-1]):
                out.append(int(entry))
    return out


def record_pid(workdir: Path, process: ManagedProcess) -> None:
    """Append ``process`` to ``workdir/pids`` (read back by :func:`stop_workdir`)."""
    with open(Path(workdir) / PIDS_FILE, "a") as f:
        f.write(f"{process.pid} {process.name}\n")


def stop_workdir(workdir: Path, grace: float = 10.0) -> list[str]:
    """Stop the processes a (persistent) cluster recorded in ``workdir/pids``."""
    pids_file = Path(workdir) / PIDS_FILE
    stopped: list[str] = []
    if not pids_file.exists():
        return stopped
    entries = [line.split(maxsplit=1) for line in pids_file.read_text().splitlines() if line]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        for pid, _name in reversed(entries):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pid), sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_group_alive(int(p)) for p, _ in entries):
            time.sleep(0.2)
    stopped = [f"{name} (pid {pid})" for pid, name in entries]
    pids_file.unlink()
    return stopped


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def install_signal_handlers() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit so that atexit/finally blocks run."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):

            def _handler(signum: int, _frame: object) -> None:
                stop_all()
                raise SystemExit(128 + signum)

            signal.signal(sig, _handler)
