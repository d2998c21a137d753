"""The operator's node warnings in the agent: signal file → ``node_warning`` → hazard."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.decide.scheduler import AdaptiveScheduler
from ckpt_agent.decide.signals import SystemSignals
from ckpt_agent.flash.sidecar.drain import Drain
from ckpt_agent.flash.sidecar.metrics import SidecarMetrics
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.dist.agreement import DecisionAgreement, LocalSignals
from ckpt_agent.runtime.dist.comm import LocalComm
from ckpt_agent.runtime.save.signals import SignalWatch

from ..test_checkpointer import Trainer, _events, _started

ConfigFactory = Callable[..., AgentConfig]


def _write(path: Path, text: str) -> None:
    """Change the file like the kubelet refreshing a downward-API volume."""
    path.write_text(text)
    ns = time.time_ns() + 10**9
    os.utime(path, ns=(ns, ns))


def test_watch_holds_a_warning_until_it_is_cleared(tmp_path: Path) -> None:
    sig = tmp_path / "save-now"
    sig.write_text("")
    watch = SignalWatch(str(sig))
    watch.arm()
    _write(sig, "NodeCordoned-0123456789ab warning node n1 is cordoned (spec.unschedulable)")
    got = watch.poll()
    assert got is not None and got.kind == "warning" and got.request == "NodeCordoned-0123456789ab"
    assert got.message == "node n1 is cordoned (spec.unschedulable)"
    _write(sig, "NodeCordoned-0123456789ab clear node n1: the warning went")
    got = watch.poll()
    assert got is not None and got.kind == "clear"
    _write(sig, "request-42")
    got = watch.poll()
    assert got is not None and got.kind == "save" and got.message == "request-42"


def test_warning_saves_raises_the_hazard_and_a_clear_relaxes_it(
    ck_config: ConfigFactory, tmp_path: Path
) -> None:
    sig = tmp_path / "save-now"
    sig.write_text("")
    cfg = ck_config(
        signalFile=str(sig),
        tiers={"pulse": {"baseInterval": 100, "minInterval": 1, "maxInterval": 500}},
        scheduler={"risk": {"warningHoldSeconds": 0.5, "warnedFraction": 0.5}},
    )
    t, ckpt = _started(cfg, Trainer(), steps=3)
    calm = ckpt.step(3, t.step())
    assert calm.warning is None and calm.hazard == 0.5  # calm: half the failures announced

    _write(sig, "NodeCordoned-0123456789ab warning node n1 is cordoned (spec.unschedulable)")
    warned = ckpt.step(4, t.step())
    assert warned.emergency and warned.tier == Tier.FULL  # one save, as a save-now
    assert "save-now signal" in warned.reason
    assert warned.warning is not None and "node n1 is cordoned" in warned.warning
    assert warned.hazard > 1.0
    held = ckpt.step(5, t.step())  # the warning holds at every step until cleared
    assert held.warning is not None and "node warning" in held.warning and held.hazard > 1.0
    assert not held.emergency

    _write(sig, "NodeCordoned-0123456789ab clear node n1: the warning went")
    time.sleep(0.6)  # the warning holds risk.warningHoldSeconds after its last signal
    relaxed = ckpt.step(6, t.step())
    assert relaxed.warning is None and relaxed.hazard == 0.5 and not relaxed.emergency
    ckpt.close()
    kinds = [e["kind"] for e in _events(cfg, "signal")]
    assert kinds == ["warning", "clear"]
    logged = [e for e in _events(cfg, "decision") if e.get("step") == 5]
    assert logged and logged[0]["hazard"] > 1.0 and logged[0]["warning"]


def test_plain_save_now_raises_no_hazard(ck_config: ConfigFactory, tmp_path: Path) -> None:
    sig = tmp_path / "save-now"
    sig.write_text("")
    cfg = ck_config(signalFile=str(sig), scheduler={"risk": {"warnedFraction": 0.0}})
    t, ckpt = _started(cfg, Trainer(), steps=2)
    _write(sig, "EvictionByEvictionAPI-0123456789ab")
    d = ckpt.step(2, t.step())
    assert d.emergency and d.warning is None and d.hazard == 1.0
    assert ckpt.step(3, t.step()).warning is None
    ckpt.close()


def test_sidecar_logs_a_warning_and_its_clearing_counting_only_requests(tmp_path: Path) -> None:
    sig = tmp_path / "save-now"
    sig.write_text("")
    events: list[tuple[str, dict[str, Any]]] = []
    metrics = SidecarMetrics()

    def emit(event: str, **fields: Any) -> None:
        events.append((event, fields))

    drain = Drain(5.0, metrics, emit, signal_file=str(sig))
    drain.poll_signal()  # the content at start is no request
    for content in ("NodeCordoned-ab warning node n1 is cordoned", "NodeCordoned-ab clear calm"):
        sig.write_text(content)
        drain.poll_signal()
    assert [kw["kind"] for _, kw in events] == ["warning", "clear"]
    value = metrics.registry.get_sample_value(
        "ckpt_sidecar_emergency_saves_total", {"trigger": "signal"}
    )
    assert value == 1.0


class _TwoRanks(LocalComm):
    """Rank 0 of two; rank 1 sends the same row, with or without its node warning."""

    def __init__(self, other_warned: bool) -> None:
        super().__init__()
        self.other_warned = other_warned

    def all_gather_f64(self, values: Sequence[float]) -> list[list[float]]:
        other = list(values)
        other[-1] = 1.0 if self.other_warned else 0.0  # the warning flag is the last field
        return [list(values), other]

    def all_gather_json(self, obj: Any, *, fixed: int | None = None) -> list[Any]:
        del fixed
        return [obj, obj]


@pytest.mark.parametrize("warned", [False, True])
def test_a_node_warning_on_one_rank_holds_for_every_rank(warned: bool) -> None:
    s = AdaptiveScheduler(start_time=0.0)
    agreed = DecisionAgreement(_TwoRanks(warned)).agree(
        s, LocalSignals(step=1, loss=1.0, system=SystemSignals()), now=1.0
    )
    d = agreed.decision
    assert (d.warning is not None) == warned
    if warned:
        assert "node warning on rank(s) [1]" in d.warning and d.hazard > 1.0
