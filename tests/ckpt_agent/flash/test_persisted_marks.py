"""``persisted.json`` carries the persister's earlier results: a trainer that polls after
several saves were handled sees every one (its save-latency histogram observes them all)."""

from __future__ import annotations

import json
from pathlib import Path

from ckpt_agent.flash.protocol import MARK_HISTORY, PersistedMark
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.shm.target import FlashTarget

RUN = "run1"


def _mark(seq: int, *, ok: bool = True) -> PersistedMark:
    return PersistedMark(
        seq=seq, step=10 * seq, checkpoint_id=f"c{seq}", ok=ok, persist_s=seq / 100
    )


def test_marks_keep_a_bounded_history_oldest_first(tmp_path: Path) -> None:
    reader = ShmReader(tmp_path, RUN, 0)
    for seq in range(1, MARK_HISTORY + 6):
        reader.mark(_mark(seq, ok=seq != 3))
    newest = reader.persisted()
    assert newest is not None and newest.seq == MARK_HISTORY + 5
    assert [m.seq for m in newest.earlier] == list(range(5, MARK_HISTORY + 5))
    assert all(not m.earlier for m in newest.earlier)
    newer = [m.seq for m in newest.after(MARK_HISTORY + 2)]
    assert newer == [MARK_HISTORY + 3, MARK_HISTORY + 4, MARK_HISTORY + 5]
    assert newest.after(newest.seq) == []
    # a mark older than the history (a restarted area) drops the newer ones from it
    reader.mark(_mark(2))
    again = reader.persisted()
    assert again is not None and again.seq == 2 and again.earlier == ()


def test_a_mark_without_history_still_reads(tmp_path: Path) -> None:
    reader = ShmReader(tmp_path, RUN, 0)
    reader.mark(_mark(1))
    doc = json.loads(reader.persisted_path.read_bytes())
    del doc["earlier"]
    reader.persisted_path.write_text(json.dumps(doc))
    mark = reader.persisted()
    assert mark is not None and mark.seq == 1 and mark.after(0) == [mark]


def test_the_trainer_polls_every_result_since_its_last_poll(tmp_path: Path) -> None:
    config = AgentConfig.model_validate(
        {"runId": RUN, "storageUrl": (tmp_path / "store").as_uri(), "shmDir": str(tmp_path)}
    )
    target = FlashTarget(config, 0, 1, work_dir=tmp_path / "work", local_persister=False)
    reader = ShmReader(tmp_path, RUN, 0)
    reader.mark(_mark(1))  # a previous trainer's: not this one's to count
    target.start()
    try:
        assert target.poll() == []
        for seq in (2, 3, 4):
            reader.mark(_mark(seq, ok=seq != 3))
        got = target.poll()
        assert [(m.seq, m.ok, m.persist_s) for m in got] == [
            (2, True, 0.02),
            (3, False, 0.03),
            (4, True, 0.04),
        ]
        assert target.poll() == []
        reader.mark(_mark(5))
        assert [m.seq for m in target.poll()] == [5]
    finally:
        target.close()
