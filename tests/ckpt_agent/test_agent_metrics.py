"""The agent's Prometheus metrics that answer "what did checkpointing cost and did recovery work"."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ckpt_agent.errors import ResumeError
from ckpt_agent.flash.sidecar import SidecarMetrics
from ckpt_agent.metrics import Metrics, snapshot
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer

ConfigFactory = Callable[..., AgentConfig]


def _run(cfg: AgentConfig, steps: int) -> Metrics:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 200)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(cfg, model=model, optimizer=opt)
    first = ckpt.start().step
    for s in range(first, first + steps):
        loss = model(torch.randn(2, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        ckpt.step(s, loss)
    ckpt.save_now("test")
    m = ckpt.metrics
    assert 0 < m.value("ckpt_io_time_ratio") < 1  # stalled a little, trained mostly
    ckpt.close()
    return m


def test_recovery_outcomes_time_and_io_share(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    m = _run(cfg, 12)
    assert m.value("ckpt_recoveries_total", {"outcome": "fresh"}) == 1
    assert m.value("ckpt_recovery_seconds_count") == 1
    assert m.value("ckpt_stall_seconds_count", {"tier": "full"}) == 1
    m = _run(cfg, 3)
    assert m.value("ckpt_recoveries_total", {"outcome": "resume"}) == 1
    assert m.value("ckpt_recovery_seconds_count") == 1 and m.value("ckpt_recovery_seconds_sum") > 0
    gone = cfg.model_copy(update={"resume_from": "pulse_step_000000004242"})
    ckpt = Checkpointer(gone, model=torch.nn.Linear(8, 200))
    with pytest.raises(ResumeError):
        ckpt.start()
    assert ckpt.metrics.value("ckpt_recoveries_total", {"outcome": "failed"}) == 1
    assert ckpt.metrics.value("ckpt_recovery_seconds_count") == 0


def test_io_ratio_is_stall_over_wall_time() -> None:
    m = Metrics()
    m._started -= 10.0  # ten seconds in
    m.add_stall("pulse", 1.0)
    m.add_stall("full", 0.5)
    assert m.value("ckpt_io_time_ratio") == pytest.approx(0.15, rel=0.01)
    assert m.value("ckpt_stall_seconds_sum", {"tier": "pulse"}) == 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample, labels): value}; every family once (Prometheus refuses
    a scrape that repeats one)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), names
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def _total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_flash_mode_serves_the_local_persisters_metrics(
    ck_config: ConfigFactory, tmp_path: Path
) -> None:
    """Flash mode without the sidecar container (every injected pod by default): the
    persister process commits and validates, and the trainer's one scrape target serves
    its counts; every save's latency is observed, not only the newest per poll."""
    port = _free_port()
    cfg = ck_config(shmDir=str(tmp_path / "shm"), metricsPort=port)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 200)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(cfg, model=model, optimizer=opt, backpressure="wait")
    try:
        first = ckpt.start().step
        for s in range(first, first + 20):
            loss = model(torch.randn(2, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            ckpt.step(s, loss)
            if s % 5 == 4:  # saves of its own, whatever the scheduler decided meanwhile
                ckpt.save_now("test")
                assert ckpt.wait(60)
        log = tmp_path / "work" / "sidecar.jsonl"
        deadline = time.monotonic() + 60
        while True:
            # The persister marks a save done (what wait() returns on) before it logs the
            # event and publishes its counts, and validation follows the commit: poll both.
            persisted = [
                e
                for e in map(json.loads, log.read_text().splitlines())
                if e["event"] == "persisted" and e["rank"] == 0
            ]
            got = _scrape(port)
            validated = got.get(("ckpt_validation_seconds_count", ()), 0.0)
            published = got.get(("ckpt_sidecar_snapshots_total", (("outcome", "persisted"),)), 0)
            settled = validated >= len(persisted) and published >= len(persisted)
            if (len(persisted) >= 4 and settled) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(persisted) >= 4
        assert validated == len(persisted)
        valid = sum(
            v
            for (n, labels), v in got.items()
            if n == "ckpt_checkpoints_total" and ("status", "valid") in labels
        )
        assert valid >= 1
        assert _total(got, "ckpt_checkpoints_total") >= len(persisted)
        assert _total(got, "ckpt_bytes_written_total") > 0
        assert got[("ckpt_last_valid_step", ())] == persisted[-1]["step"]
        assert got[("ckpt_sidecar_snapshots_total", (("outcome", "persisted"),))] == len(persisted)
        assert _total(got, "ckpt_save_latency_seconds_count") == len(persisted)
    finally:
        ckpt.close()


def test_relay_merges_keeps_counts_of_a_restarted_persister_and_ignores_garbage() -> None:
    trainer, persister = Metrics(), SidecarMetrics()
    published: list[bytes | None] = [None]
    trainer.relay(lambda: published[0])
    trainer.checkpoints.labels(tier="full", status="valid").inc()  # found while resuming
    trainer.last_valid_step.set(40)
    assert trainer.value("ckpt_checkpoints_total", {"tier": "full", "status": "valid"}) == 1

    persister.checkpoints.labels(tier="full", status="valid").inc(2)
    persister.checkpoints.labels(tier="pulse", status="corrupted").inc()
    persister.validation.observe(0.2)
    persister.save_latency.labels(tier="full").observe(1.0)  # the trainer measures its own
    persister.last_valid_step.set(50)
    persister.snapshots.labels(outcome="persisted").inc(3)
    published[0] = snapshot(persister.registry, "first")
    full = {"tier": "full", "status": "valid"}
    assert trainer.value("ckpt_checkpoints_total", full) == 3
    assert trainer.value("ckpt_checkpoints_total", {"tier": "pulse", "status": "corrupted"}) == 1
    assert trainer.value("ckpt_validation_seconds_count") == 1
    assert trainer.value("ckpt_validation_seconds_bucket", {"le": "0.25"}) == 1
    assert trainer.value("ckpt_save_latency_seconds_count", {"tier": "full"}) == 0
    assert trainer.value("ckpt_last_valid_step") == 50
    assert trainer.value("ckpt_sidecar_snapshots_total", {"outcome": "persisted"}) == 3

    published[0] = b"{not json"  # a torn read: the last good snapshot stays
    assert trainer.value("ckpt_checkpoints_total", full) == 3

    restarted = SidecarMetrics()  # the persister died and was restarted: counts from 0
    restarted.checkpoints.labels(tier="full", status="valid").inc()
    restarted.validation.observe(0.3)
    published[0] = snapshot(restarted.registry, "second")
    assert trainer.value("ckpt_checkpoints_total", full) == 4
    assert trainer.value("ckpt_checkpoints_total", {"tier": "pulse", "status": "corrupted"}) == 1
    assert trainer.value("ckpt_validation_seconds_count") == 2
    assert trainer.value("ckpt_sidecar_snapshots_total", {"outcome": "persisted"}) == 3
    assert trainer.value("ckpt_last_valid_step") == 40  # gauge: max(trainer, newest process)

    text = generate_latest(trainer.registry).decode()
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))


def test_metrics_are_served_from_the_start_and_a_taken_port_is_not_fatal(
    ck_config: ConfigFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The operator probes the agent's port while the pod restores (a long restore is not
    a missing agent); a second rank of the pod finds the port taken and trains on."""
    port = _free_port()
    cfg = ck_config(metricsPort=port, metricsAddr="127.0.0.1")
    model = torch.nn.Linear(4, 4)
    seen: list[bool] = []
    first = Checkpointer(cfg, model=model)
    restore = first._restorer.resume_point

    def probing_restore() -> Any:
        with socket.socket() as s:
            seen.append(s.connect_ex(("127.0.0.1", port)) == 0)
        return restore()

    first._restorer.resume_point = probing_restore  # type: ignore[method-assign]
    try:
        first.start()
        assert seen == [True]
        second = Checkpointer(ck_config(metricsPort=port, metricsAddr="127.0.0.1"), model=model)
        with caplog.at_level(logging.WARNING, logger="ckpt_agent.metrics"):
            second.start()
        second.close()
        assert f"metrics server not started on 127.0.0.1:{port}" in caplog.text
        assert _scrape(port)  # the first still serves
    finally:
        first.close()
