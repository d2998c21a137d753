"""``torch.distributed.checkpoint`` through :mod:`ckpt_agent.integrations.dcp`, on real gloo ranks.

One 2-rank job saves (``dcp.save``, then ``dcp.async_save``) DTensor shards, a replicated
tensor and plain values into our storage, and runs a torchtitan-style manager (save every
2 steps, keep the latest 2, restart and load the latest). The test then loads the
checkpoint at world size 1 (in this process, plain tensors) and 4 (DTensors), and corrupts
a blob to see the previous valid checkpoint loaded.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "distributed"):  # before any job starts the forkserver
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import ckpt_dcp_workers as w  # noqa: E402
import ckpt_dist_harness as h  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from ckpt_agent.format.layout import blob_key  # noqa: E402
from ckpt_agent.format.listing import list_checkpoints  # noqa: E402
from ckpt_agent.format.readers import read_checkpoint, read_commit  # noqa: E402
from ckpt_agent.integrations.dcp import DcpReader, load_latest  # noqa: E402
from ckpt_agent.records import CheckpointStatus  # noqa: E402
from ckpt_agent.storage.fs import LocalStorage  # noqa: E402

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.xdist_group("distributed"),
    pytest.mark.timeout(180),
]


def launch(fn: str, world: int, out: Path, *args: Any, timeout: float = 90.0) -> None:
    """Run ``ckpt_dcp_workers.<fn>`` on ``world`` gloo ranks; fail with their tracebacks."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = h.context()
    port = h.free_port()
    procs = [
        ctx.Process(target=w.entry, args=(fn, r, world, port, str(out), args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    h.codes_ok([p.exitcode for p in procs], out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The store after the 2-rank job (its out dir next to it)."""
    root = tmp_path_factory.mktemp("dcp")
    launch("save_and_titan", 2, root / "out", str(root / "store"))
    return root


def plain_target() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(w.ROWS, w.COLS), "b": torch.zeros(w.COLS, dtype=torch.float64)},
        "train_state": {"step": 0, "lr": 0.0, "betas": (0.0, 0.0)},
    }


def test_two_ranks_save_and_async_save_commit_valid_checkpoints(saved: Path) -> None:
    store = LocalStorage(saved / "store")
    records = list_checkpoints(store, "dcp1", include_heartbeat=False)
    assert [(r.step, r.status, r.world_size) for r in records] == [
        (1, CheckpointStatus.VALID, 2),
        (2, CheckpointStatus.VALID, 2),
    ]
    for r in records:
        committed = read_commit(store, "dcp1", r.id)
        assert committed.commit.meta.sections == ("dcp",)
    # the global metadata is JSON in rank 0's manifest; no pickled .metadata file anywhere
    _, m0 = read_checkpoint(store, "dcp1", records[-1].id, 0)
    assert isinstance(m0.state, dict) and "metadata" in m0.state["dcp"]
    assert not any(".metadata" in p.name for p in (saved / "store").rglob("*"))
    # each rank stored its own shard of w; the replicated b and the plain values once
    # (DCP's planner picks the rank)
    _, m1 = read_checkpoint(store, "dcp1", records[-1].id, 1)
    fqns = [[i["fqn"] for i in m.state["dcp"]["items"]] for m in (m0, m1)]  # type: ignore[index]
    assert fqns[0].count("model.w") == fqns[1].count("model.w") == 1
    rest = [f for f in fqns[0] + fqns[1] if f != "model.w"]
    assert sorted(rest) == sorted(set(rest))
    assert {"model.b", "train_state.step", "train_state.lr"} <= set(rest)
    assert json.loads((saved / "out" / "saved.rank0").read_text()) == [r.id for r in records]


def test_load_at_world_size_1_is_exact(saved: Path) -> None:
    target = plain_target()
    reader = DcpReader(w.config(saved / "store", "dcp1"))
    assert load_latest(target, reader) == "full_step_000000000002"
    assert torch.equal(target["model"]["w"], w.weight(2))
    assert torch.equal(target["model"]["b"], w.bias(2))
    assert target["train_state"] == {"step": 2, "lr": 0.2, "betas": (0.9, 0.95)}
    # an explicit step loads exactly that one
    target = plain_target()
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(target, storage_reader=reader, checkpoint_id="step-1", no_dist=True)
    assert torch.equal(target["model"]["w"], w.weight(1))


def test_load_at_world_size_4_is_exact(saved: Path, tmp_path: Path) -> None:
    launch("load_sharded", 4, tmp_path, str(saved / "store"), "dcp1", 2)
    for r in range(4):
        got = json.loads((tmp_path / f"loaded.rank{r}.json").read_text())
        assert got["loaded"] == "full_step_000000000002"
        assert got["w"] and got["b"], got
        assert got["train_state"]["step"] == 2


def test_corrupted_blob_is_detected_and_the_previous_valid_checkpoint_loaded(
    saved: Path, tmp_path: Path
) -> None:
    shutil.copytree(saved / "store", tmp_path / "store")
    store = LocalStorage(tmp_path / "store")
    _, newest = read_checkpoint(store, "dcp1", "full_step_000000000002", 1)
    _, older = read_checkpoint(store, "dcp1", "full_step_000000000001", 1)
    only_newest = sorted(newest.referenced_blobs() - older.referenced_blobs())
    assert only_newest
    path = tmp_path / "store" / blob_key("dcp1", only_newest[0])
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))  # the verdict still says valid: only the load can tell

    target = plain_target()
    loaded = load_latest(target, DcpReader(w.config(tmp_path / "store", "dcp1")))
    assert loaded == "full_step_000000000001"
    assert torch.equal(target["model"]["w"], w.weight(1))
    assert target["train_state"]["step"] == 1
    status = {r.step: r.status for r in list_checkpoints(store, "dcp1", include_heartbeat=False)}
    assert status == {1: CheckpointStatus.VALID, 2: CheckpointStatus.CORRUPTED}


def test_torchtitan_style_manager_saves_every_k_keeps_latest_k_loads_latest(saved: Path) -> None:
    store = LocalStorage(saved / "store")
    records = list_checkpoints(store, "titan", include_heartbeat=False)
    assert [r.step for r in records] == [4, 6]  # step 2 deleted by retention (keep 2)
    assert all(r.status == CheckpointStatus.VALID for r in records)
    for r in range(2):
        got = json.loads((saved / "out" / f"titan.rank{r}.json").read_text())
        assert got["saved"] == [2, 4, 6]
        assert got["loaded"] == "full_step_000000000006" and got["exact"]
        assert got["train_state"]["step"] == 6
        # a step at or before one already saved is refused with what to do
        assert "step 4 is not after step 6" in got["refused"]
        assert "CKPT_RUN_ID" in got["refused"]
