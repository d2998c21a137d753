"""Engine: built from fakes (no storage opened, no SQLite), the services it holds and the
little they share safely (write latency from any thread, anomalies for retention)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import runtime_fakes as fk

from ckpt_agent.decide.decision import Decision, SaveResult
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Lineage
from ckpt_agent.runtime.core.context import Handover, _LatencySample
from ckpt_agent.tuning import LATENCY_SAMPLE_MAX_AGE_S, LATENCY_SAMPLE_MAX_BYTES

ConfigFactory = Callable[..., AgentConfig]


def test_an_engine_of_fakes_opens_no_storage_and_no_catalog_file(
    ck_config: ConfigFactory,
) -> None:
    cfg = ck_config()
    engine, fakes = fk.make_engine(cfg)
    assert engine.storage is fakes.storage and engine.catalog is fakes.catalog
    assert engine.finalizer is fakes.finalizer
    assert fakes.wiring["catalog_path"].name == "catalog.sqlite"
    assert fakes.wiring["store_lock"] is engine.store_lock
    assert not list(engine.work_dir.rglob("*.sqlite"))
    engine.close()
    assert fakes.validator.closed and fakes.catalog.closed


def test_the_engine_holds_no_chain_state(ck_config: ConfigFactory) -> None:
    """What a persist needs from the previous one is the persister's (Handover → its chain),
    not a field of the shared engine that several threads write."""
    engine, _ = fk.make_engine(ck_config())
    for name in ("prev_hash", "lineage", "write_latency_ms"):
        assert not hasattr(engine, name), name


def test_the_handover_of_a_fresh_start() -> None:
    h = Handover()
    assert (h.prev_hash, h.lineage, h.checkpoint_step, h.last_valid_step) == (
        None,
        Lineage(),
        None,
        -1,
    )


def test_write_latency_from_any_thread_reaches_the_system_signals(
    ck_config: ConfigFactory,
) -> None:
    engine, fakes = fk.make_engine(ck_config())
    assert engine.system_signals(None, None).write_latency_ms is None

    def write(i: int) -> None:
        fakes.storage.commit(f"run1/x{i}", b"x")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen = engine.system_signals(None, None).write_latency_ms
    assert seen is not None and seen >= 0
    fakes.storage.last_write_bytes = 0
    hook = fakes.storage.on_write_latency
    assert hook is not None
    hook(0.25)
    assert engine.system_signals(3, 100.0).write_latency_ms == 250.0  # the worst of both
    assert engine.system_signals(3, 400.0).write_latency_ms == 400.0
    fakes.storage.last_write_bytes = LATENCY_SAMPLE_MAX_BYTES + 1
    hook(9.0)  # a large write says nothing about latency
    assert engine.system_signals(None, None).write_latency_ms == 250.0
    engine.close()
    assert fakes.storage.on_write_latency is None


def test_the_system_signals_object_is_reused_while_its_inputs_are_the_same(
    ck_config: ConfigFactory,
) -> None:
    """Every step asks for them (#27): the same inputs give the same frozen object back,
    any changed input a new one with the new values."""
    engine, fakes = fk.make_engine(ck_config())
    quiet = engine.system_signals(None, None)
    assert engine.system_signals(None, None) is quiet
    fakes.storage.last_write_bytes = 0
    hook = fakes.storage.on_write_latency
    assert hook is not None
    hook(0.003)
    slow = engine.system_signals(None, None)
    assert slow is not quiet and slow.write_latency_ms == 3.0
    assert engine.system_signals(None, None) is slow
    warned = engine.system_signals(None, None, "node NotReady")
    assert (warned.gpu_errors, warned.write_latency_ms, warned.node_warning) == (
        None,
        3.0,
        "node NotReady",
    )
    gpu = engine.system_signals(2, None, "node NotReady")
    assert (gpu.gpu_errors, gpu.node_warning) == (2, "node NotReady")
    assert engine.system_signals(None, None).node_warning is None
    engine.close()


def test_one_slow_write_then_silence_is_not_sustained_latency(
    ck_config: ConfigFactory,
) -> None:
    """#29: writes come in bursts (saves). One slow write at the end of a save, then
    seconds without writes, used to read as latency sustained all that time and raised the
    system layer's alarm (an emergency save) on a busy but healthy node. A sample older
    than LATENCY_SAMPLE_MAX_AGE_S is no evidence; slow writes that keep coming still are."""
    engine, fakes = fk.make_engine(ck_config())
    now = [1000.0]
    engine._latency = _LatencySample(lambda: now[0])
    fakes.storage.last_write_bytes = 0
    hook = fakes.storage.on_write_latency
    assert hook is not None
    sched = engine.scheduler
    threshold_s = sched.spec.system.write_latency_ms / 1000.0

    def steps(first: int, seconds: float, *, slow_writes: bool) -> list[Decision]:
        out = []
        for i in range(int(seconds / 0.5)):
            now[0] += 0.5
            if slow_writes:
                hook(threshold_s * 2)
            system = engine.system_signals(None, None)
            out.append(sched.observe(first + i, 1.0, system=system, now=now[0]))
        return out

    hook(threshold_s * 2)  # the last write of a save: slow
    assert engine.system_signals(None, None).write_latency_ms == threshold_s * 2000
    now[0] += LATENCY_SAMPLE_MAX_AGE_S + 0.01
    assert engine.system_signals(None, None).write_latency_ms is None
    quiet = steps(1, 10.0, slow_writes=False)
    assert not any(d.emergency or d.components["system"] for d in quiet)
    # slow writes that keep coming for longer than sustained_seconds: the alarm
    slow = steps(100, sched.spec.system.sustained_seconds + 2.0, slow_writes=True)
    assert any(d.emergency and "write latency" in d.reason for d in slow)
    engine.close()


def test_anomalies_the_scheduler_saw_are_what_retention_protects(
    ck_config: ConfigFactory,
) -> None:
    engine, fakes = fk.make_engine(ck_config())
    anomalies = fakes.wiring["anomalies"]
    assert anomalies([]) == []
    engine.record_decision(Decision(step=12, save=True, tier=Tier.PULSE, anomaly="loss_spike"))
    engine.record_decision(Decision(step=13, save=False, tier=None), loss=float("nan"))
    (event,) = anomalies([])
    assert (event.step, event.kind) == (12, "loss_spike")
    assert event.resolved_step == 12 + engine.config.tiers.pulse.base_interval


def test_a_booked_snapshot_reaches_the_scheduler_stats_and_summary(
    ck_config: ConfigFactory,
) -> None:
    engine, fakes = fk.make_engine(ck_config())
    settled = []
    engine.scheduler.settle = settled.append  # type: ignore[method-assign]
    engine.book_snapshot(Decision(step=4, save=True, tier=Tier.FULL), 0.125, bytes=10)
    assert [(o.result, o.step, o.stall_seconds) for o in settled] == [(SaveResult.TAKEN, 4, 0.125)]
    fakes.finalizer.seed_last_valid_step(3)
    s = engine.summary()
    assert (s["saves"], s["stall_max_s"], s["last_valid_step"]) == (1, 0.125, 3)
