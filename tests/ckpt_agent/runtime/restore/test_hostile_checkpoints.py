"""Issue #17: forged checkpoints never crash ``Checkpointer.start()``; the previous one is used.

A real run (the real :class:`Checkpointer`, a local storage root) saves two
checkpoints; the newest is then forged as an attacker with write access to
the store would: the contents are malformed but every hash is recomputed, so
the COMMIT → rank manifest → blob chain is consistent and the forged COMMIT
even carries a ``valid`` verdict. ``start()`` must reject it with a reason,
mark it corrupted (when its bytes are at fault) and resume from the previous
checkpoint; the validator and ``ckpt verify`` must call it corrupted, ``ckpt
ls`` must list the rest; nothing may be half-applied to the live model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.errors import RejectionKind, ResumeError
from ckpt_agent.format.layout import (
    RECOVER_MAX_BYTES,
    blob_key,
    commit_key,
    dumps,
    rank_manifest_key,
    recover_request_key,
    sha256_hex,
    validation_key,
)
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.validate import Validator, load_check
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import ValidationSpec
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"
Doc = dict[str, Any]


class Position:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, s: dict[str, int]) -> None:
        self.pos = s["pos"]


class Tiny:
    """Model (weights big enough to be stored as blobs), AdamW, StepLR, GradScaler, data."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.9)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        self.data = Position()

    def checkpointer(self, cfg: AgentConfig) -> Checkpointer:
        return Checkpointer(
            cfg,
            model=self.model,
            optimizer=self.opt,
            lr_scheduler=self.sched,
            grad_scaler=self.scaler,
            dataloader_state=self.data,
        )

    def run(self, ckpt: Checkpointer, start: int, stop: int) -> None:
        for s in range(start, stop):
            self.opt.zero_grad()
            loss = self.model(torch.randn(4, 40)).pow(2).mean()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            self.data.pos += 1
            ckpt.step(s, float(loss.item()))

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


@dataclass
class Run:
    cfg: AgentConfig
    store: LocalStorage
    first: str
    second: str
    first_weights: dict[str, torch.Tensor]


@pytest.fixture
def run(ck_config: Callable[..., AgentConfig]) -> Run:
    cfg = ck_config(
        tiers={
            "heartbeat": {"enabled": False},
            "pulse": {"baseInterval": 1000, "minInterval": 500, "maxInterval": 2000},
        }
    )
    t = Tiny()
    ckpt = t.checkpointer(cfg)
    ckpt.start()
    t.run(ckpt, 0, 3)
    first = ckpt.save_now("first")
    weights = t.weights()
    t.run(ckpt, 3, 6)
    second = ckpt.save_now("second")
    assert ckpt.wait(30)
    ckpt.close()
    assert first is not None and second is not None
    store = LocalStorage(Path(cfg.work_dir or "").parent / "store")
    return Run(cfg, store, first, second, weights)


# --------------------------------------------------------------------------- forging


def publish_commit(store: LocalStorage, cid: str, raw: bytes) -> None:
    """Replace the COMMIT and bless it with a ``valid`` verdict bound to its hash."""
    store.commit(commit_key(RUN, cid), raw)
    verdict = ValidationVerdict(cid, sha256_hex(raw), CheckpointStatus.VALID, validated_at=1.0)
    store.commit(validation_key(RUN, cid), verdict.to_bytes())


def forge_rank(store: LocalStorage, cid: str, edit: Callable[[Doc], bytes | None]) -> None:
    """Edit rank 0's manifest, then recompute the chain (COMMIT's ref, verdict)."""
    key = rank_manifest_key(RUN, cid, 0)
    doc = json.loads(store.read(key))
    raw = edit(doc) or dumps(doc)
    store.commit(key, raw)
    commit = json.loads(store.read(commit_key(RUN, cid)))
    commit["ranks"][0].update(sha256=sha256_hex(raw), size=len(raw))
    publish_commit(store, cid, dumps(commit))


def put_blob(store: LocalStorage, data: bytes) -> str:
    digest = sha256_hex(data)
    store.write(blob_key(RUN, digest), data)
    return digest


def huge_tensor(doc: Doc) -> None:
    entry = doc["tensors"]["model/0.weight"]
    digest = entry["chunks"][0]
    n = 10**12
    entry.update(shape=[n], nbytes=4 * n, chunks=[digest])


def shape_overflow(doc: Doc) -> None:
    entry = doc["tensors"]["optimizer/state/0/step"]
    entry.update(shape=[2**70, 0], nbytes=0)


def deep_nesting(doc: Doc) -> None:
    tree: Any = 1
    for _ in range(100):
        tree = [tree, 2.5]
    doc["state"]["progress"] = tree


def swapped_refs(doc: Doc) -> None:
    model = doc["state"]["model"]
    model["0.weight"], model["2.weight"] = model["2.weight"], model["0.weight"]


def bad_rng(doc: Doc) -> None:
    doc["state"]["rng"]["python"]["internal"] = [1, 2, 3]


def object_dtype(doc: Doc) -> None:
    doc["state"]["progress"] = {"x": {"__npscalar__": ["object", 1]}}


def dtype_tag(doc: Doc) -> None:
    doc["state"]["progress"] = {"x": {"__dtype__": "object"}}


def model_not_a_mapping(doc: Doc) -> None:
    doc["state"]["model"] = [1, 2]


def missing_optimizer_section(doc: Doc) -> None:
    del doc["state"]["optimizer"]


def foreign_scheduler_attribute(doc: Doc) -> None:
    doc["state"]["lr_scheduler"]["optimizer"] = 5


def big_int_in_tree(doc: Doc) -> bytes:
    doc["state"]["progress"] = {"x": "__BIG__"}
    return dumps(doc).replace(b'"__BIG__"', b"9" * 5000)


def codec_none_size_disagrees(doc: Doc) -> None:
    entry = doc["tensors"]["model/0.weight"]
    digest = entry["chunks"][0]
    blob = doc["blobs"].pop(digest)
    raw = bytes(blob["raw_size"])
    stored = raw + b"\0" * 64
    new = sha256_hex(stored)
    doc["_store"] = stored  # written by the test
    doc["blobs"][new] = {
        "codec": "none",
        "size": len(stored),
        "raw_size": len(raw),
        "raw_sha256": sha256_hex(raw),
    }
    entry["chunks"] = [new]


FORGERIES: dict[str, Callable[[Doc], bytes | None]] = {
    "huge_tensor": huge_tensor,
    "shape_overflow": shape_overflow,
    "deep_nesting": deep_nesting,
    "swapped_refs": swapped_refs,
    "bad_rng": bad_rng,
    "object_dtype": object_dtype,
    "dtype_tag": dtype_tag,
    "model_not_a_mapping": model_not_a_mapping,
    "missing_optimizer_section": missing_optimizer_section,
    "rng_not_a_mapping": lambda doc: doc["state"].update(rng=[1]),
    "big_int_in_tree": big_int_in_tree,
}


def _forge(run: Run, name: str) -> None:
    def edit(doc: Doc) -> bytes | None:
        return FORGERIES[name](doc)

    forge_rank(run.store, run.second, edit)


def _cli(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return res.exit_code, res.output


def _resume(run: Run) -> tuple[Tiny, Any]:
    t = Tiny(seed=1)
    ckpt = t.checkpointer(run.cfg)
    point = ckpt.start()
    ckpt.close()
    return t, point


def _assert_fell_back(run: Run, kind: RejectionKind | None = None) -> str:
    t, point = _resume(run)
    assert point.checkpoint_id == run.first, point
    rejected = dict(point.rejected)
    assert run.second in rejected, point.rejected
    for k, v in t.weights().items():
        assert torch.equal(v, run.first_weights[k]), k  # fully the previous checkpoint's
    statuses = {r.id: r.status for r in list_checkpoints(run.store, RUN)}
    if kind is None or kind.corrupted:
        assert statuses[run.second] == CheckpointStatus.CORRUPTED
    return str(rejected[run.second])


def _assert_refused_by_readers(run: Run) -> None:
    report = load_check(run.store, RUN, run.second)
    assert not report.ok and report.error
    validator = Validator(run.store, RUN, ValidationSpec(load_in_subprocess=False))
    try:
        assert validator.validate(run.second).status == CheckpointStatus.CORRUPTED
    finally:
        validator.close()
    args = ("--storage", str(run.store.root), "--run-id", RUN)
    code, out = _cli("verify", run.second, *args)
    assert code == 1 and "CORRUPTED" in out and "Traceback" not in out, out
    code, out = _cli("verify", run.first, *args)
    assert code == 0, out
    code, out = _cli("ls", *args)
    assert code == 0 and run.first in out and "Traceback" not in out, out


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_hash_consistent_forgery_is_rejected_and_the_previous_one_used(run: Run, name: str) -> None:
    _forge(run, name)
    reason = _assert_fell_back(run)
    assert reason
    _assert_refused_by_readers(run)


def test_codec_none_blob_whose_size_disagrees(run: Run) -> None:
    def edit(doc: Doc) -> None:
        codec_none_size_disagrees(doc)
        put_blob(run.store, doc.pop("_store"))

    forge_rank(run.store, run.second, edit)
    assert "uncompressed blob" in _assert_fell_back(run)
    _assert_refused_by_readers(run)


def test_zstd_bomb_in_one_chunk_is_refused_before_decompressing(run: Run) -> None:
    zeros = bytes(1 << 20)
    cobj = zstandard.ZstdCompressor(level=1).compressobj()  # no content size in the frame
    bomb = b"".join(cobj.compress(zeros) for _ in range(64)) + cobj.flush()
    assert len(bomb) < 64 * 1024

    def edit(doc: Doc) -> None:
        entry = doc["tensors"]["model/0.weight"]
        old = doc["blobs"][entry["chunks"][0]]
        digest = put_blob(run.store, bomb)
        doc["blobs"][digest] = {**old, "size": len(bomb), "codec": "zstd", "shuffle": 0}
        entry["chunks"] = [digest]

    forge_rank(run.store, run.second, edit)
    assert "blob" in _assert_fell_back(run)
    _assert_refused_by_readers(run)


def test_a_rejection_while_applying_falls_back_without_marking(run: Run) -> None:
    """The live objects refuse the newest checkpoint (the data loader raises on its position):
    not the checkpoint's fault (not marked), the next rung overwrites what was applied."""

    class Picky(Position):
        def load_state_dict(self, s: dict[str, int]) -> None:
            if s["pos"] == 6:
                raise ValueError("this loader cannot seek to 6")
            super().load_state_dict(s)

    t = Tiny(seed=1)
    t.data = Picky()
    ckpt = t.checkpointer(run.cfg)
    point = ckpt.start()
    ckpt.close()
    assert point.checkpoint_id == run.first and t.data.pos == 3
    assert "applying it failed" in dict(point.rejected)[run.second]
    for k, v in t.weights().items():
        assert torch.equal(v, run.first_weights[k])
    statuses = {r.id: r.status for r in list_checkpoints(run.store, RUN)}
    assert statuses[run.second] != CheckpointStatus.CORRUPTED


def test_a_foreign_scheduler_attribute_is_refused_before_anything_is_applied(run: Run) -> None:
    forge_rank(run.store, run.second, foreign_scheduler_attribute)
    reason = _assert_fell_back(run, RejectionKind.INCOMPATIBLE)
    assert "overwrite an attribute" in reason


def test_nothing_is_half_applied_when_no_candidate_fits(run: Run) -> None:
    for cid in (run.first, run.second):
        forge_rank(run.store, cid, swapped_refs)
    t = Tiny(seed=1)
    before = t.weights()
    ckpt = t.checkpointer(run.cfg)
    with pytest.raises(ResumeError, match=r"could be restored|none is usable"):
        ckpt.start()
    ckpt.close()
    for k, v in t.weights().items():
        assert torch.equal(v, before[k]), k  # the live model is untouched


def test_a_broken_live_model_is_the_scripts_error_not_the_checkpoints(run: Run) -> None:
    class Broken(torch.nn.Sequential):
        def state_dict(self, *args: Any, **kwargs: Any) -> Any:
            raise KeyError("the training script's own bug")

    t = Tiny(seed=1)
    t.model = Broken(*t.model)
    ckpt = t.checkpointer(run.cfg)
    with pytest.raises(KeyError, match="own bug"):
        ckpt.start()
    ckpt.close()
    statuses = {r.id: r.status for r in list_checkpoints(run.store, RUN)}
    assert statuses[run.first] == statuses[run.second] == CheckpointStatus.VALID


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            lambda c: c.replace(b'"score":', b'"score":' + b"9" * 5000 + b',"x":'), id="int"
        ),
        pytest.param(lambda c: c.replace(b'"created_at":', b'"created_at":1e400,"y":'), id="1e400"),
        pytest.param(lambda c: c + b" " * (24 << 20), id="24MiB"),
        pytest.param(lambda c: b"[" * 100_000 + b"]" * 100_000, id="deep"),
    ],
)
def test_a_hostile_commit_never_hides_the_others(run: Run, raw: Callable[[bytes], bytes]) -> None:
    publish_commit(run.store, run.second, raw(run.store.read(commit_key(RUN, run.second))))
    recs = {r.id: r for r in list_checkpoints(run.store, RUN)}
    assert recs[run.first].status == CheckpointStatus.VALID
    assert recs[run.second].status == CheckpointStatus.CORRUPTED
    assert recs[run.second].extra["error"].count("\n") == 0
    _, point = _resume(run)
    assert point.checkpoint_id == run.first
    args = ("--storage", str(run.store.root), "--run-id", RUN)
    code, out = _cli("ls", *args)
    assert code == 0 and run.first in out and run.second in out and "Traceback" not in out, out
    code, out = _cli("verify", "--all", *args)
    assert code == 1 and "Traceback" not in out, out


def test_flips_truncations_swaps_and_replays_fall_back(run: Run) -> None:
    """What held in #17 keeps holding (no hash recomputed: plain damage)."""
    second_commit = run.store.read(commit_key(RUN, run.second))
    # a verbatim replay of the older COMMIT into the newer folder: listed as corrupted
    publish_commit(run.store, run.second, run.store.read(commit_key(RUN, run.first)))
    recs = {r.id: r for r in list_checkpoints(run.store, RUN)}
    assert recs[run.second].status == CheckpointStatus.CORRUPTED
    assert "copied from another checkpoint" in recs[run.second].extra["error"]
    assert _resume(run)[1].checkpoint_id == run.first
    # a swapped rank manifest (the older one's) under the newer, intact COMMIT
    publish_commit(run.store, run.second, second_commit)
    key = rank_manifest_key(RUN, run.second, 0)
    mine = run.store.read(key)
    run.store.commit(key, run.store.read(rank_manifest_key(RUN, run.first, 0)))
    assert "IntegrityError" in _assert_fell_back(run)
    # a truncated rank manifest
    run.store.commit(key, mine[:-10])
    publish_commit(run.store, run.second, second_commit)
    assert "IntegrityError" in _assert_fell_back(run)


def test_a_candidate_larger_than_memory_is_refused_before_allocating(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ckpt_agent.runtime.restore.loading.memory_budget", lambda: 20_000)
    t = Tiny(seed=1)
    before = t.weights()
    ckpt = t.checkpointer(run.cfg)
    with pytest.raises(ResumeError, match="memory"):
        ckpt.start()
    ckpt.close()
    for k, v in t.weights().items():
        assert torch.equal(v, before[k]), k
    statuses = {r.id: r.status for r in list_checkpoints(run.store, RUN)}
    assert statuses[run.first] == statuses[run.second] == CheckpointStatus.VALID  # not marked


def test_a_missing_commit_or_a_symlink_loop_under_steps_leaves_the_rest_usable(run: Run) -> None:
    steps = run.store.root / RUN / "steps"
    os.symlink(steps / "loop", steps / "loop")
    os.symlink(steps, steps / "pulse_step_000000000099")
    assert _resume(run)[1].checkpoint_id == run.second
    run.store.delete(commit_key(RUN, run.second))
    assert [r.id for r in list_checkpoints(run.store, RUN)] == [run.first]
    assert _resume(run)[1].checkpoint_id == run.first


def test_a_symlinked_blob_of_the_newest_checkpoint_is_rejected(run: Run, tmp_path: Path) -> None:
    """A blob replaced by a link to a file outside the root (same bytes, so every hash
    holds): never followed; the checkpoint is rejected and the previous one resumed."""
    older = set(read_checkpoint(run.store, RUN, run.first)[1].blobs)
    digest = min(set(read_checkpoint(run.store, RUN, run.second)[1].blobs) - older)
    path = run.store.root / blob_key(RUN, digest)
    outside = tmp_path / "outside"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    os.symlink(outside, path)
    assert "UnsafePathError" in _assert_fell_back(run)
    assert path.is_symlink() and outside.exists()  # the link is reported, not followed


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,  # nesting past the interpreter's recursion limit
        b'{"checkpoint_id": ' + b"9" * 5000 + b"}",
        b'{"checkpoint_id": "' + b"x" * RECOVER_MAX_BYTES + b'"}',
        b"\xff\xfe",
    ],
    ids=["deep", "huge-int", "oversized", "not-utf8"],
)
def test_a_hostile_recover_request_is_a_resume_error_that_says_what_to_do(
    run: Run, raw: bytes
) -> None:
    run.store.commit(recover_request_key(RUN), raw)
    ckpt = Tiny(seed=1).checkpointer(run.cfg)
    try:
        with pytest.raises(ResumeError, match=r"RECOVER\.json.*delete .*RECOVER\.json"):
            ckpt.start()
    finally:
        ckpt.close()
