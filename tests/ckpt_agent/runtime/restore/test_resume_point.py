"""The restore side hands the save side its result once (ResumePoint.handover →
Persister.start): the next checkpoint links to the restored one and carries its lineage;
the newest valid step storage held seeds the finalizer (Engines over fakes sharing one
in-memory storage: three lives of one run)."""

from __future__ import annotations

from collections.abc import Callable

import runtime_fakes as fk
import torch

from ckpt_agent.decide.decision import Decision
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Lineage, checkpoint_id
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine, Handover
from ckpt_agent.runtime.restore.restorer import Restorer
from ckpt_agent.runtime.save.thread_persister import ThreadPersister

ConfigFactory = Callable[..., AgentConfig]

FULL_5, PULSE_8, PULSE_9 = (
    checkpoint_id(t, s) for t, s in ((Tier.FULL, 5), (Tier.PULSE, 8), (Tier.PULSE, 9))
)


def _life(config: AgentConfig, storage: fk.MemoryStorage) -> tuple[Engine, fk.Fakes, StateCapture]:
    engine, fakes = fk.make_engine(config, storage=storage)
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 3)
    return engine, fakes, StateCapture(engine, model, torch.optim.SGD(model.parameters(), lr=0.1))


def _persist(engine: Engine, capture: StateCapture, handover: Handover, *steps: int) -> None:
    p = ThreadPersister(engine, capture, None, approximate_threshold=None)
    p.start(handover)
    for step in steps:
        tier = Tier.FULL if step % 5 == 0 else Tier.PULSE
        p.save(Decision(step=step, save=True, tier=tier), {})
        assert p.wait_persisted(10)
    assert p.wait_validated(10)
    p.close(10)
    assert p.take_errors() == []


def _link(storage: fk.MemoryStorage, run_id: str, cid: str) -> tuple[str, str | None, Lineage]:
    committed, manifest = read_checkpoint(storage, run_id, cid, 0)
    return committed.manifest_hash, manifest.meta.prev_hash, manifest.meta.lineage


def test_the_next_save_after_a_resume_links_to_the_restored_checkpoint(
    ck_config: ConfigFactory,
) -> None:
    cfg, storage = ck_config(), fk.MemoryStorage()
    e1, _, c1 = _life(cfg, storage)
    _persist(e1, c1, Handover(), 5, 8)
    e1.close()
    h8, prev8, _ = _link(storage, cfg.run_id, PULSE_8)

    e2, f2, c2 = _life(cfg, storage)
    point = Restorer(e2, c2).resume_point()
    assert (point.checkpoint_id, point.step) == (PULSE_8, 9)
    handover = point.handover()
    assert handover.prev_hash == h8 and handover.checkpoint_step == 8
    assert handover.lineage == point.lineage == Lineage(parent=PULSE_8)
    assert handover.last_valid_step == -1  # nothing was validated in the first life
    _persist(e2, c2, handover, 9)
    e2.close()
    _, prev9, lineage9 = _link(storage, cfg.run_id, PULSE_9)
    assert prev9 == h8 and lineage9 == Lineage(parent=PULSE_8)
    assert f2.finalizer.jobs[0].step == 9

    # the second life's resume verified 5 and 8: the third life hands the newest valid on
    e3, f3, c3 = _life(cfg, storage)
    third = Restorer(e3, c3).resume_point().handover()
    assert third.last_valid_step == 8  # 5 and 8 verified by the second life; 9 is pending
    _persist(e3, c3, third)
    assert f3.finalizer.last_valid_step == third.last_valid_step
    e3.close()
    assert prev8 == _link(storage, cfg.run_id, FULL_5)[0]  # the first life's chain: 8 → 5
