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


def test_passes_run_concurrently_up_to_the_workers_earliest_due_first() -> None:
    async def main() -> tuple[list[str], int]:
        gate = asyncio.Event()
        started: list[str] = []
        peak = running = 0

        async def reconcile(body: dict[str, Any]) -> None:
            nonlocal peak, running
            started.append(body["metadata"]["name"])
            running += 1
            peak = max(peak, running)
            await gate.wait()
            running -= 1

        now = [0.0]
        loop = RetentionLoop(reconcile, clock=lambda: now[0], workers=2)
        for name in ("late", "early", "middle", "last"):
            loop.upsert(policy(name, 60))
        for name, due in (("late", 3.0), ("early", 1.0), ("middle", 2.0), ("last", 4.0)):
            loop._policies[("ns", name)].due = due
        now[0] = 10.0
        tasks = loop.start_due()
        for _ in range(10):
            await asyncio.sleep(0)
        assert started == ["early", "middle"]  # two workers, the earliest due
        assert loop.start_due() == []  # never a second pass of a policy in one
        assert loop.running == {("ns", n) for n in ("late", "early", "middle", "last")}
        gate.set()
        await asyncio.gather(*tasks)
        return started, peak

    started, peak = asyncio.run(main())
    assert started == ["early", "middle", "late", "last"] and peak == 2


def test_a_pass_past_its_timeout_is_cancelled_and_the_others_go_on() -> None:
    async def main() -> tuple[RetentionLoop, list[str]]:
        done: list[str] = []

        async def reconcile(body: dict[str, Any]) -> None:
            if body["metadata"]["name"] == "stuck":
                await asyncio.sleep(3600)
            done.append(body["metadata"]["name"])

        loop = RetentionLoop(reconcile, clock=lambda: 0.0, workers=1, pass_timeout_s=0.05)
        loop.upsert(policy("stuck", 60))
        loop.upsert(policy("fine", 60))
        assert await loop.run_due() == 2
        return loop, done

    loop, done = asyncio.run(main())
    assert done == ["fine"] and loop.timeouts == 1
    assert loop.last_error is None  # the later pass succeeded
    assert loop.running == frozenset()


def test_stop_cancels_passes_in_flight() -> None:
    async def main() -> RetentionLoop:
        entered = asyncio.Event()

        async def reconcile(body: dict[str, Any]) -> None:
            entered.set()
            await asyncio.sleep(3600)

        loop = RetentionLoop(reconcile, clock=lambda: 0.0, tick_s=3600)
        loop.upsert(policy("p", 60))
        loop.start()
        await entered.wait()
        await loop.stop()
        return loop

    assert asyncio.run(main()).running == frozenset()
