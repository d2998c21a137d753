"""The checkpoint report a start leaves when it fails (issue #11, blind operator).

An operator that cannot read a PVC plans restarts from the pods' termination messages
(:mod:`ckpt_agent.format.termination`). When a restarted pod cannot restore its pin
(``CKPT_RESUME_FROM``) because the checkpoint is corrupted, it must say so before the
start fails — and say it about every checkpoint the ladder would try next, so that the
operator's next restart skips them all at once instead of one crash loop each.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckpt_agent.errors import ResumeError
from ckpt_agent.format.termination import ENV_PATH, CheckpointReport, parse_report
from ckpt_agent.policy import AgentConfig
from ckpt_agent.records import CheckpointStatus

from .test_resume_lineage import POLICY, RUN, Job, _ckpt, _statuses, _store

ConfigFactory = Callable[..., AgentConfig]


def _corrupt(cfg: AgentConfig, step: int) -> None:
    """Change one character of checkpoint ``step``'s rank manifest (its tensors are inline:
    the model is small), keeping it JSON: it no longer matches the hash its COMMIT holds."""
    path = _store(cfg).root / RUN / "steps" / _ckpt(step) / "rank_00000.json"
    data = bytearray(path.read_bytes())
    i = next(i for i in range(len(data) // 2, len(data)) if chr(data[i]) in "ABCDEFGH")
    data[i] = ord("Z")
    path.write_bytes(bytes(data))


def _original(cfg: AgentConfig) -> None:
    job = Job(seed=0)
    assert job.start(cfg).step == 0
    job.train(0, 18, save_at=(5, 10, 15))  # heartbeats every step, the newest at 17
    job.stop()


def _report(path: Path) -> CheckpointReport:
    return parse_report(path.read_bytes())


@pytest.fixture
def run(
    ck_config: ConfigFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[AgentConfig, Path]:
    """The original run (checkpoints 5, 10, 15; heartbeat 17) and the termination-log file
    its containers (and the restarts') report into."""
    log = tmp_path / "termination-log"
    log.touch()
    monkeypatch.setenv(ENV_PATH, str(log))
    cfg = ck_config(**POLICY)
    _original(cfg)
    return cfg, log


def test_a_corrupted_pin_reports_it_and_the_ladders_next_candidates_before_failing(
    run: tuple[AgentConfig, Path],
) -> None:
    cfg, log = run
    before = _report(log)  # the original run reported its checkpoints as valid
    assert {c.id: c.status for c in before.checkpoints if c.tier != "heartbeat"} == {
        _ckpt(s): "valid" for s in (5, 10, 15)
    }
    for step in (10, 15):  # rot after validation: the reports still call them valid
        _corrupt(cfg, step)

    pinned = cfg.model_copy(update={"resume_from": _ckpt(15)})  # J-r1's CKPT_RESUME_FROM
    with pytest.raises(ResumeError, match="cannot be restored"):
        Job(seed=1).start(pinned)

    after = _report(log)
    status = {c.id: c.status for c in after.checkpoints}
    # the pin, and the chain link the ladder would take next (probed, not only the pin)
    assert status[_ckpt(15)] == status[_ckpt(10)] == CheckpointStatus.CORRUPTED
    assert status[_ckpt(5)] == CheckpointStatus.VALID  # where the probe stopped
    assert status["heartbeat_step_000000000017"] == CheckpointStatus.VALID  # the rebuild rung
    bad = [c for c in after.checkpoints if c.status == CheckpointStatus.CORRUPTED]
    assert all(c.verdict_at >= after.written_at - 60 and c.verdict_at > 0 for c in bad)
    # the verdicts are in storage too (an operator that can read it sees the same)
    assert _statuses(cfg) == {5: "valid", 10: "corrupted", 15: "corrupted"}


def test_a_start_reports_what_storage_holds_corrupted_verdicts_and_heartbeat_included(
    run: tuple[AgentConfig, Path],
) -> None:
    cfg, log = run
    _corrupt(cfg, 15)
    pinned = cfg.model_copy(update={"resume_from": _ckpt(15)})
    with pytest.raises(ResumeError):
        Job(seed=1).start(pinned)
    log.write_bytes(b"")  # a new container: the kubelet's fresh file
    with pytest.raises(ResumeError, match="corrupted"):  # the pin is known corrupted now
        Job(seed=2).start(pinned)
    status = {c.id: c.status for c in _report(log).checkpoints}
    assert status[_ckpt(15)] == CheckpointStatus.CORRUPTED
    assert status[_ckpt(10)] == status[_ckpt(5)] == CheckpointStatus.VALID
    assert "heartbeat_step_000000000017" in status
