"""The heartbeat-rebuild rung with the real Checkpointer (issue #11 item 3).

The operator's decision ``rebuild_from_heartbeat`` reaches the pods as
``CKPT_RESUME_FROM=<heartbeat>`` plus ``CKPT_RESUME_WEIGHTS=<weights source>``: the
run continues at the heartbeat's step with its data position, the weights of the
source, marked not exact; a heartbeat pin without a weights source fails loudly.
Also: the run facts the operator passes (start time, MTBF) reach the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ckpt_agent.errors import ResumeError
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.agent_config import (
    ENV_MTBF_SECONDS,
    ENV_RESUME_PIN,
    ENV_RESUME_WEIGHTS,
    ENV_RUN_STARTED_AT,
)
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus

from .test_resume_lineage import POLICY, RUN, Job, _ckpt, _statuses, _store

ConfigFactory = Callable[..., AgentConfig]


def _newest_heartbeat(cfg: AgentConfig) -> tuple[str, int]:
    beats = [r for r in list_checkpoints(_store(cfg), RUN) if r.tier == Tier.HEARTBEAT]
    hb = max(beats, key=lambda r: r.step)
    return hb.id, hb.step


def _original(cfg: AgentConfig) -> None:
    job = Job(seed=0)
    assert job.start(cfg).step == 0
    job.train(0, 18, save_at=(5, 10))  # heartbeats every step, the newest at 17
    job.stop()


def test_rebuild_continues_at_the_heartbeat_step_not_exact(ck_config: ConfigFactory) -> None:
    cfg = ck_config(**POLICY)
    _original(cfg)
    hb, hb_step = _newest_heartbeat(cfg)
    assert hb_step == 17
    pinned = cfg.model_copy(update={"resume_from": hb, "resume_weights": _ckpt(5)})
    job = Job(seed=1)
    point = job.start(pinned)
    assert (point.checkpoint_id, point.checkpoint_step, point.step) == (hb, 17, 18)
    assert point.action == "resume_from"
    assert point.exact is False
    assert any("rebuilt from heartbeat" in w for w in point.warnings)
    assert job.data.pos == 18  # the heartbeat's data position, not step 5's
    assert point.lineage.epoch == 1 and point.lineage.pins == ("CKPT_RESUME_FROM:" + hb,)
    assert _statuses(cfg) == {5: "valid", 10: "valid"}  # nothing past the heartbeat to retire
    job.train(18, 22, save_at=(20,))
    job.stop()

    # an in-place restart of the rebuilt job continues its lineage (from step 20)
    again = Job(seed=2)
    assert again.start(pinned).checkpoint_id == _ckpt(20)
    again.stop()


def test_heartbeat_pin_without_weights_fails_loudly(ck_config: ConfigFactory) -> None:
    cfg = ck_config(**POLICY)
    _original(cfg)
    hb, _ = _newest_heartbeat(cfg)
    with pytest.raises(ResumeError, match="is a heartbeat: name a weights source"):
        Job(seed=1).start(cfg.model_copy(update={"resume_from": hb}))
    bad = cfg.model_copy(update={"resume_from": hb, "resume_weights": _ckpt(7)})
    with pytest.raises(ResumeError, match="weights source"):
        Job(seed=1).start(bad)


def test_manual_pin_is_a_new_pin_even_for_a_pinned_checkpoint(ck_config: ConfigFactory) -> None:
    """``CKPT_RESUME_PIN`` (a manual restart) rewinds to a checkpoint the lineage honours."""
    cfg = ck_config(**POLICY)
    _original(cfg)
    pinned = cfg.model_copy(update={"resume_from": _ckpt(5)})
    r1 = Job(seed=1)
    assert r1.start(pinned).checkpoint_id == _ckpt(5)
    r1.train(6, 14, save_at=(12,))
    r1.stop()
    assert Job(seed=2).start(pinned).checkpoint_id == _ckpt(12)  # spent: continues
    manual = pinned.model_copy(update={"resume_pin": "job-r2"})
    job = Job(seed=3)
    point = job.start(manual)
    assert (point.checkpoint_id, point.step, point.exact) == (_ckpt(5), 6, True)
    assert point.lineage.pins[0] == f"CKPT_RESUME_FROM:{_ckpt(5)}#job-r2"
    assert point.lineage.epoch == 2
    assert _statuses(cfg)[12] == CheckpointStatus.EXPIRED
    job.stop()


def test_run_facts_reach_the_scheduler(ck_config: ConfigFactory) -> None:
    env = {
        ENV_RESUME_WEIGHTS: _ckpt(5),
        ENV_RESUME_PIN: "j-r1",
        ENV_RUN_STARTED_AT: "1700000000",
        ENV_MTBF_SECONDS: "3600",
    }
    loaded = AgentConfig.from_env(env)
    assert (loaded.resume_weights, loaded.resume_pin) == (_ckpt(5), "j-r1")
    assert (loaded.run_started_at, loaded.mtbf_seconds) == (1_700_000_000.0, 3600.0)
    cfg = ck_config(**POLICY)
    _original(cfg)  # its scheduler state is saved in the checkpoints
    facts = cfg.model_copy(update={"run_started_at": 1_700_000_000.0, "mtbf_seconds": 3600.0})
    job = Job(seed=1)
    job.start(facts)  # resumes step 10: the restored scheduler state does not win
    assert job.ckpt is not None
    sched = job.ckpt._engine.scheduler
    assert sched.start_time == 1_700_000_000.0
    assert sched.mtbf_seconds == 3600.0
    job.stop()
