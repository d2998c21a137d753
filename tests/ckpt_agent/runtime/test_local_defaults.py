"""Local use out of the box (issue #26): a writable default storage, one line saying where
checkpoints go and what a resume restored, no temporary work dir left behind, and errors
that say what changed and what to do."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_agent.errors import ResumeError
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.runtime.core.context import OWNER_PID

ConfigFactory = Callable[..., AgentConfig]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def test_default_storage_is_a_folder_the_user_can_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert AgentConfig().storage_url == (tmp_path / "data/ckpt-operator/checkpoints").as_uri()
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    url = AgentConfig().storage_url
    assert url == (tmp_path / "home/.local/share/ckpt-operator/checkpoints").as_uri()


def test_start_says_where_checkpoints_go_and_what_a_resume_restored(
    ck_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = ck_config()
    caplog.set_level(logging.INFO, logger="ckpt_agent.runtime.start_report")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(cfg, model=model, optimizer=opt) as ckpt:
        ckpt.start()
        _train(model, opt)
        ckpt.step(0, 1.0)
        ckpt.save_now("test")
    fresh = [r.getMessage() for r in caplog.records if "fresh start" in r.getMessage()]
    assert fresh == [
        f"no checkpoint to resume: fresh start; checkpoints of run 'run1' go to "
        f"{cfg.storage_url} (CKPT_STORAGE_URL, CKPT_RUN_ID)"
    ]
    caplog.clear()
    with Checkpointer(cfg, model=_model(), optimizer=opt) as ckpt:
        assert ckpt.start().step == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("resumed full_step_000000000000 (step 0, tier full, from file://")
    assert " s: training continues at step 1; checkpoints of run 'run1' go to " in lines[0]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_temporary_work_dir_is_removed_on_close_and_a_crashed_ones_on_restart(
    ck_config: ConfigFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    crashed = tmp / "ckpt-run1-crashed"
    crashed.mkdir()
    (crashed / OWNER_PID).write_text(f"{_dead_pid()}\n")
    running = tmp / "ckpt-run1-running"  # another live process's (this one's pid)
    running.mkdir()
    (running / OWNER_PID).write_text("1\n")
    foreign = tmp / "ckpt-run1-old"  # made by an older version: no owner.pid, left alone
    foreign.mkdir()
    model = _model()
    ckpt = Checkpointer(ck_config(workDir=None), model=model)
    ckpt.start()
    own = ckpt._engine.work_dir
    assert own.parent == tmp and own.name.startswith("ckpt-run1-")
    assert not crashed.exists() and running.exists() and foreign.exists()
    ckpt.step(0, 1.0)
    ckpt.close()
    assert not own.exists()
    assert sorted(p.name for p in tmp.iterdir()) == ["ckpt-run1-old", "ckpt-run1-running"]


def test_an_optimizer_of_another_type_says_what_changed_and_what_to_do(
    ck_config: ConfigFactory,
) -> None:
    cfg = ck_config()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Checkpointer(cfg, model=model, optimizer=opt) as ckpt:
        ckpt.start()
        _train(model, opt)
        ckpt.step(0, 1.0)
        ckpt.save_now("test")
    model = _model()
    adam = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = Checkpointer(cfg, model=model, optimizer=adam)
    with pytest.raises(ResumeError) as err:
        ckpt.start()
    msg = str(err.value)
    assert "its optimizer state does not fit the live AdamW" in msg
    assert "only in the checkpoint: ['dampening', 'momentum', 'nesterov']" in msg
    assert "Resume with the optimizer the checkpoint was saved with" in msg
    assert "CKPT_RUN_ID" in msg


class _NoState:
    def step(self) -> None:
        pass


def test_a_scheduler_without_state_dict_is_refused_up_front(ck_config: ConfigFactory) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"lr_scheduler=_NoState\(\.\.\.\) has no state_dict"):
        Checkpointer(ck_config(), model=model, optimizer=opt, lr_scheduler=_NoState())


def test_the_example_config_in_the_readme_is_the_example_file_and_loads() -> None:
    root = Path(__file__).resolve().parents[3]
    example = root / "examples" / "ckpt-config.local.json"
    assert example.read_text().strip() in (root / "README.md").read_text()
    cfg = AgentConfig.from_env({"CKPT_CONFIG": str(example)})
    assert cfg.run_id == "mnist-lr3e-4" and cfg.tiers.full.every_steps == 100
    assert cfg.retention.routine_keep == 2
    assert AgentConfig.from_env({"CKPT_CONFIG": str(example), "CKPT_RUN_ID": "b"}).run_id == "b"


def test_resuming_the_default_run_id_warns_it_may_be_another_experiment(
    ck_config: ConfigFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = ck_config(runId="local")
    model = _model()
    with Checkpointer(cfg, model=model) as ckpt:
        ckpt.start()
        ckpt.step(0, 1.0)
        ckpt.save_now("first experiment")
    caplog.clear()
    with Checkpointer(cfg, model=_model()) as ckpt:
        assert ckpt.start().step == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("default run id" in m and "CKPT_RUN_ID" in m for m in warned), warned
