"""ShmPersister over an Engine of fakes and a scripted shared-memory target: what each save
hands the persister process (the chain's previous link, the lineage, the resume step, one
token), the results it takes back (hashes continue the chain, errors once), and
back-pressure when no slot is free."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import runtime_fakes as fk
import torch

from ckpt_agent.decide.decision import Decision, SaveOutcome, SaveResult
from ckpt_agent.flash.protocol import PersistedMark
from ckpt_agent.format.manifest import lineage_from_json
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Json, Lineage, checkpoint_id
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Engine, Handover
from ckpt_agent.runtime.shm.persister import ShmPersister

ConfigFactory = Callable[..., AgentConfig]

LINEAGE = Lineage(epoch=2, pins=("RECOVER.json:full_step_10",), parent="full_step_10")


@dataclass
class _Desc:
    seq: int
    slot: int
    stall_s: float = 0.001
    data_size: int = 100


@dataclass
class FakeTarget:
    """What ShmPersister uses of a FlashTarget; ``free`` slots, ``marks`` to hand back."""

    free: int = 2
    local_persister: bool = False
    writer: object | None = None
    written: list[dict[str, Any]] = field(default_factory=list)
    prepared: list[list[str]] = field(default_factory=list)
    marks: list[PersistedMark] = field(default_factory=list)
    waited_free: int = 0
    closed: bool = False

    def start(self) -> None:
        self.writer = object()

    @property
    def busy(self) -> bool:
        return self.free == 0

    def wait_free(self, timeout: float | None = None) -> bool:
        self.waited_free += 1
        return self.free > 0

    def write(
        self,
        step: int,
        tier: Tier,
        sections: Mapping[str, object],
        *,
        files: Mapping[str, bytes] | None = None,
        meta: Mapping[str, Json] | None = None,
    ) -> _Desc | None:
        if self.free == 0:
            return None
        self.free -= 1
        self.written.append({"step": step, "tier": tier, "sections": sections, "meta": meta})
        return _Desc(seq=len(self.written), slot=len(self.written) % 2)

    def poll(self) -> list[PersistedMark]:
        out, self.marks = self.marks, []
        return out

    def wait(self, seq: int | None = None, timeout: float | None = None) -> PersistedMark | None:
        return self.marks[-1] if self.marks else None

    @property
    def last_seq(self) -> int:
        return len(self.written)

    def system_signals(self) -> tuple[int | None, float | None]:
        return 1, 12.5

    def prepare(self, sections: Mapping[str, object], files_bytes: int = 0) -> int:
        self.prepared.append(sorted(sections))
        return 0

    def close(self, timeout: float | None = 60.0) -> bool:
        self.closed = True
        return True

    def handled(self, seq: int, step: int, **kw: Any) -> None:
        self.free += 1
        cid = checkpoint_id(Tier.PULSE, step)
        self.marks.append(PersistedMark(seq=seq, step=step, checkpoint_id=cid, **kw))


def _persister(config: AgentConfig) -> tuple[ShmPersister, FakeTarget, Engine]:
    engine, _ = fk.make_engine(config)
    capture = StateCapture(engine, torch.nn.Linear(2, 2))
    target = FakeTarget()
    return ShmPersister(engine, capture, None, flash=target), target, engine  # type: ignore[arg-type]


def _save(p: ShmPersister, step: int) -> str | None:
    return p.save(Decision(step=step, save=True, tier=Tier.PULSE, score=2.0), {})


def test_each_save_carries_the_chain_link_the_persister_reported_last(
    ck_config: ConfigFactory,
) -> None:
    p, target, engine = _persister(ck_config(shmDir="/dev/shm/unused"))
    p.start(Handover(prev_hash="11" * 32, lineage=LINEAGE, checkpoint_step=10))
    assert _save(p, 11) == checkpoint_id(Tier.PULSE, 11)
    target.handled(1, 11, ok=True, committed=True, manifest_hash="22" * 32, persist_s=0.3)
    p.poll()
    _save(p, 12)
    target.handled(2, 12, ok=True, committed=False, manifest_hash=None)  # a part only: no link
    p.poll()
    _save(p, 13)
    metas = [w["meta"] for w in target.written]
    assert [m["prev_hash"] for m in metas] == ["11" * 32, "22" * 32, "22" * 32]
    assert {m["resume_step"] for m in metas} == {10}
    assert all(lineage_from_json(m["lineage"], "test") == LINEAGE for m in metas)
    tokens = [m["token"] for m in metas]
    assert len(set(tokens)) == 3
    assert [w["sections"]["progress"]["token"] for w in target.written] == tokens
    assert engine.stats.committed == 1 and engine.stats.saves == 3


def test_results_reach_the_scheduler_and_errors_are_reported_once(
    ck_config: ConfigFactory,
) -> None:
    p, target, engine = _persister(ck_config(shmDir="/dev/shm/unused"))
    p.start(Handover())
    _save(p, 1)
    _save(p, 2)
    target.handled(1, 1, ok=True, committed=True, manifest_hash="33" * 32, persist_s=0.25)
    target.handled(2, 2, ok=False, error="bucket gone")
    p.poll()
    outcomes: list[SaveOutcome] = []
    while not engine.feedback.empty():
        outcomes.append(engine.feedback.get_nowait())
    assert [(o.result, o.persist_seconds) for o in outcomes] == [(SaveResult.PERSISTED, 0.25)]
    errors = p.take_errors()
    assert [(e.tier, str(e.error)) for e in errors] == [(Tier.PULSE, "bucket gone")]
    assert "step 2" in errors[0].what
    assert p.take_errors() == []
    assert p.system_signals() == (1, 12.5)


def test_no_free_slot_after_one_wait_defers_the_save(ck_config: ConfigFactory) -> None:
    p, target, engine = _persister(ck_config(shmDir="/dev/shm/unused"))
    p.start(Handover())
    target.free = 0
    settled: list[SaveOutcome] = []
    engine.scheduler.settle = settled.append  # type: ignore[method-assign]
    assert p.busy
    assert _save(p, 4) is None
    assert target.waited_free == 1 and target.written == []
    assert [(o.result, o.step) for o in settled] == [(SaveResult.DEFERRED, 4)]
    assert engine.stats.saves == 0


def test_before_start_it_is_idle_and_close_stops_the_target(ck_config: ConfigFactory) -> None:
    p, target, _ = _persister(ck_config(shmDir="/dev/shm/unused"))
    assert not p.busy and p.wait_persisted(0) and p.system_signals() == (None, None)
    p.poll()  # nothing to take in
    p.close(1)
    assert target.closed and p.take_errors() == []


def test_prepare_is_work_for_a_background_thread(ck_config: ConfigFactory) -> None:
    """The slots are sized and touched off ``start()``'s critical path: prepare() returns the
    work (the checkpointer runs it on a thread and joins it before the first snapshot)."""
    p, target, _ = _persister(ck_config(shmDir="/dev/shm/unused"))
    work = p.prepare(0)
    assert work is not None and target.prepared == []
    work()
    assert target.prepared and "model" in target.prepared[0]


def test_a_memory_tier_snapshot_is_memory_only_and_feeds_its_own_costs(
    ck_config: ConfigFactory,
) -> None:
    p, target, engine = _persister(ck_config(shmDir="/dev/shm/unused"))
    p.start(Handover(prev_hash="11" * 32, lineage=LINEAGE, checkpoint_step=10))
    memory = Decision(step=12, save=False, tier=None, memory=True, memory_interval=2)
    assert p.save(memory, {}) == checkpoint_id(Tier.PULSE, 12)
    meta = target.written[-1]["meta"]
    assert meta["memory_only"] is True and "-memory-" in meta["token"]
    assert target.written[-1]["tier"] == Tier.PULSE
    target.handled(1, 12, ok=True, committed=False, manifest_hash=None, persist_s=0.01)
    p.poll()
    got: list[SaveOutcome] = []
    while not engine.feedback.empty():
        got.append(engine.feedback.get_nowait())
    assert [(o.result, o.memory) for o in got] == [(SaveResult.PERSISTED, True)]
    assert engine.stats.committed == 0 and p.take_errors() == []
    _save(p, 13)  # the next durable save still links to the last commit
    assert target.written[-1]["meta"]["prev_hash"] == "11" * 32
    assert "memory_only" not in target.written[-1]["meta"]
