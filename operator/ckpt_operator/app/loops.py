"""Background work without finalizers: the recovery scheduler and the retention loop
(and :class:`MemoryReturn`, which hands the memory of deleted objects back to the OS).

kopf daemons and timers put a finalizer on every object they run for; on a
user's PyTorchJob (or on policies when the chart is uninstalled) a finalizer
left behind by a stopped operator blocks deletion. These two small loops are
fed by kopf's watch events instead (``on.event``: no finalizer, no
annotations) and keep no state that matters: after an operator restart the
initial listing re-feeds them, and every step they take is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_agent.policy import RetentionSpec
from ckpt_agent.text import clean
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.config import OperatorConfig

__all__ = ["MemoryReturn", "RecoveryScheduler", "RetentionLoop", "malloc_trim"]

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str]

#: Upper bound of the error backoff.
MAX_ERROR_BACKOFF_S = 600.0


class RecoveryScheduler:
    """At most one recovery task per job; each re-reads the job before every attempt.

    ``fetch(namespace, name)`` returns the current job (None when deleted);
    ``recover(job)`` returns seconds until the next attempt, or None when done.
    """

    def __init__(
        self,
        fetch: Callable[[str, str], Awaitable[Obj | None]],
        recover: Callable[[Obj], Awaitable[float | None]],
        *,
        error_backoff_s: float = 15.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._fetch = fetch
        self._recover = recover
        self._error_backoff_s = error_backoff_s
        self._sleep = sleep
        self._tasks: dict[Key, asyncio.Task[None]] = {}

    @property
    def active(self) -> frozenset[Key]:
        return frozenset(k for k, t in self._tasks.items() if not t.done())

    def schedule(self, namespace: str, name: str) -> bool:
        """Start handling the job unless it is already being handled; True when started."""
        key = (namespace, name)
        task = self._tasks.get(key)
        if task is not None and not task.done():
            return False
        task = asyncio.create_task(self._run(key), name=f"recover {namespace}/{name}")
        self._tasks[key] = task
        task.add_done_callback(functools.partial(self._forget, key))
        return True

    def _forget(self, key: Key, task: asyncio.Task[None]) -> None:
        """A finished task leaves no trace (memory follows the jobs being recovered)."""
        if self._tasks.get(key) is task:
            del self._tasks[key]

    def cancel(self, namespace: str, name: str) -> None:
        task = self._tasks.pop((namespace, name), None)
        if task is not None:
            task.cancel()

    async def _run(self, key: Key) -> None:
        backoff = self._error_backoff_s
        while True:
            try:
                job = await self._fetch(*key)
                if job is None:
                    return
                delay = await self._recover(job)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("recovery of %s/%s failed; retrying in %.0fs", *key, backoff)
                await self._sleep(backoff)
                backoff = min(backoff * 2, MAX_ERROR_BACKOFF_S)
                continue
            if delay is None:
                return
            backoff = self._error_backoff_s
            await self._sleep(max(delay, 0.5))

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


@dataclass
class _Entry:
    body: Obj
    due: float


class RetentionLoop:
    """Runs ``reconcile(policy)`` for each known policy every ``reconcileIntervalSeconds``.

    Fair and bounded (issue #28): due policies start in the order they fell due, up to
    ``workers`` at once, never two passes of one policy together; each pass bounds itself
    (:class:`~ckpt_operator.planners.retention_plan.PassBudget`: ``--retention-budget``)
    and ``pass_timeout_s`` is the backstop: a pass still running then is cancelled (at an
    ``await``: a storage call already in its thread finishes its unit there — one
    listing, one batch of whole checkpoint deletions — and its result is dropped). So a
    slow tenant holds one worker for at most a budget, and another tenant's pass waits
    for a worker at most that long (with more slow tenants than workers, the tenants
    that fell due earlier go first).
    """

    def __init__(
        self,
        reconcile: Callable[[Obj], Awaitable[object]],
        *,
        clock: Callable[[], float],
        tick_s: float = 10.0,
        workers: int = 4,
        pass_timeout_s: float | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._reconcile = reconcile
        self._clock = clock
        self._tick_s = tick_s
        self.workers = workers
        self.pass_timeout_s = pass_timeout_s
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._policies: dict[Key, _Entry] = {}
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self.passes = 0
        self.timeouts = 0
        """Passes cancelled by ``pass_timeout_s`` (each also logged and in ``last_error``)."""
        self.last_error: str | None = None

    @classmethod
    def from_config(
        cls,
        reconcile: Callable[[Obj], Awaitable[object]],
        config: OperatorConfig,
        *,
        clock: Callable[[], float],
    ) -> RetentionLoop:
        """The loop the operator runs: ``--retention-tick``, ``--retention-workers``, and
        a backstop of the budget plus one storage call (``--storage-timeout``)."""
        r = config.retention
        return cls(
            reconcile,
            clock=clock,
            tick_s=r.tick_s,
            workers=r.workers,
            pass_timeout_s=r.budget_s + config.storage_timeout_s,
        )

    @staticmethod
    def interval_of(body: Mapping[str, Any]) -> float:
        raw = (Body(body).spec.get("retention") or {}).get("reconcileIntervalSeconds")
        try:
            return (
                float(raw) if raw is not None else float(RetentionSpec().reconcile_interval_seconds)
            )
        except (TypeError, ValueError):
            return float(RetentionSpec().reconcile_interval_seconds)

    def upsert(self, body: Obj) -> None:
        """Track a policy (new ones run on the next tick; updates keep their schedule)."""
        meta = meta_of(body)
        key = (str(meta.namespace), str(meta.name))
        entry = self._policies.get(key)
        if entry is None:
            self._policies[key] = _Entry(body, self._clock())
        else:
            entry.body = body

    def remove(self, namespace: str, name: str) -> None:
        self._policies.pop((namespace, name), None)

    @property
    def policies(self) -> frozenset[Key]:
        return frozenset(self._policies)

    @property
    def running(self) -> frozenset[Key]:
        """Policies whose pass is running or waiting for a worker."""
        return frozenset(k for k, t in self._running.items() if not t.done())

    def start_due(self) -> list[asyncio.Task[None]]:
        """Start a pass of every due policy not already in one (earliest due first; each
        waits for one of ``workers``); returns the tasks started."""
        now = self._clock()
        due = [
            (key, entry)
            for key, entry in self._policies.items()
            if entry.due <= now and key not in self.running
        ]
        due.sort(key=lambda ke: ke[1].due)  # stable: equal times keep their arrival order
        started = []
        for key, entry in due:
            entry.due = now + self.interval_of(entry.body)
            task = asyncio.create_task(self._pass(key, entry.body), name=f"retention {key}")
            self._running[key] = task
            task.add_done_callback(functools.partial(self._finished, key))
            started.append(task)
        self.passes += 1
        return started

    def _finished(self, key: Key, task: asyncio.Task[None]) -> None:
        if self._running.get(key) is task:
            del self._running[key]

    def _semaphore(self) -> asyncio.Semaphore:
        """The workers' semaphore of the running event loop (tests run several loops)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(self.workers))
        return self._slots[1]

    async def _pass(self, key: Key, body: Obj) -> None:
        async with self._semaphore():
            try:
                if self.pass_timeout_s is None:
                    await self._reconcile(body)
                else:
                    await asyncio.wait_for(self._reconcile(body), self.pass_timeout_s)
                self.last_error = None
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                self.timeouts += 1
                self.last_error = (
                    f"{key[0]}/{key[1]}: retention pass still running after "
                    f"{self.pass_timeout_s:.0f}s: cancelled, resumes next interval"
                )
                log.warning("%s", self.last_error)
            except Exception as e:
                self.last_error = clean(f"{key[0]}/{key[1]}: {e}")
                log.exception("retention of %s/%s failed", *key)

    async def run_due(self) -> int:
        """Reconcile every policy that is due and wait for those passes; returns how many
        ran."""
        started = self.start_due()
        if started:
            await asyncio.gather(*started, return_exceptions=True)
        return len(started)

    async def _forever(self) -> None:
        while True:
            self.start_due()  # passes run on their own: a slow one never holds the tick
            await asyncio.sleep(self._tick_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._forever(), name="retention loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        passes = list(self._running.values())
        self._running.clear()
        for t in passes:
            t.cancel()
        for t in passes:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``; None where the C library has none (musl, macOS)."""
    try:
        return functools.partial(ctypes.CDLL("libc.so.6").malloc_trim, 0)
    except (OSError, AttributeError):
        return None


class MemoryReturn:
    """Hands the heap memory of deleted objects back to the OS, shortly after they went.

    CPython gives freed objects back to the C allocator, and glibc keeps what it gets
    back in its arenas (one per thread that allocated) rather than returning it to the
    OS: after a wave of deleted jobs and pods the operator's RSS stayed near its peak.
    ``evicted()`` (the handlers of ``DELETED`` events call it) schedules one ``trim``
    ``delay_s`` later unless one is pending: a wave costs a trim every ``delay_s`` (a few
    milliseconds each) and one after its end; nothing happens without deletions.
    """

    def __init__(self, *, delay_s: float = 5.0, trim: Callable[[], object] | None = None) -> None:
        self.delay_s = delay_s
        self._trim = trim if trim is not None else malloc_trim()
        self._pending: asyncio.TimerHandle | None = None
        self.trims = 0

    def evicted(self) -> None:
        """Cached state of a deleted object was dropped (call from the event loop)."""
        if self._trim is None or self._pending is not None:
            return
        self._pending = asyncio.get_running_loop().call_later(self.delay_s, self._run)

    def _run(self) -> None:
        self._pending = None
        if self._trim is not None:
            self._trim()
        self.trims += 1

    def stop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
