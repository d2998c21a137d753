"""A Checkpointer that a newer one took the run over from (a zombie pod): it stops with
FencedError on its next save, on every later call, whatever on_persist_error says, and
deletes nothing; and ``warn`` never reports a failed save as saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.errors import FencedError
from ckpt_agent.format.fence import generations
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.storage.fs import LocalStorage
from tests.ckpt_agent.runtime.test_checkpointer import (
    ConfigFactory,
    FlakyStorage,
    Trainer,
    _started,
    _store,
    _store_for,
)


@pytest.mark.parametrize("mode", ["auto", "warn", "raise"])
def test_a_zombie_checkpointer_is_fenced_and_deletes_nothing(
    ck_config: ConfigFactory, tmp_path: Path, mode: Any
) -> None:
    cfg = ck_config()
    t_old, old = _started(cfg, steps=3, on_persist_error=mode)
    assert old.save_now("before the takeover") is not None
    store = _store(cfg)
    # the restarted job (its own work dir) starts on the same run while the old one lives on
    cfg_new = ck_config(workDir=str(tmp_path / "work-new"))
    _, new = _started(cfg_new, Trainer(seed=1), steps=0)
    assert generations(store, "run1") == [1, 2]
    new_id = new.save_now("the holder's save", step=100)
    assert new_id is not None
    assert new.wait(30)  # its verdict written
    before = sorted(i.key for i in store.list() if "/writers/" not in i.key)
    with pytest.raises(FencedError) as ei:
        old.save_now("the zombie's save", step=3)
    msg = str(ei.value)
    assert "generation 2" in msg and "holds generation 1" in msg and "Stop this process" in msg
    for call in (lambda: t_old.run(old, 4, 5), lambda: old.wait(5), old.close):
        with pytest.raises(FencedError):  # every later call, close included
            call()
    after = sorted(i.key for i in store.list() if "/writers/" not in i.key)
    assert after == before  # the fenced writer wrote and deleted nothing
    assert verify_hashes(store, "run1", new_id).ok
    new.close()
    assert new_id in {r.id for r in list_checkpoints(store, "run1")}


def test_warn_never_reports_a_failed_save_as_saved(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    store = _store_for(cfg, FlakyStorage)
    t, ckpt = _started(cfg, steps=2, storage=store, on_persist_error="warn")
    store.armed = True
    assert ckpt.save_now("fails", step=2) is None  # logged, not raised: but no id
    store.armed = True
    ckpt.save_now("fails too", step=3, wait=False)
    assert ckpt.wait(30) is False
    assert ckpt.save_now("works", step=4) is not None
    assert ckpt.wait(30) is True
    ckpt.close()
    del t


def test_a_second_start_on_the_run_claims_the_next_generation(ck_config: ConfigFactory) -> None:
    cfg = ck_config()
    for expected in ([1], [1, 2]):
        _, ckpt = _started(cfg, steps=1)
        ckpt.close()
        assert (
            generations(LocalStorage(Path(cfg.work_dir or "").parent / "store"), "run1") == expected
        )
