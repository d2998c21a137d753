"""SavePath: back-pressure (defer / wait), the hand-off, errors reported once (an Engine
over fakes, a scripted Persister)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytest
import runtime_fakes as fk
import torch

from ckpt_agent import tuning
from ckpt_agent.decide.decision import Decision, SaveOutcome, SaveResult
from ckpt_agent.errors import PersistError, RetryableStorageError
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine, Handover
from ckpt_agent.runtime.save.saving import SavePath
from ckpt_agent.runtime.save.snapshot import JobError

ConfigFactory = Callable[..., AgentConfig]


class ScriptedPersister:
    """A Persister whose busy flag, errors and results the test sets."""

    def __init__(self) -> None:
        self.busy = False
        self.saved: list[tuple[Decision, dict[str, bytes]]] = []
        self.waited = 0
        self.polled = 0
        self.errors: list[JobError] = []

    def start(self, handover: Handover) -> None:
        del handover

    def prepare(self, step: int) -> None:
        del step

    def wait_free(self) -> None:
        self.waited += 1
        self.busy = False

    def wait_persisted(self, timeout: float | None = None) -> bool:
        return True

    def wait_validated(self, timeout: float | None = None) -> bool:
        return True

    def save(self, decision: Decision, files: dict[str, bytes]) -> str | None:
        self.saved.append((decision, files))
        return f"{decision.tier}-{decision.step}"

    def poll(self) -> None:
        self.polled += 1

    def take_errors(self) -> list[JobError]:
        errs, self.errors = self.errors, []
        return errs

    def system_signals(self) -> tuple[int | None, float | None]:
        return None, None

    def close(self, timeout: float | None) -> None:
        del timeout


def _path(
    config: AgentConfig,
    backpressure: Literal["defer", "wait"] = "defer",
    on_error: Literal["raise", "warn", "auto"] = "auto",
) -> tuple[SavePath, ScriptedPersister, Engine, list[SaveOutcome]]:
    engine, _ = fk.make_engine(config)
    capture = StateCapture(engine, torch.nn.Linear(2, 2), train_config={"lr": 0.1})
    persister = ScriptedPersister()
    settled: list[SaveOutcome] = []
    engine.scheduler.settle = settled.append  # type: ignore[method-assign]
    return SavePath(engine, capture, persister, backpressure, on_error), persister, engine, settled


def _decision(step: int = 5, tier: Tier = Tier.PULSE, **kw: Any) -> Decision:
    return Decision(step=step, save=True, tier=tier, **kw)


def _events(engine: Engine, name: str) -> list[dict[str, Any]]:
    import json

    engine.decisions.flush()
    lines = (engine.work_dir / f"decisions.rank{engine.ranks.rank}.jsonl").read_text()
    return [e for e in map(json.loads, lines.splitlines()) if e["event"] == name]


def test_a_save_while_the_persister_is_busy_is_deferred_and_the_scheduler_told(
    ck_config: ConfigFactory,
) -> None:
    path, persister, engine, settled = _path(ck_config())
    persister.busy = True
    assert path.save(_decision(7)) is None
    assert persister.saved == [] and persister.waited == 0
    assert [(o.result, o.tier, o.step) for o in settled] == [(SaveResult.DEFERRED, Tier.PULSE, 7)]
    assert engine.stats.deferred == 1 and engine.stats.waited == 0
    (event,) = _events(engine, "backpressure")
    assert (event["action"], event["step"], event["tier"]) == ("deferred", 7, "pulse")
    assert engine.metrics.value("ckpt_backpressure_total", {"action": "deferred"}) == 1
    persister.busy = False  # the next step it goes through
    assert path.save(_decision(8)) == "pulse-8"


@pytest.mark.parametrize(
    ("backpressure", "kw"),
    [("wait", {}), ("defer", {"emergency": True}), ("defer", {"force": True})],
)
def test_wait_emergency_and_forced_saves_wait_for_the_persister_instead(
    ck_config: ConfigFactory, backpressure: Literal["defer", "wait"], kw: dict[str, bool]
) -> None:
    path, persister, engine, settled = _path(ck_config(), backpressure)
    persister.busy = True
    force = kw.pop("force", False)
    assert path.save(_decision(9, **kw), force=force) == "pulse-9"
    assert persister.waited == 1 and len(persister.saved) == 1
    assert engine.stats.waited == 1 and engine.stats.deferred == 0 and settled == []
    assert _events(engine, "backpressure")[0]["action"] == "waited"


def test_the_agreed_busy_flag_wins_over_this_ranks_own(ck_config: ConfigFactory) -> None:
    path, persister, _, _ = _path(ck_config())
    assert path.save(_decision(3), busy=True) is None  # another rank is still persisting
    persister.busy = True
    assert path.save(_decision(4), busy=False) == "pulse-4"
    assert persister.waited == 0


def test_train_config_goes_with_full_saves_only(ck_config: ConfigFactory) -> None:
    path, persister, _, _ = _path(ck_config())
    path.save(_decision(1, Tier.PULSE))
    path.save(_decision(2, Tier.FULL))
    assert [sorted(files) for _, files in persister.saved] == [[], ["train_config.json"]]


def test_each_background_failure_is_reported_once_and_its_tier_is_due_again(
    ck_config: ConfigFactory,
) -> None:
    path, persister, engine, settled = _path(ck_config(), on_error="raise")
    boom = OSError("disk on fire")
    persister.errors = [
        JobError("persisting pulse of step 5", boom, Tier.PULSE),
        JobError("validating pulse_step_5", ValueError("bad"), None),
    ]
    with pytest.raises(PersistError, match=r"disk on fire \(and 1 more\)") as info:
        path.raise_errors()
    assert info.value.__cause__ is boom and not info.value.transient
    assert [(o.result, o.tier) for o in settled] == [(SaveResult.FAILED, Tier.PULSE)]
    assert engine.metrics.value("ckpt_persist_errors_total") == 2
    assert len(_events(engine, "error")) == 2
    path.raise_errors()  # reported once: nothing left
    assert path.collect_errors() is None


def test_warn_logs_instead_of_raising(ck_config: ConfigFactory) -> None:
    path, persister, _, _ = _path(ck_config(), on_error="warn")
    persister.errors = [JobError("persisting", OSError("x"), Tier.FULL)]
    path.raise_errors()
    assert persister.errors == []


def test_auto_rides_out_retryable_failures_until_the_outage_is_too_long(
    ck_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, persister, engine, _ = _path(ck_config())
    clock = [1000.0]
    monkeypatch.setattr("ckpt_agent.runtime.save.saving.time.monotonic", lambda: clock[0])

    def fail(error: Exception) -> None:
        persister.errors = [JobError("persisting", error, Tier.PULSE)]
        path.raise_errors()

    fail(RetryableStorageError("reset"))  # tolerated: the outage begins
    clock[0] += tuning.PERSIST_OUTAGE_TOLERANCE_S - 1
    fail(RetryableStorageError("reset"))
    engine.stats.committed += 1  # a commit ends the outage: the clock starts again
    clock[0] += 2
    fail(RetryableStorageError("reset"))
    clock[0] += tuning.PERSIST_OUTAGE_TOLERANCE_S
    with pytest.raises(PersistError, match="no checkpoint committed for"):
        fail(RetryableStorageError("reset"))
    with pytest.raises(PersistError):  # a permanent one raises at once
        fail(OSError("permission denied"))


def test_drain_takes_the_persisters_results_in_and_hands_them_to_the_scheduler(
    ck_config: ConfigFactory,
) -> None:
    path, persister, engine, settled = _path(ck_config())
    engine.feedback.put(SaveOutcome.persisted(Tier.PULSE, 0.5))
    path.drain()
    assert persister.polled == 1
    assert [(o.result, o.persist_seconds) for o in settled] == [(SaveResult.PERSISTED, 0.5)]
