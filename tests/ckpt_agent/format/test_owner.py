"""The run's owner record: written once; the agent claims its run at start and refuses a
run another namespace owns (issue #17), or a legacy run nobody claimed; an administrator
claims one (issue #28)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_agent.errors import CheckpointFormatError, RunOwnershipError
from ckpt_agent.format.owner import (
    RunOwner,
    admin_claim,
    check_owner,
    claim_owner,
    has_checkpoints,
    owner_from_env,
    owner_key,
    read_owner,
)
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.storage import Storage
from ckpt_agent.storage.fs import LocalStorage
from tests.ckpt_agent.storage.conftest import make_s3, minio  # noqa: F401 - fixtures
from tests.ckpt_agent.storage.conftest import storage as any_storage  # noqa: F401 - fixture


def test_owner_from_env() -> None:
    assert owner_from_env({}) is None
    assert owner_from_env({"CKPT_NAMESPACE": "  "}) is None
    owner = owner_from_env({"CKPT_NAMESPACE": "a", "CKPT_JOB_NAME": "j", "CKPT_JOB_UID": "u"})
    assert owner is not None and (owner.namespace, owner.job, owner.uid) == ("a", "j", "u")
    assert owner.claimed_by == "agent" and owner.time > 0


def test_check_owner_claims_reads_and_refuses(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    a, b = RunOwner("a", "j"), RunOwner("b", "k")
    assert check_owner(storage, "r", a, claim=False) == a  # nothing to read: no claim
    assert read_owner(storage, "r") is None
    assert check_owner(storage, "r", a, claim=True) == a
    assert check_owner(storage, "r", RunOwner("a", "other-job"), claim=True) == a
    with pytest.raises(RunOwnershipError, match="belongs to namespace a, not b"):
        check_owner(storage, "r", b, claim=True)
    with pytest.raises(RunOwnershipError):
        check_owner(storage, "r", b, claim=False)
    assert read_owner(storage, "r") == a


def test_the_agent_claims_its_run_and_refuses_another_namespaces(
    ck_config: Callable[..., AgentConfig], ck_store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    def start(namespace: str) -> None:
        monkeypatch.setenv("CKPT_NAMESPACE", namespace)
        monkeypatch.setenv("CKPT_JOB_NAME", f"job-{namespace}")
        model = torch.nn.Linear(2, 2)
        ck = Checkpointer(ck_config(), model=model, storage=ck_store)
        try:
            ck.start()
        finally:
            ck.close()

    start("team-a")
    owner = read_owner(ck_store, "run1")
    assert owner is not None and (owner.namespace, owner.job) == ("team-a", "job-team-a")
    start("team-a")  # its own run again: fine
    with pytest.raises(RunOwnershipError, match="team-a"):
        start("team-b")
    assert claim_owner(ck_store, "run1", RunOwner("x")).namespace == "team-a"


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 4000,  # nesting past the interpreter's recursion limit
        b'{"namespace": "a", "time": ' + b"9" * 3000 + b"}",  # float() would overflow
        b'{"namespace": "a", "time": 1e400}',
        b'["a"]',
        b"\xff",
        b'{"namespace": "' + b"a" * 5000 + b'"}',
    ],
    ids=["deep", "huge-int", "inf", "not-an-object", "not-utf8", "oversized"],
)
def test_a_hostile_owner_record_is_a_format_error(raw: bytes) -> None:
    with pytest.raises(CheckpointFormatError, match=r"OWNER\.json"):
        RunOwner.from_bytes(raw)


# --------------------------------------------------------------------------- legacy runs (#28)


def _legacy(storage: LocalStorage, run_id: str = "r") -> None:
    """Checkpoint data of a run written before owner records existed (no OWNER.json)."""
    storage.commit(f"{run_id}/steps/full_step_000000000010/COMMIT", b"{}")


def test_a_writer_refuses_a_legacy_run_on_every_rank(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    _legacy(storage)
    for claim in (True, False):
        with pytest.raises(RunOwnershipError, match="no owner record") as info:
            check_owner(storage, "r", RunOwner("a"), claim=claim)
        assert "ckpt claim --storage <url> --run-id r --namespace a" in str(info.value)
    assert read_owner(storage, "r") is None  # nothing claimed
    # a new run (nothing under steps/, e.g. only a stale heartbeat folder) is not legacy
    storage.commit("n/heartbeat/rank_00000.json", b"{}")
    assert check_owner(storage, "n", RunOwner("a"), claim=True).namespace == "a"
    # once an administrator claimed the legacy run, its namespace's writer proceeds
    admin_claim(storage, "r", RunOwner("a", claimed_by="admin"))
    assert check_owner(storage, "r", RunOwner("a", "job"), claim=True).claimed_by == "admin"
    with pytest.raises(RunOwnershipError, match="belongs to namespace a"):
        check_owner(storage, "r", RunOwner("b"), claim=True)


def test_admin_claim(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    a, b = RunOwner("a", claimed_by="admin"), RunOwner("b", claimed_by="admin")
    assert admin_claim(storage, "r", a) == (None, a)  # unowned: claimed
    assert admin_claim(storage, "r", RunOwner("a", "other")) == (a, a)  # already a's: kept
    with pytest.raises(RunOwnershipError, match="--force"):
        admin_claim(storage, "r", b)
    assert read_owner(storage, "r") == a
    assert admin_claim(storage, "r", b, force=True) == (a, b)
    assert read_owner(storage, "r") == b
    storage.commit(owner_key("u"), b"<html>")
    with pytest.raises(CheckpointFormatError):
        admin_claim(storage, "u", a)
    assert admin_claim(storage, "u", a, force=True) == (None, a)


def test_the_agent_refuses_to_resume_a_legacy_run_until_it_is_claimed(
    ck_config: Callable[..., AgentConfig], ck_store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    def start() -> None:
        model = torch.nn.Linear(2, 2)
        ck = Checkpointer(ck_config(), model=model, storage=ck_store)
        try:
            ck.start()
            ck.save_now("test", step=1)
            ck.wait()
        finally:
            ck.close()

    monkeypatch.delenv("CKPT_NAMESPACE", raising=False)
    start()  # outside Kubernetes: no owner record written
    assert read_owner(ck_store, "run1") is None
    monkeypatch.setenv("CKPT_NAMESPACE", "team-a")
    with pytest.raises(RunOwnershipError, match="no owner record"):
        start()
    assert read_owner(ck_store, "run1") is None
    admin_claim(ck_store, "run1", RunOwner("team-a", claimed_by="admin"))
    start()
    assert read_owner(ck_store, "run1").namespace == "team-a"  # type: ignore[union-attr]


def test_legacy_detection_and_admin_claim_on_every_backend(any_storage: Storage) -> None:  # noqa: F811
    """The same rules over a listing of the backend (S3: one page of the run's steps/)."""
    assert not has_checkpoints(any_storage, "r")
    _legacy_on(any_storage, "r")
    any_storage.commit("new/writers/00000001.json", b"{}")  # a writer's record: not legacy
    assert has_checkpoints(any_storage, "r") and not has_checkpoints(any_storage, "new")
    with pytest.raises(RunOwnershipError, match="no owner record"):
        check_owner(any_storage, "r", RunOwner("a"), claim=True)
    assert check_owner(any_storage, "new", RunOwner("a"), claim=True).namespace == "a"
    before, now = admin_claim(any_storage, "r", RunOwner("a", claimed_by="admin"))
    assert before is None and read_owner(any_storage, "r") == now
    assert check_owner(any_storage, "r", RunOwner("a"), claim=False) == now


def _legacy_on(storage: Storage, run_id: str) -> None:
    storage.commit(f"{run_id}/steps/full_step_000000000010/COMMIT", b"{}")
