"""FSDP2 state saved at world size 4 and loaded at world size 2 (DCP planning, our format).

Real ``fully_shard`` models on CPU/gloo. The save plans chunks with DCP's planner, writes
them through our writer (zstd, SHA-256, de-duplication) with the two-phase commit; the
load merges the four ranks' layouts into DCP metadata (from our JSON, never a pickled
``.metadata``) and lets DCP's load planner reshard for two ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import ckpt_dist_harness as h
import ckpt_dist_workers as w
import pytest

from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.persist.validate import Validator
from ckpt_agent.policy.models import Tier, ValidationSpec
from ckpt_agent.storage.fs import LocalStorage

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def test_fsdp_saved_at_world_4_loads_at_world_2(tmp_path: Path) -> None:
    out = tmp_path / "save"
    h.codes_ok(h.launch(w.fsdp_save, 4, out, 3, timeout=150), out)
    store = LocalStorage(tmp_path / "store")
    records = list_checkpoints(store, w.RUN, include_heartbeat=False)
    assert len(records) == 1 and records[0].world_size == 4 and records[0].tier == Tier.FULL
    ckpt_id = records[0].id
    saved = [json.loads((out / f"saved.rank{r}.json").read_text()) for r in range(4)]
    assert len({s["hash"] for s in saved}) == 1
    # every rank wrote its own shards; plain tensors (optimizer steps) only rank 0
    assert all(s["chunks"] for s in saved)
    assert all(not any(c.endswith("/step@") for c in s["chunks"]) for s in saved[1:])
    chunks = [c for s in saved for c in s["chunks"]]
    assert len(chunks) == len(set(chunks))
    _, m0 = read_checkpoint(store, w.RUN, ckpt_id, 0)
    assert "sharded" in m0.meta.sections
    v = Validator(store, w.RUN, ValidationSpec(load_in_subprocess=False))
    assert all(v.validate(ckpt_id, rank=r).valid for r in range(4))

    out2 = tmp_path / "load"
    out2.mkdir()
    h.codes_ok(h.launch(w.fsdp_load, 2, out2, ckpt_id, timeout=150), out2)
    before = json.loads((out / "saved_full.json").read_text())
    after = json.loads((out2 / "loaded_full.json").read_text())
    assert before == after
    assert any("exp_avg" in k for k in before)  # optimizer state made the trip too


def test_checkpointer_fsdp_world_4_resumes_at_world_2(tmp_path: Path) -> None:
    """The same through ``Checkpointer``: an FSDP2 model is detected (DTensors), every rank
    writes its shards, and a 2-rank job resumes the 4-rank job's newest checkpoint with the
    identical model and optimizer state (reported as not bitwise exact: another world)."""
    out = tmp_path / "save"
    h.codes_ok(h.launch(w.fsdp_ckpt, 4, out, 7, "save", timeout=150), out)
    store = LocalStorage(tmp_path / "store")
    records = list_checkpoints(store, w.RUN, include_heartbeat=False)
    assert records and all(r.world_size == 4 for r in records)
    newest = records[-1]
    out2 = tmp_path / "load"
    h.codes_ok(h.launch(w.fsdp_ckpt, 2, out2, 4, "load", timeout=150), out2)
    resume = json.loads((out2 / "resume.json").read_text())
    assert resume["checkpoint"] == newest.id and resume["step"] == newest.step + 1
    assert not resume["exact"] and any("world size 4" in x for x in resume["warnings"])
    before = json.loads((out / f"full_at_{newest.step}.json").read_text())
    after = json.loads((out2 / "loaded_full.json").read_text())
    assert before == after
    records = list_checkpoints(store, w.RUN, include_heartbeat=False)
    assert records[-1].world_size == 2 and records[-1].step > newest.step
