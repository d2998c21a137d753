"""Issue #28 (seen under load in #26): a validation still running when its checkpoint is
retired (a resume pin abandoned its branch), deleted (retention) or re-saved never
overwrites what happened meanwhile. The validator is held inside its load until that
happened, then released: deterministic, no timing."""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckpt_agent.format.layout import checkpoint_prefix, commit_key, validation_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.readers import read_validation
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.metrics import Metrics
from ckpt_agent.persist.builder import PersistBuilder, PersistParts
from ckpt_agent.persist.finalize import FinalizeJob, FinalizeResult
from ckpt_agent.persist.validate import ValidationOutcome
from ckpt_agent.persist.verdicts import FINAL
from ckpt_agent.persist.writer import TensorSource
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage

V, C, E = CheckpointStatus.VALID, CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED
STEP = 10
CID = checkpoint_id(Tier.PULSE, STEP)


@dataclass
class Rig:
    parts: PersistParts
    store: LocalStorage
    run: str
    events: list[dict[str, Any]]

    def write(self, salt: int = 0) -> str:
        """Commit the pulse of step 10 (``salt``: other bytes, another COMMIT); its hash."""
        data = b"".join(struct.pack("<f", (i % 89) * 0.5 + salt) for i in range(32 * 32))
        src = [TensorSource("model/w", "float32", (32, 32), memoryview(data))]
        meta = CheckpointMeta(
            run_id=self.run, step=STEP, tier=Tier.PULSE, sections=("model",), created_at=salt
        )
        state = {"model": {"w": {"__tensor__": "model/w"}}}
        writer = self.parts.writer
        committed = writer.commit(meta, [writer.write_rank(meta, 0, state, src)])
        rec = committed.commit.record(committed.manifest_hash, CheckpointStatus.PENDING)
        self.parts.catalog.upsert(self.run, rec)
        return committed.manifest_hash

    def verdict(self, status: CheckpointStatus, digest: str, reason: str = "") -> None:
        """Store a verdict as the restore side does (retiring: ``expired``)."""
        raw = ValidationVerdict(CID, digest, status, reason, validated_at=1.0).to_bytes()
        self.store.commit(validation_key(self.run, CID), raw)
        self.parts.catalog.set_status(self.run, CID, status, reason)

    def stored(self) -> CheckpointStatus | None:
        v = read_validation(self.store, self.run, CID)
        return None if v is None else v.status

    def catalog_status(self) -> CheckpointStatus | None:
        recs = [r for r in self.parts.catalog.records(self.run) if r.id == CID]
        return recs[0].status if recs else None

    def outcome(self, status: CheckpointStatus, digest: str) -> ValidationOutcome:
        return ValidationOutcome(CID, status, manifest_hash=digest)


@pytest.fixture
def rig(
    tmp_path: Path, ck_store: LocalStorage, ck_config: Callable[..., AgentConfig]
) -> Iterator[Rig]:
    cfg = ck_config(retention={"routineKeep": 10, "importantKeep": 10})
    events: list[dict[str, Any]] = []

    def emit(event: str, **fields: Any) -> None:
        events.append({"event": event, **fields})

    parts = PersistBuilder(cfg, storage=ck_store).build(
        tmp_path / "catalog.sqlite", metrics=Metrics(), emit=emit, gc_grace_s=0.0
    )
    try:
        yield Rig(parts, ck_store, cfg.run_id, events)
    finally:
        parts.close()


def finalize_held(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, digest: str, meanwhile: Callable[[], None]
) -> FinalizeResult:
    """Finalize the checkpoint with its validation held inside the load until
    ``meanwhile()`` ran."""
    entered, release = threading.Event(), threading.Event()
    validator = rig.parts.finalizer.validator
    real = validator.load

    def held(ckpt_id: str, rank: int = 0) -> Any:
        entered.set()
        assert release.wait(30), "never released"
        return real(ckpt_id, rank)

    monkeypatch.setattr(validator, "load", held)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            rig.parts.finalizer.finalize, FinalizeJob(CID, Tier.PULSE, STEP, digest)
        )
        assert entered.wait(30), "the validation never started"
        meanwhile()
        release.set()
        return running.result(30)


def test_a_checkpoint_retired_while_validated_stays_expired(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    digest = rig.write()
    retired = "superseded: the run resumed from pulse_step_000000000005 (step 5)"
    result = finalize_held(rig, monkeypatch, digest, lambda: rig.verdict(E, digest, retired))
    assert result.outcome.status == V  # the bytes were fine ...
    # ... but the resume's verdict stood: the retention pass that followed released it as
    # expired (a resurrected VALID would have kept it, and the abandoned branch with it)
    assert result.retention is not None and result.retention.deleted == [CID]
    assert "expired" in str(result.retention.plan)
    assert not rig.store.exists(validation_key(rig.run, CID))
    assert rig.parts.finalizer.valid == 0
    assert not [e for e in rig.events if e["event"] in ("validated", "corrupted")]


def test_the_expiry_stands_when_the_validation_ends(rig: Rig) -> None:
    """The same at the record itself (no retention pass after it)."""
    digest = rig.write()
    outcome = rig.parts.validator.validate(CID)  # validated ...
    assert outcome.valid
    rig.verdict(E, digest, "superseded")  # ... retired before the verdict is written
    assert not rig.parts.validator.record(outcome)
    assert rig.stored() == E and rig.catalog_status() == E


def test_a_checkpoint_retired_and_deleted_while_validated_gets_no_verdict(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load then fails (the files are gone): CORRUPTED, which must neither overwrite
    the expiry nor leave a verdict behind for a checkpoint that no longer exists."""
    digest = rig.write()

    def retire_and_delete() -> None:
        rig.verdict(E, digest, "superseded")
        rig.store.delete_prefix(checkpoint_prefix(rig.run, CID))

    result = finalize_held(rig, monkeypatch, digest, retire_and_delete)
    assert result.outcome.status == C
    assert not rig.store.exists(validation_key(rig.run, CID))
    assert not [k for k in rig.store.list(checkpoint_prefix(rig.run, CID))]
    assert [r.id for r in list_checkpoints(rig.store, rig.run)] == []
    assert rig.parts.finalizer.corrupted == 0
    assert not [e for e in rig.events if e["event"] == "corrupted"]


def test_a_checkpoint_re_saved_while_validated_is_judged_by_its_own_validation(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held validation loads the new COMMIT (its hash is not the job's): nothing is
    recorded for it; the new COMMIT's own validation then records VALID (a stale
    CORRUPTED would have been final)."""
    old = rig.write(salt=0)
    fresh: list[str] = []
    result = finalize_held(rig, monkeypatch, old, lambda: fresh.append(rig.write(salt=1)))
    assert result.outcome.status == C and "COMMIT changed" in result.outcome.reason
    assert rig.stored() is None
    monkeypatch.undo()
    again = rig.parts.finalizer.finalize(FinalizeJob(CID, Tier.PULSE, STEP, fresh[0]))
    assert again.outcome.valid
    assert rig.stored() == V and rig.catalog_status() == V


@pytest.mark.parametrize(
    ("stored", "outcome", "written", "after"),
    [
        (None, V, True, V),
        (None, C, True, C),
        (V, C, True, C),  # newer evidence of corruption wins over valid
        (V, V, True, V),
        (C, V, False, C),  # never resurrected
        (C, C, True, C),  # the same verdict: in force
        (E, V, False, E),
        (E, C, False, E),
    ],
)
def test_record_never_re_judges_a_final_verdict(
    rig: Rig,
    stored: CheckpointStatus | None,
    outcome: CheckpointStatus,
    written: bool,
    after: CheckpointStatus,
) -> None:
    digest = rig.write()
    if stored is not None:
        rig.verdict(stored, digest, "before")
    assert rig.parts.validator.record(rig.outcome(outcome, digest)) is written
    assert rig.stored() == after
    assert (stored in FINAL) is (stored is not None and stored != V)


def test_record_a_verdict_on_another_commit_is_not_final_for_this_one(rig: Rig) -> None:
    old = rig.write(salt=0)
    rig.verdict(E, old, "superseded")  # the old COMMIT was retired; it was then re-saved
    new = rig.write(salt=1)
    assert new != old
    assert rig.parts.validator.record(rig.outcome(V, new))
    assert rig.stored() == V


def test_record_needs_the_commit_it_judged(rig: Rig) -> None:
    digest = rig.write()
    # gone
    rig.store.delete(commit_key(rig.run, CID))
    assert not rig.parts.validator.record(rig.outcome(C, digest))
    assert rig.stored() is None
    # unreadable: nothing to bind a verdict to; the corrupted outcome stands
    rig.store.commit(commit_key(rig.run, CID), b"garbage")
    assert rig.parts.validator.record(rig.outcome(C, ""))
    assert rig.stored() is None
    # another COMMIT than the caller asked about
    new = rig.write(salt=2)
    stale = ValidationOutcome(CID, V, manifest_hash=new, expected_hash=digest)
    assert not rig.parts.validator.record(stale)
    assert rig.stored() is None
