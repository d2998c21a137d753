"""Which pods stopped because a newer writer holds their run (#28), and what the
``WriterFenced`` Event says of them."""

from __future__ import annotations

from typing import Any

from ckpt_operator.planners.fenced import fenced_message, fenced_pods
from tests.ckpt_operator.behaviours.test_writer_fenced import HOLDER, RUN, fenced_pod


def test_fenced_pods_are_told_from_crashed_ones(fixture: Any) -> None:
    crashed = fenced_pod(fixture, None)
    zombie = fenced_pod(fixture, HOLDER, "lastState")
    assert fenced_pods([crashed]) == []
    found = fenced_pods([crashed, zombie])
    assert [(f.pod, f.container, f.run_id, f.fenced) for f in found] == [
        ("mnist-ddp-worker-0", "pytorch", RUN, HOLDER)
    ]
    message = fenced_message("mnist-ddp", found[0])
    for part in ("mnist-ddp-worker-0", "generation 4", "mnist-ddp-r1-worker-0", "gpu-9"):
        assert part in message
    assert "not restarted" in message
    odd = fenced_pod(fixture, None)
    odd["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = '{"fenced": 1}'
    assert fenced_pods([odd]) == []  # not a report: not fenced
