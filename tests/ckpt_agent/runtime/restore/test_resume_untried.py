"""Issue #28: one odd checkpoint never makes ``start()`` skip the newest real one.

A real run (the real :class:`Checkpointer`, a local store) saves steps 5 and 10; a valid
checkpoint of *another* model (incompatible with this one) is then found at step 12,
its hash chain pointing back at step 5. ``start()`` must try step 10 before going back
to step 5, resume from it, mark only the checkpoint it tried and rejected (12), and the
retention that follows must keep step 10. A start bounded in the candidates it verifies
fails loudly instead of loading forged checkpoints without end.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_agent import tuning
from ckpt_agent.errors import ResumeError
from ckpt_agent.format.layout import (
    blob_key,
    commit_key,
    dumps,
    rank_manifest_key,
    sha256_hex,
    validation_key,
)
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.runtime.restore import loading, preflight
from ckpt_agent.runtime.restore.resume_point import ResumePoint
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"
OTHER = "other"
#: Checkpoints only where the test saves, every one kept by the test's own policy.
POLICY: dict[str, Any] = {
    "tiers": {
        "heartbeat": {"enabled": False},
        "pulse": {"baseInterval": 500, "minInterval": 400, "maxInterval": 600},
        "full": {"everySteps": 1000},
    },
    "retention": {"routineKeep": 100, "importantKeep": 100},
}


class Job:
    """A small model and SGD; ``hidden`` sets its shape (another value: another model)."""

    def __init__(self, seed: int, hidden: int = 32) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.ckpt: Checkpointer | None = None

    def start(self, cfg: AgentConfig) -> ResumePoint:
        self.ckpt = Checkpointer(cfg, model=self.model, optimizer=self.opt)
        return self.ckpt.start()

    def train(self, start: int, stop: int, *, save_at: tuple[int, ...] = ()) -> None:
        assert self.ckpt is not None
        for s in range(start, stop):
            self.opt.zero_grad()
            loss = self.model(torch.randn(4, 6)).pow(2).mean()
            loss.backward()
            self.opt.step()
            self.ckpt.step(s, float(loss.item()))
            if s in save_at:
                assert self.ckpt.save_now(f"test save at {s}") is not None

    def stop(self) -> None:
        assert self.ckpt is not None
        assert self.ckpt.wait(60)
        self.ckpt.close()
        self.ckpt = None


def _id(step: int) -> str:
    return f"full_step_{step:012d}"


def _store(cfg: AgentConfig) -> LocalStorage:
    return LocalStorage(Path(cfg.work_dir or "").parent / "store")


def _statuses(store: LocalStorage) -> dict[int, CheckpointStatus]:
    return {r.step: r.status for r in list_checkpoints(store, RUN) if r.tier != Tier.HEARTBEAT}


def transplant(store: LocalStorage, src: str, step: int, prev: str | None) -> str:
    """Copy ``OTHER``'s checkpoint ``src`` into ``RUN`` as step ``step`` with its chain
    pointing at ``prev`` (a manifest hash): a valid checkpoint, every hash right, of a
    model this run does not have. Returns its id."""
    cid = _id(step)
    manifest = json.loads(store.read(rank_manifest_key(OTHER, src, 0)))
    commit = json.loads(store.read(commit_key(OTHER, src)))
    for digest in manifest["blobs"]:
        store.write(blob_key(RUN, digest), store.read(blob_key(OTHER, digest)))
    for doc in (manifest, commit):
        doc.update(run_id=RUN, checkpoint_id=cid, step=step, prev_hash=prev)
    raw = dumps(manifest)
    store.commit(rank_manifest_key(RUN, cid, 0), raw)
    commit["ranks"][0].update(sha256=sha256_hex(raw), size=len(raw))
    raw_commit = dumps(commit)
    store.commit(commit_key(RUN, cid), raw_commit)
    verdict = ValidationVerdict(cid, sha256_hex(raw_commit), CheckpointStatus.VALID, "", 1.0)
    store.commit(validation_key(RUN, cid), verdict.to_bytes())
    return cid


@pytest.fixture
def odd_run(ck_config: Callable[..., AgentConfig]) -> AgentConfig:
    """Steps 5 and 10 of this run, and another model's checkpoint at step 12 whose chain
    points back at step 5."""
    cfg = ck_config(**POLICY)
    job = Job(seed=0)
    assert job.start(cfg).step == 0
    job.train(0, 11, save_at=(5, 10))
    job.stop()
    other = Job(seed=3, hidden=20)
    assert other.start(cfg.model_copy(update={"run_id": OTHER})).step == 0
    other.train(0, 13, save_at=(12,))
    other.stop()
    store = _store(cfg)
    five, _ = read_checkpoint(store, RUN, _id(5))
    transplant(store, _id(12), 12, five.manifest_hash)
    assert _statuses(store) == {
        5: CheckpointStatus.VALID,
        10: CheckpointStatus.VALID,
        12: CheckpointStatus.VALID,
    }
    return cfg


def test_an_incompatible_newest_checkpoint_whose_chain_skips_step_10_resumes_step_10(
    odd_run: AgentConfig,
) -> None:
    store = _store(odd_run)
    job = Job(seed=1)
    point = job.start(odd_run)
    assert point.checkpoint_id == _id(10), point
    assert point.step == 11
    rejected = dict(point.rejected)
    assert set(rejected) == {_id(12)}, rejected
    assert "does not fit" in rejected[_id(12)]
    # only what was tried and found unusable is retired; the resume point and older stay
    assert _statuses(store) == {
        5: CheckpointStatus.VALID,
        10: CheckpointStatus.VALID,
        12: CheckpointStatus.EXPIRED,
    }
    reason = {r.step: r.extra.get("status_reason", "") for r in list_checkpoints(store, RUN)}
    assert "tried" in reason[12] and "does not fit" in reason[12], reason[12]
    # the run goes on from step 10: its next checkpoint chains on it, and retention
    # (after that checkpoint's validation) keeps step 10
    job.train(point.step, 15, save_at=(14,))
    job.stop()
    statuses = _statuses(store)
    assert statuses[10] == statuses[14] == CheckpointStatus.VALID, statuses
    ten, _ = read_checkpoint(store, RUN, _id(10))
    fourteen = {r.step: r for r in list_checkpoints(store, RUN)}[14]
    assert fourteen.prev_hash == ten.manifest_hash


def test_step_10_is_tried_before_going_back_even_when_this_machine_cannot_load_it(
    odd_run: AgentConfig,
) -> None:
    """When step 10 cannot be loaded here (too large for this machine), it was tried and
    found unusable: the start goes back to step 5 and retires it, saying why."""
    store = _store(odd_run)
    job = Job(seed=1)
    real = preflight.check_budget

    def budget(cid: str, parts: Any, limit: int | None) -> None:
        real(cid, parts, 0 if cid == _id(10) else limit)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "check_budget", budget)
        point = job.start(odd_run)
    assert point.checkpoint_id == _id(5), point
    assert [cid for cid, _ in point.rejected] == [_id(12), _id(10)]
    assert _statuses(store) == {
        5: CheckpointStatus.VALID,
        10: CheckpointStatus.EXPIRED,
        12: CheckpointStatus.EXPIRED,
    }
    job.stop()


def test_a_pending_checkpoint_the_start_did_not_verify_is_left_as_it_is(
    odd_run: AgentConfig, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 10's validation never finished (no verdict: pending) and it is older than the
    newest valid checkpoint, so the start does not verify it: resuming step 5 must not
    retire it either (it was not tried), and says so."""
    store = _store(odd_run)
    store.delete(validation_key(RUN, _id(10)))
    job = Job(seed=1)
    with caplog.at_level("WARNING"):
        point = job.start(odd_run)
    assert point.checkpoint_id == _id(5), point
    assert _statuses(store) == {
        5: CheckpointStatus.VALID,
        10: CheckpointStatus.PENDING,
        12: CheckpointStatus.EXPIRED,
    }
    assert any(_id(10) in m and "not tried" in m for m in caplog.messages), caplog.messages
    job.stop()


def test_start_verifies_at_most_the_bound_of_candidates_and_says_so(
    odd_run: AgentConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forged valid-looking checkpoints newer than every real one: ``start()`` loads at most
    :data:`~ckpt_agent.tuning.MAX_RESUME_CANDIDATES` of them, then fails with what happened
    and what to do (it resumes nothing older past candidates it did not try)."""
    store = _store(odd_run)
    bound = 4
    monkeypatch.setattr(tuning, "MAX_RESUME_CANDIDATES", bound)
    forged: list[str] = []
    prev = None
    for step in range(20, 20 + 2 * bound):  # a chain of forged checkpoints
        forged.append(transplant(store, _id(12), step, prev))
        prev = read_checkpoint(store, RUN, forged[-1])[0].manifest_hash
    loads: list[str] = []
    real = loading.CandidateLoader.load

    def counting(self: loading.CandidateLoader, rec: Any) -> Any:
        loads.append(rec.id)
        return real(self, rec)

    monkeypatch.setattr(loading.CandidateLoader, "load", counting)
    job = Job(seed=1)
    with pytest.raises(ResumeError) as info:
        job.start(odd_run)
    assert job.ckpt is not None
    job.ckpt.close()
    assert len(loads) == bound, loads
    assert loads == sorted(forged, reverse=True)[:bound]  # newest first
    message = str(info.value)
    assert f"{bound} candidates" in message and "MAX_RESUME_CANDIDATES" in message, message
    assert "ckpt recover" in message, message
    # nothing was resumed: nothing newer or older than the tried ones was marked
    statuses = {r.id: r.status for r in list_checkpoints(store, RUN)}
    assert statuses[_id(10)] == statuses[_id(5)] == CheckpointStatus.VALID
    assert all(statuses[c] == CheckpointStatus.VALID for c in forged)
