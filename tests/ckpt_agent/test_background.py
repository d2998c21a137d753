"""Background work yields: the usable cores from affinity and cgroup quota, lower priority."""

from __future__ import annotations

import os
import platform
import threading
from pathlib import Path

import pytest

from ckpt_agent.background import (
    BACKGROUND_NICE,
    background_threads,
    lower_thread_priority,
    usable_cpus,
)


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("files", "cap"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # v2, unlimited
        ({"cpu.max": "150000 100000\n"}, 2),  # v2, 1.5 cores: 2 threads may run
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files: the affinity mask alone
    ],
)
def test_usable_cpus_is_the_affinity_capped_by_the_cgroup_quota(
    tmp_path: Path, files: dict[str, str], cap: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    want = _affinity() if cap is None else min(_affinity(), cap)
    assert usable_cpus(tmp_path) == want
    assert 1 <= background_threads(8) <= max(1, usable_cpus() - 1)


@pytest.mark.skipif(platform.system() != "Linux", reason="per-thread nice is Linux's")
def test_a_background_thread_runs_at_a_higher_nice_than_the_trainer() -> None:
    trainer = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int] = {}

    def work() -> None:
        assert lower_thread_priority()
        tid = threading.get_native_id()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        child = threading.Thread(
            target=lambda: seen.update(
                child=os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            )
        )
        child.start()
        child.join()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen["nice"] == min(19, trainer + BACKGROUND_NICE)
    assert seen["child"] == seen["nice"]  # the threads its pools start inherit it
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == trainer
