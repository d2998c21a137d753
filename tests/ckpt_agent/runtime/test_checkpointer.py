"""The Checkpointer: saving, back-pressure, errors, resume, signals, metrics, retention."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from ckpt_agent import tuning
from ckpt_agent.errors import PersistError, ResumeError
from ckpt_agent.format.heartbeat import read_heartbeat
from ckpt_agent.format.layout import audit_key, blob_key, recover_request_key, validation_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.storage.base import Storage
from ckpt_agent.storage.fs import LocalStorage

ConfigFactory = Callable[..., AgentConfig]
S = TypeVar("S", bound=LocalStorage)


class Position:
    """A tiny data position with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.epoch = 0
        self.pos = 0

    def advance(self) -> None:
        self.pos += 1
        if self.pos == 7:
            self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict[str, int]) -> None:
        self.epoch, self.pos = s["epoch"], s["pos"]


class Trainer:
    """Model + AdamW + scheduler + scaler + dropout + data position."""

    def __init__(self, seed: int = 0, hidden: int = 600, frozen_backbone: bool = False) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(hidden, 2),
        )
        if frozen_backbone:
            for p in self.model[0].parameters():
                p.requires_grad_(False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.9)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)
        self.data = Position()

    def checkpointer(self, config: AgentConfig, **kw: Any) -> Checkpointer:
        return Checkpointer(
            config,
            model=self.model,
            optimizer=self.opt,
            lr_scheduler=self.sched,
            grad_scaler=self.scaler,
            dataloader_state=self.data,
            **kw,
        )

    def step(self) -> float:
        x = torch.randn(4, 8) + self.data.pos
        self.opt.zero_grad()
        loss = self.model(x).pow(2).mean()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.data.advance()
        return float(loss.item())

    def run(self, ckpt: Checkpointer | None, start: int, stop: int) -> list[float]:
        out = []
        for s in range(start, stop):
            out.append(self.step())
            if ckpt is not None:
                ckpt.step(s, out[-1])
        return out


def _events(config: AgentConfig, name: str) -> list[dict[str, Any]]:
    assert config.work_dir
    path = Path(config.work_dir) / "decisions.rank0.jsonl"
    return [e for line in path.read_text().splitlines() if (e := json.loads(line))["event"] == name]


def _store_for(cfg: AgentConfig, cls: type[S]) -> S:
    """The config's store (``ck_config`` puts it next to the work dir) opened as ``cls``."""
    return cls(Path(cfg.work_dir or "").parent / "store")


def _store(cfg: AgentConfig) -> LocalStorage:
    return _store_for(cfg, LocalStorage)


def _statuses(store: Storage) -> dict[str, CheckpointStatus]:
    return {r.id: r.status for r in list_checkpoints(store, "run1")}


def _started(
    cfg: AgentConfig, t: Trainer | None = None, *, steps: int = 0, **kw: Any
) -> tuple[Trainer, Checkpointer]:
    """A trainer (default: ``Trainer()``) and its started checkpointer, ``steps`` steps in."""
    t = t if t is not None else Trainer()
    ckpt = t.checkpointer(cfg, **kw)
    ckpt.start()
    t.run(ckpt, 0, steps)
    return t, ckpt


def _saved(cfg: AgentConfig, t: Trainer | None = None, *, steps: int) -> str:
    """Train ``steps`` steps, ``save_now``, close: the checkpoint id."""
    _, ckpt = _started(cfg, t, steps=steps)
    cid = ckpt.save_now("x")
    ckpt.close()
    assert cid is not None
    return cid


def _two_saves(cfg: AgentConfig, first_at: int, second_at: int, **kw: Any) -> tuple[str, str]:
    """Train, ``save_now`` after ``first_at`` and ``second_at`` steps, close: the two ids."""
    t, ckpt = _started(cfg, steps=first_at, **kw)
    first = ckpt.save_now("first")
    t.run(ckpt, first_at, second_at)
    second = ckpt.save_now("second")
    ckpt.close()
    assert first is not None and second is not None
    return first, second


# --------------------------------------------------------------------------- basics


def test_fresh_start_saves_pulses_and_reports(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    t, ckpt = _started(cfg)
    resume = ckpt.resume_point
    assert resume is not None
    assert resume.step == 0 and not resume.resumed and resume.action == "fresh"
    t.run(ckpt, 0, 12)
    assert ckpt.wait(30)
    ckpt.close()
    store = _store(cfg)
    recs = [r for r in list_checkpoints(store, "run1") if r.tier != Tier.HEARTBEAT]
    assert recs and all(r.status == CheckpointStatus.VALID for r in recs)
    assert all(r.tier == Tier.PULSE for r in recs)
    decisions = _events(cfg, "decision")
    assert [d["step"] for d in decisions] == list(range(12))
    assert _events(cfg, "committed") and _events(cfg, "validated")
    m = ckpt.metrics
    assert m.value("ckpt_stall_seconds_count", {"tier": "pulse"}) >= len(recs)
    assert m.value("ckpt_bytes_written_total", {"tier": "pulse"}) > 0
    assert m.value("ckpt_checkpoints_total", {"tier": "pulse", "status": "valid"}) >= len(recs)
    assert m.value("ckpt_last_valid_step") == max(r.step for r in recs)
    ring = read_heartbeat(store, "run1")
    assert ring[-1].step == 11 and ring[-1].data == {"epoch": 1, "pos": 5}


def test_config_from_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ck_config_file: Callable[..., Path]
) -> None:
    path = ck_config_file(runId="from-file")
    monkeypatch.setenv("CKPT_CONFIG", str(path))
    monkeypatch.setenv("CKPT_RUN_ID", "from-env")
    monkeypatch.setenv("CKPT_STORAGE_URL", str(tmp_path / "envstore"))
    monkeypatch.setenv("CKPT_WORK_DIR", str(tmp_path / "envwork"))
    t = Trainer()
    with t.checkpointer(None) as ckpt:  # type: ignore[arg-type]
        assert ckpt.run_id == "from-env"
        ckpt.start()
        t.run(ckpt, 0, 3)
        ckpt.save_now("test")
    assert list_checkpoints(LocalStorage(tmp_path / "envstore"), "from-env")
    assert (tmp_path / "envwork" / "catalog.sqlite").exists()


def test_save_now_and_full_tier_with_train_config(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    t = Trainer()
    ckpt = Checkpointer(cfg, model=t.model, optimizer=t.opt, train_config={"lr": 0.01, "name": "x"})
    ckpt.start()
    t.run(ckpt, 0, 3)
    cid = ckpt.save_now("operator asked")
    assert cid == "full_step_000000000002"
    ckpt.close()
    store = _store(cfg)
    committed, manifest = read_checkpoint(store, "run1", cid)
    assert committed.commit.meta.emergency and "operator asked" in committed.commit.meta.reason
    assert "train_config.json" in manifest.files
    assert set(manifest.meta.sections) >= {"model", "optimizer", "rng", "progress", "scheduler"}


def test_mutation_after_step_does_not_leak_into_the_checkpoint(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    t, ckpt = _started(cfg, steps=2)
    cid = ckpt.save_now("now", wait=False)
    assert cid is not None
    expect = {k: v.clone() for k, v in t.model.state_dict().items()}
    with torch.no_grad():  # training continues right away, in place
        for p in t.model.parameters():
            p.mul_(-3.0).add_(1.0)
    t.run(ckpt, 2, 4)
    ckpt.close()
    store = _store(cfg)
    from ckpt_agent.runtime.core.serialization import load_tensors

    _, manifest = read_checkpoint(store, "run1", cid)
    model = load_tensors(store, "run1", manifest).section("model")
    assert isinstance(model, dict)
    for k, v in expect.items():
        assert torch.equal(model[k], v), k


# --------------------------------------------------------------------------- back-pressure and errors


class SlowStorage(LocalStorage):
    """Blob writes take a while (a slow network disk)."""

    delay = 0.3

    def write(self, key: str, data: bytes | memoryview) -> None:
        if "/blobs/" in key:
            time.sleep(self.delay)
        super().write(key, data)


class FlakyStorage(LocalStorage):
    """The first blob write after ``arm()`` fails."""

    armed = False
    permanent = False

    def write(self, key: str, data: bytes | memoryview) -> None:
        if self.armed and "/blobs/" in key:
            self.armed = False
            from ckpt_agent.errors import PermanentStorageError, RetryableStorageError

            if self.permanent:
                raise PermanentStorageError("injected: access denied")
            raise RetryableStorageError("injected: connection reset")
        super().write(key, data)


def _failing_save(
    cfg: AgentConfig, steps: int, *, permanent: bool = False, **kw: Any
) -> tuple[Trainer, Checkpointer, FlakyStorage]:
    """``steps`` steps in, a ``save_now`` (not waited for) whose first blob write fails."""
    store = _store_for(cfg, FlakyStorage)
    t, ckpt = _started(cfg, steps=steps, storage=store, **kw)
    store.permanent = permanent
    store.armed = True
    ckpt.save_now("will fail", wait=False)
    return t, ckpt, store


@pytest.mark.parametrize("mode", ["defer", "wait"])
def test_backpressure_when_a_persist_is_still_running(ck_config: ConfigFactory, mode: str) -> None:
    cfg = ck_config(tiers={"pulse": {"baseInterval": 2, "minInterval": 1, "maxInterval": 2}})
    store = _store_for(cfg, SlowStorage)
    _, ckpt = _started(cfg, steps=8, storage=store, backpressure=mode)
    ckpt.close()
    events = _events(cfg, "backpressure")
    assert events, "a save met a running persist"
    assert {e["action"] for e in events} == {"deferred" if mode == "defer" else "waited"}
    label = "deferred" if mode == "defer" else "waited"
    assert ckpt.metrics.value("ckpt_backpressure_total", {"action": label}) == len(events)
    recs = [r for r in list_checkpoints(store, "run1") if r.tier == Tier.PULSE]
    assert recs and all(r.status == CheckpointStatus.VALID for r in recs)  # nothing corrupted
    if mode == "defer":
        assert "due again next step" in events[0]["reason"]


def test_persist_error_is_reported_once(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    t, ckpt, store = _failing_save(cfg, steps=2, on_persist_error="raise")
    ckpt._persister.wait_persisted(30)
    with pytest.raises(PersistError, match="injected: connection reset"):
        t.run(ckpt, 2, 3)
    t.run(ckpt, 3, 12)  # reported once: training goes on, later saves work
    ckpt.close()
    assert ckpt.metrics.value("ckpt_persist_errors_total") == 1
    assert [e["error"] for e in _events(cfg, "error")] == [
        "RetryableStorageError: injected: connection reset"
    ]
    assert any(r.status == CheckpointStatus.VALID for r in list_checkpoints(store, "run1"))


def test_auto_rides_out_a_storage_outage(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    t, ckpt, store = _failing_save(cfg, steps=2)  # default: on_persist_error="auto"
    ckpt._persister.wait_persisted(30)
    t.run(ckpt, 2, 12)  # logged, not raised: the next saves retry and commit
    ckpt.close()
    assert ckpt.metrics.value("ckpt_persist_errors_total") == 1
    assert [e["error"] for e in _events(cfg, "error")] == [
        "RetryableStorageError: injected: connection reset"
    ]
    assert any(r.status == CheckpointStatus.VALID for r in list_checkpoints(store, "run1"))


def test_auto_raises_a_permanent_failure(ck_config: ConfigFactory) -> None:
    t, ckpt, _ = _failing_save(ck_config(), steps=2, permanent=True)
    ckpt._persister.wait_persisted(30)
    with pytest.raises(PersistError, match="injected: access denied"):
        t.run(ckpt, 2, 3)
    ckpt.close()


def test_auto_raises_an_outage_past_the_tolerance(
    ck_config: ConfigFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "PERSIST_OUTAGE_TOLERANCE_S", 0.0)
    t, ckpt, _ = _failing_save(ck_config(), steps=2)
    ckpt._persister.wait_persisted(30)
    with pytest.raises(PersistError, match="connection reset") as info:
        t.run(ckpt, 2, 3)
    assert any("no checkpoint committed" in n for n in getattr(info.value, "__notes__", []))
    ckpt.close()


def test_close_reports_a_pending_error(ck_config: ConfigFactory) -> None:
    _, ckpt, _ = _failing_save(ck_config(), steps=1)
    with pytest.raises(PersistError):
        ckpt.close()


# --------------------------------------------------------------------------- resume


def _state(t: Trainer) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in t.model.state_dict().items()},
        "opt": t.opt.state_dict(),
        "sched": t.sched.state_dict(),
        "scaler": t.scaler.state_dict(),
        "data": t.data.state_dict(),
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"]
    for i, st in a["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["opt"]["state"][i][k])
    assert a["sched"] == b["sched"] and a["scaler"] == b["scaler"] and a["data"] == b["data"]
    assert torch.equal(a["rng"], b["rng"])


def test_resume_in_process_restores_everything(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    t, ckpt = _started(cfg, steps=6)
    cid = ckpt.save_now("snapshot for the test")
    saved = _state(t)
    ckpt.close()
    t2 = Trainer(seed=99)
    ckpt2 = t2.checkpointer(cfg)
    resume = ckpt2.start()
    assert resume.checkpoint_id == cid and resume.step == 6 and resume.exact
    assert resume.data_state == {"epoch": 0, "pos": 6} and resume.epoch == 0
    _assert_same(saved, _state(t2))
    assert ckpt2.metrics.value("ckpt_recovery_successes_total") == 1
    # and the two continue identically (one process: give each run the same RNG start)
    a = t.run(None, 6, 10)
    torch.set_rng_state(saved["rng"])
    b = t2.run(ckpt2, 6, 10)
    assert a == b
    ckpt2.close()


def test_pending_newest_checkpoint_is_verified_on_start(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    cid = _saved(cfg, steps=3)
    store = _store(cfg)
    store.delete(validation_key("run1", cid))  # as if killed before validation
    assert _statuses(store)[cid] == CheckpointStatus.PENDING
    ckpt2 = Trainer(seed=5).checkpointer(cfg)
    assert ckpt2.start().checkpoint_id == cid
    ckpt2.close()
    assert _statuses(store)[cid] == CheckpointStatus.VALID


def test_resume_from_names_exactly_one_checkpoint(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    first, _ = _two_saves(cfg, 3, 6)
    older = cfg.model_copy(update={"resume_from": first})
    t2 = Trainer(seed=1)
    ckpt2 = t2.checkpointer(older)
    resume = ckpt2.start()
    assert resume.checkpoint_id == first and resume.action == "resume_from" and resume.step == 3
    ckpt2.close()
    # the newer checkpoint belongs to the abandoned branch now
    assert _statuses(_store(cfg))["full_step_000000000005"] == CheckpointStatus.EXPIRED

    gone = cfg.model_copy(update={"resume_from": "pulse_step_000000004242"})
    with pytest.raises(ResumeError, match="has no committed checkpoint with that id"):
        Trainer().checkpointer(gone).start()


def test_resume_from_a_corrupted_checkpoint_fails_loudly(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    cid = _saved(cfg, Trainer(hidden=600), steps=2)  # big enough for blobs (not inline)
    store = _store(cfg)
    _, m = read_checkpoint(store, "run1", cid)
    digest = m.tensors["model/0.weight"].chunks[0]
    path = store.root / blob_key("run1", digest)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ResumeError, match="cannot be restored: IntegrityError"):
        Trainer(hidden=600).checkpointer(cfg.model_copy(update={"resume_from": cid})).start()
    assert _statuses(store)[cid] == CheckpointStatus.CORRUPTED


def test_different_model_shape_is_never_loaded(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    _saved(cfg, Trainer(hidden=600), steps=3)
    other = Trainer(hidden=700)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ResumeError) as info:
        other.checkpointer(cfg).start()
    msg = str(info.value)
    assert "different model/optimizer shape" in msg
    assert "model/0.weight: checkpoint has float32[600, 8], live state has float32[700, 8]" in msg
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, before[k])  # untouched
    # the checkpoints are fine: they are not marked corrupted
    assert CheckpointStatus.CORRUPTED not in _statuses(_store(cfg)).values()


# --------------------------------------------------------------------------- differential storage


def test_frozen_backbone_fine_tune_writes_a_small_fraction(ck_config: ConfigFactory) -> None:
    cfg = ck_config(compression={"codec": "none"})
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )
    head = torch.nn.Linear(256, 4)
    for p in backbone.parameters():
        p.requires_grad_(False)
    model = torch.nn.Sequential(backbone, head)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    ckpt = Checkpointer(cfg, model=model, optimizer=opt)
    ckpt.start()

    def train(step: int) -> None:
        opt.zero_grad()
        loss = model(torch.randn(8, 256)).pow(2).mean()
        loss.backward()
        opt.step()
        ckpt.step(step, loss.item())

    train(0)
    first = ckpt.save_now("first")
    train(1)
    second = ckpt.save_now("second")
    ckpt.close()
    store = _store(cfg)
    sizes = {r.id: r.size_bytes for r in list_checkpoints(store, "run1")}
    assert first is not None and second is not None
    assert sizes[second] < 0.05 * sizes[first], sizes
    assert ckpt.metrics.value("ckpt_bytes_reused_total", {"tier": "full"}) > 0.9 * sizes[first]
    # and both restore exactly
    from ckpt_agent.runtime.core.serialization import load_tensors

    _, m = read_checkpoint(store, "run1", second)
    restored = load_tensors(store, "run1", m).section("model")
    assert isinstance(restored, dict)
    for k, v in model.state_dict().items():
        assert torch.equal(restored[k], v), k


# --------------------------------------------------------------------------- signals


def test_signal_file_change_means_save_now(ck_config: ConfigFactory, tmp_path: Path) -> None:
    sig = tmp_path / "save-now"
    sig.write_text("")
    cfg = ck_config(
        signalFile=str(sig),
        tiers={"pulse": {"baseInterval": 100, "minInterval": 50, "maxInterval": 500}},
    )
    t, ckpt = _started(cfg, steps=3)
    sig.write_text("request-42")
    os.utime(sig, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    decisions = [ckpt.step(3, t.step())]
    assert decisions[0].emergency and decisions[0].tier == Tier.FULL
    assert "request-42" in decisions[0].reason
    assert not ckpt.step(4, t.step()).emergency  # same content: no new request
    ckpt.close()
    assert _events(cfg, "signal")[0]["request"] == "request-42"


def test_sigterm_saves_then_exits(ck_config: ConfigFactory) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals need the main thread")
    cfg = ck_config(tiers={"pulse": {"baseInterval": 100, "minInterval": 50, "maxInterval": 500}})
    t, ckpt = _started(cfg, steps=4, handle_sigterm=True)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        t.run(ckpt, 4, 6)
    assert info.value.code == 143
    store = _store(cfg)
    ids = [r.id for r in list_checkpoints(store, "run1")]
    assert "full_step_000000000004" in ids
    assert signal.getsignal(signal.SIGTERM) is not None and not ckpt._signals.installed


# --------------------------------------------------------------------------- scheduler-driven tiers


def test_gradient_anomaly_takes_a_lightweight_pulse(ck_config: ConfigFactory) -> None:
    cfg = ck_config(
        scheduler={
            "gradient": {"sampleEvery": 1, "minSamples": 2, "consecutiveAnomalies": 1},
            "risk": {"enabled": False},
        },
        tiers={"pulse": {"baseInterval": 100, "minInterval": 50, "maxInterval": 500}},
    )
    t, ckpt = _started(cfg)
    for s in range(4):
        ckpt.step(s, t.step(), grad_norm=1.0)
    d = ckpt.step(4, t.step(), grad_norm=50.0)
    assert d.lightweight and d.tier == Tier.PULSE and d.anomaly == "grad_anomaly"
    ckpt.close()
    store = _store(cfg)
    _, manifest = read_checkpoint(store, "run1", "pulse_step_000000000004")
    assert manifest.meta.lightweight
    assert "optimizer" not in manifest.meta.sections and "rng" in manifest.meta.sections


def test_retention_runs_after_each_commit(ck_config: ConfigFactory) -> None:
    cfg = ck_config(retention={"routineKeep": 1})
    t, ckpt = _started(cfg, Trainer(hidden=600), steps=20)
    # Two pulses for certain (the scheduler's own may coalesce on a slow machine).
    assert ckpt.save_now("first", tier=Tier.PULSE) is not None
    t.run(ckpt, 20, 22)
    assert ckpt.save_now("second", tier=Tier.PULSE) is not None
    ckpt.close()
    store = _store(cfg)
    pulses = [r for r in list_checkpoints(store, "run1") if r.tier == Tier.PULSE]
    assert len(pulses) == 1
    assert _events(cfg, "retention")
    (manifest_refs,) = [read_checkpoint(store, "run1", pulses[0].id)[1].referenced_blobs()]
    on_disk = {i.key.rsplit("/", 1)[-1] for i in store.list("run1/blobs/")}
    assert on_disk == manifest_refs  # every unreferenced blob was collected
    assert ckpt.metrics.value("ckpt_checkpoints_total", {"tier": "pulse", "status": "expired"}) >= 1


def test_validation_in_a_subprocess_marks_a_corrupted_write(ck_config: ConfigFactory) -> None:
    class Corrupting(LocalStorage):
        """Flips a byte of the 3rd blob written (silent data corruption on the way to disk)."""

        n = 0

        def write(self, key: str, data: bytes | memoryview) -> None:
            if "/blobs/" in key:
                self.n += 1
                if self.n == 3:
                    buf = bytearray(data)
                    buf[len(buf) // 2] ^= 0xFF
                    data = bytes(buf)
            super().write(key, data)

    cfg = ck_config(validation={"loadInSubprocess": True})
    store: Storage = _store_for(cfg, Corrupting)
    _, ckpt = _started(cfg, Trainer(hidden=600), steps=2, storage=store)
    cid = ckpt.save_now("x")
    assert cid is not None
    ckpt.wait(60)
    ckpt.close()
    from ckpt_agent.persist.catalog import Catalog

    with Catalog(Path(cfg.work_dir or "") / "catalog.sqlite") as cat:
        rec = cat.get("run1", cid)
    assert rec is not None and rec.status == CheckpointStatus.CORRUPTED
    assert "corrupted bytes" in rec.extra["status_reason"]
    assert cid not in {r.id for r in list_checkpoints(store, "run1")}  # retention removed it
    assert (
        ckpt.metrics.value("ckpt_checkpoints_total", {"tier": "full", "status": "corrupted"}) == 1
    )
    (ev,) = _events(cfg, "corrupted")
    assert ev["checkpoint"] == cid and ev["bad_blobs"]
    assert not store.exists(blob_key("run1", ev["bad_blobs"][0]))  # self-healed: removed


def test_manual_recovery_request_is_applied_once(ck_config: ConfigFactory) -> None:
    from typer.testing import CliRunner

    from ckpt_agent.cli.main import app

    cfg = ck_config()
    older, _ = _two_saves(cfg, 3, 7)
    store = _store(cfg)
    res = CliRunner().invoke(
        app,
        [
            "recover",
            "--storage",
            str(store.root),
            "--run-id",
            "run1",
            "--manual",
            "--step",
            "2",
            "--force",
        ],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    t2 = Trainer(seed=3)
    ckpt2 = t2.checkpointer(cfg)
    resume = ckpt2.start()
    assert resume.checkpoint_id == older and resume.action == "manual" and resume.step == 3
    ckpt2.close()
    assert not store.exists(recover_request_key("run1"))  # consumed
    audit = [json.loads(x) for x in store.read(audit_key("run1")).splitlines()]
    assert [a["what"] for a in audit] == ["manual recovery requested", "manual recovery applied"]
    # the next start follows the ladder again (from the newest valid checkpoint of this branch)
    ckpt3 = Trainer(seed=4).checkpointer(cfg)
    assert ckpt3.start().checkpoint_id == older
    ckpt3.close()


def test_prometheus_endpoint_serves_the_checkpointer_registry(ck_config: ConfigFactory) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ck_config(metricsPort=port)
    _, ckpt = _started(cfg, steps=3)
    ckpt.save_now("x")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in (
        "ckpt_save_latency_seconds_bucket",
        "ckpt_stall_seconds_count",
        "ckpt_bytes_written_total",
        "ckpt_last_valid_step",
        "ckpt_recovery_attempts_total",
    ):
        assert name in body, name
    ckpt.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_approximate_filter_is_opt_in_and_marked(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    # every momentum change is "small"
    first, second = _two_saves(cfg, 2, 4, approximate_threshold=1e9)
    recs = {r.id: r for r in list_checkpoints(_store(cfg), "run1")}
    assert not recs[first].approximate  # nothing to compare with yet: exact
    assert recs[second].approximate
    again = Trainer(seed=8).checkpointer(cfg)
    resume = again.start()
    again.close()
    assert resume.checkpoint_id == second and not resume.exact


def test_memory_tier_without_shared_memory_is_off_and_says_why(
    ck_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = ck_config(tiers={"memory": {"enabled": True, "everySteps": 2}})
    t, ckpt = _started(cfg)
    decisions = [ckpt.step(s, t.step()) for s in range(12)]
    ckpt.close()
    assert not any(d.memory for d in decisions)
    off = _events(cfg, "memory_tier")
    assert [e["outcome"] for e in off] == ["off"] and "flash snapshots" in off[0]["reason"]
    assert "memory-tier snapshots are off" in caplog.text
