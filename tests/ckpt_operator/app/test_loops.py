"""The recovery scheduler and the retention loop (no finalizers, fed by watch events)."""

from __future__ import annotations

import asyncio
from typing import Any

from ckpt_operator.app.loops import RecoveryScheduler, RetentionLoop


def test_one_task_per_job_until_done() -> None:
    async def main() -> list[str]:
        calls: list[str] = []
        delays = iter([0.0, None])
        gate = asyncio.Event()

        async def fetch(ns: str, name: str) -> dict[str, Any] | None:
            await gate.wait()
            return {"metadata": {"namespace": ns, "name": name}}

        async def recover(job: dict[str, Any]) -> float | None:
            calls.append(job["metadata"]["name"])
            return next(delays)

        async def no_sleep(_: float) -> None:
            await asyncio.sleep(0)

        s = RecoveryScheduler(fetch, recover, sleep=no_sleep)
        assert s.schedule("ns", "a") is True
        assert s.schedule("ns", "a") is False  # already being handled
        assert s.active == {("ns", "a")}
        gate.set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert s.active == frozenset()
        assert s.schedule("ns", "a") is True  # done: a later event may start it again
        await s.stop()
        return calls

    assert asyncio.run(main()) == ["a", "a"]


def test_errors_are_retried_with_backoff_and_deleted_jobs_end_the_task() -> None:
    async def main() -> tuple[list[float], int]:
        slept: list[float] = []
        fetched = 0

        async def fetch(ns: str, name: str) -> dict[str, Any] | None:
            nonlocal fetched
            fetched += 1
            if fetched <= 3:
                raise ConnectionError("api server unavailable")
            return None  # the user deleted the job meanwhile: never restarted

        async def recover(job: dict[str, Any]) -> float | None:
            raise AssertionError("not reached")

        async def fake_sleep(s: float) -> None:
            slept.append(s)

        sched = RecoveryScheduler(fetch, recover, error_backoff_s=1.0, sleep=fake_sleep)
        sched.schedule("ns", "gone")
        for _ in range(50):
            await asyncio.sleep(0)
        await sched.stop()
        return slept, fetched

    slept, fetched = asyncio.run(main())
    assert slept == [1.0, 2.0, 4.0] and fetched == 4


def test_cancel_stops_a_pending_recovery() -> None:
    async def main() -> bool:
        started = asyncio.Event()

        async def fetch(ns: str, name: str) -> dict[str, Any] | None:
            return {}

        async def recover(job: dict[str, Any]) -> float | None:
            started.set()
            return 3600.0  # long backoff

        sched = RecoveryScheduler(fetch, recover)
        sched.schedule("ns", "j")
        await started.wait()
        sched.cancel("ns", "j")
        await asyncio.sleep(0)
        return sched.active == frozenset()

    assert asyncio.run(main())


def policy(name: str, interval: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"retention": {}}
    if interval is not None:
        spec["retention"]["reconcileIntervalSeconds"] = interval
    return {"metadata": {"namespace": "ns", "name": name}, "spec": spec}


def test_each_policy_runs_at_its_own_interval() -> None:
    now = [1000.0]
    ran: list[str] = []

    async def reconcile(body: dict[str, Any]) -> None:
        ran.append(body["metadata"]["name"])
        if body["metadata"]["name"] == "boom":
            raise RuntimeError("storage down")

    loop = RetentionLoop(reconcile, clock=lambda: now[0])
    loop.upsert(policy("fast", 60))
    loop.upsert(policy("slow", 600))
    loop.upsert(policy("boom", None))  # default 300 s

    async def tick(at: float) -> int:
        now[0] = at
        return await loop.run_due()

    assert asyncio.run(tick(1000)) == 3
    assert loop.last_error is not None and "storage down" in loop.last_error
    assert asyncio.run(tick(1059)) == 0
    assert asyncio.run(tick(1060)) == 1
    assert asyncio.run(tick(1300)) == 2  # fast (due 1120) and boom (due 1300); slow: 1600
    loop.upsert(policy("fast", 10))  # an update keeps its schedule, takes the new interval
    loop.remove("ns", "slow")
    assert loop.policies == {("ns", "fast"), ("ns", "boom")}
    assert ran[:3] == ["fast", "slow", "boom"]
