"""ThreadPersister over an Engine of fakes (in-memory storage, no SQLite, no validator
process): the hash chain continues across saves from what the resume handed over,
back-pressure while a persist runs, a failure reported once and not linked to, rank 0's
validator thread gets every commit."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import runtime_fakes as fk
import torch

from ckpt_agent.decide.decision import Decision, SaveResult
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, Lineage, checkpoint_id
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine, Handover
from ckpt_agent.runtime.save.thread_persister import ThreadPersister

ConfigFactory = Callable[..., AgentConfig]

PREV = "ab" * 32
LINEAGE = Lineage(epoch=1, pins=("CKPT_RESUME_FROM:full_step_3",), parent="full_step_3")


def _persister(
    config: AgentConfig, **engine_kw: object
) -> tuple[ThreadPersister, Engine, fk.Fakes]:
    engine, fakes = fk.make_engine(config, **engine_kw)  # type: ignore[arg-type]
    torch.manual_seed(0)
    capture = StateCapture(engine, torch.nn.Linear(4, 3))
    return ThreadPersister(engine, capture, None, approximate_threshold=None), engine, fakes


def _save(p: ThreadPersister, step: int, tier: Tier = Tier.PULSE) -> str | None:
    return p.save(Decision(step=step, save=True, tier=tier, score=1.5, reason="test"), {})


def _manifest_of(fakes: fk.Fakes, run_id: str, cid: str) -> tuple[str, str | None, Lineage]:
    committed, manifest = read_checkpoint(fakes.storage, run_id, cid, 0)
    return committed.manifest_hash, manifest.meta.prev_hash, manifest.meta.lineage


def test_the_chain_continues_from_the_handover_across_saves(ck_config: ConfigFactory) -> None:
    p, engine, fakes = _persister(ck_config())
    p.start(Handover(prev_hash=PREV, lineage=LINEAGE, checkpoint_step=3, last_valid_step=3))
    assert fakes.finalizer.last_valid_step == 3  # seeded before the validator thread runs
    ids = []
    for step in (4, 6, 8):
        ids.append(_save(p, step))
        assert p.wait_persisted(10) and p.wait_validated(10)
    p.close(10)
    links = [_manifest_of(fakes, engine.run_id, str(cid)) for cid in ids]
    assert [prev for _, prev, _ in links] == [PREV, links[0][0], links[1][0]]
    assert {lineage for _, _, lineage in links} == {LINEAGE}
    # rank 0's validator thread finalized each commit, with the hash it committed
    assert [j.manifest_hash for j in fakes.finalizer.jobs] == [h for h, _, _ in links]
    assert set(fakes.finalizer.threads) == {"ckpt-validate-0"}
    assert [fakes.catalog.rows[str(c)].status for c in ids] == [CheckpointStatus.PENDING] * 3
    assert engine.stats.committed == 3
    outcomes = []
    while not engine.feedback.empty():
        outcomes.append(engine.feedback.get_nowait())
    assert [(o.result, o.tier) for o in outcomes] == [(SaveResult.PERSISTED, Tier.PULSE)] * 3


def test_a_fresh_start_begins_a_new_chain(ck_config: ConfigFactory) -> None:
    p, engine, fakes = _persister(ck_config())
    p.start(Handover())
    cid = _save(p, 0, Tier.FULL)
    assert p.wait_persisted(10)
    p.close(10)
    _, prev, lineage = _manifest_of(fakes, engine.run_id, str(cid))
    assert prev is None and lineage == Lineage()


def test_busy_while_the_persist_owns_the_buffers(ck_config: ConfigFactory) -> None:
    storage = fk.MemoryStorage()
    gate = threading.Event()
    entered = threading.Event()

    def hold(key: str) -> None:
        if key.endswith("COMMIT"):
            entered.set()
            assert gate.wait(10)

    storage.before_write = hold
    p, _, _ = _persister(ck_config(), storage=storage)
    p.start(Handover())
    assert not p.busy
    assert _save(p, 5) == checkpoint_id(Tier.PULSE, 5)
    assert entered.wait(10)
    assert p.busy and not p.wait_persisted(0.05)  # still owns the buffers
    gate.set()
    p.wait_free()
    assert not p.busy and p.wait_persisted(10)
    p.close(10)


def test_a_failed_persist_is_reported_once_and_the_chain_skips_it(
    ck_config: ConfigFactory,
) -> None:
    storage = fk.MemoryStorage()

    def fail_step_6(key: str) -> None:
        if checkpoint_id(Tier.PULSE, 6) in key and key.endswith("COMMIT"):
            raise OSError("storage refused the commit")

    storage.before_write = fail_step_6
    p, engine, fakes = _persister(ck_config(), storage=storage)
    p.start(Handover(prev_hash=PREV))
    first = _save(p, 4)
    assert p.wait_persisted(10)
    _save(p, 6)
    assert p.wait_persisted(10)
    errors = p.take_errors()
    assert [e.tier for e in errors] == [Tier.PULSE]
    assert "storage refused the commit" in str(errors[0].error)
    assert "step 6" in errors[0].what
    assert p.take_errors() == []  # once
    third = _save(p, 8)
    assert p.wait_persisted(10) and p.wait_validated(10)
    p.close(10)
    h4, _, _ = _manifest_of(fakes, engine.run_id, str(first))
    _, prev8, _ = _manifest_of(fakes, engine.run_id, str(third))
    assert prev8 == h4  # the failed save is no link of the chain
    assert [j.step for j in fakes.finalizer.jobs] == [4, 8]


def test_a_failed_validation_is_reported_once_too(ck_config: ConfigFactory) -> None:
    p, _, fakes = _persister(ck_config())
    fakes.finalizer.fail = RuntimeError("validator broke")
    p.start(Handover())
    _save(p, 2)
    assert p.wait_persisted(10) and p.wait_validated(10)
    errors = p.take_errors()
    assert [(e.tier, str(e.error)) for e in errors] == [(None, "validator broke")]
    assert p.take_errors() == []
    p.close(10)


def test_a_rank_that_does_not_write_starts_no_thread(ck_config: ConfigFactory) -> None:
    p, _, _ = _persister(ck_config(), rank=1, world_size=2)
    p.start(Handover())
    assert not p.busy and p.wait_persisted(0) and p.wait_validated(0)
    assert p.take_errors() == []
    p.close(1)
    names = {t.name for t in threading.enumerate()}
    assert "ckpt-persist-1" not in names and "ckpt-validate-1" not in names


def test_saving_before_start_is_a_bug(ck_config: ConfigFactory) -> None:
    p, _, _ = _persister(ck_config())
    with pytest.raises(AssertionError):
        _save(p, 1)
