"""Preflight: a candidate decoded in full and checked against the live objects before
anything is applied; who is at fault decides the rejection (checkpoints written and read
over an Engine of fakes: in-memory storage, no SQLite)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import runtime_fakes as fk
import torch

from ckpt_agent.decide.decision import Decision
from ckpt_agent.errors import (
    CandidateRejectedError,
    CheckpointFormatError,
    IntegrityError,
    NotFoundError,
    RejectionKind,
    RetryableStorageError,
    UnsafePathError,
)
from ckpt_agent.format.heartbeat import Heartbeat
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import checkpoint_id
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.context import Handover
from ckpt_agent.runtime.core.serialization import LoadedState, load_tensors
from ckpt_agent.runtime.restore import preflight
from ckpt_agent.runtime.restore.preflight import (
    LiveState,
    as_rejection,
    check_budget,
    check_heartbeat,
    check_loaded,
    rejection_kind,
)
from ckpt_agent.runtime.save.thread_persister import ThreadPersister

ConfigFactory = Callable[..., AgentConfig]

FULL_1 = checkpoint_id(Tier.FULL, 1)


def _capture(config: AgentConfig, out: int = 3) -> StateCapture:
    engine, _ = fk.make_engine(config)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, out)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    return StateCapture(engine, model, opt, sched)


def _saved(config: AgentConfig, capture: StateCapture) -> LoadedState:
    """Full checkpoint of ``capture``'s objects, written and read back over the fakes."""
    engine, fakes = fk.make_engine(config)
    capture.engine = engine
    p = ThreadPersister(engine, capture, None, approximate_threshold=None)
    p.start(Handover())
    p.save(Decision(step=1, save=True, tier=Tier.FULL), {})
    assert p.wait_persisted(10)
    p.close(10)
    _, manifest = read_checkpoint(fakes.storage, engine.run_id, FULL_1, 0)
    return load_tensors(fakes.storage, engine.run_id, manifest, list(manifest.tensors))


def test_a_candidate_that_fits_passes_and_is_decoded_once(ck_config: ConfigFactory) -> None:
    cap = _capture(ck_config())
    loaded = _saved(ck_config(), cap)
    check_loaded(FULL_1, loaded, None, LiveState.of(cap, sharded=False))
    model = loaded.section("model")
    assert model is loaded.section("model")  # what was checked is what is applied
    assert isinstance(model, dict) and torch.equal(model["weight"], cap.model.weight)


def test_a_model_tree_of_other_shapes_is_the_candidates_fault(ck_config: ConfigFactory) -> None:
    loaded = _saved(ck_config(), _capture(ck_config(), out=3))
    live = LiveState.of(_capture(ck_config(), out=5), sharded=False)
    with pytest.raises(CheckpointFormatError, match="model entry 'weight'") as info:
        check_loaded(FULL_1, loaded, None, live)
    assert rejection_kind(info.value) is RejectionKind.FORMAT and RejectionKind.FORMAT.corrupted


def test_foreign_attributes_in_an_lr_scheduler_state_are_refused_not_applied(
    ck_config: ConfigFactory,
) -> None:
    cap = _capture(ck_config())
    loaded = _saved(ck_config(), cap)
    sched = loaded.section("lr_scheduler")
    assert isinstance(sched, dict)
    sched["optimizer"] = None  # would replace the live scheduler's optimizer
    with pytest.raises(CandidateRejectedError, match="would overwrite an attribute") as info:
        check_loaded(FULL_1, loaded, None, LiveState.of(cap, sharded=False))
    assert info.value.kind is RejectionKind.INCOMPATIBLE and not info.value.kind.corrupted


def test_an_optimizer_without_the_live_groups_is_refused(ck_config: ConfigFactory) -> None:
    cap = _capture(ck_config())
    loaded = _saved(ck_config(), cap)
    opt = loaded.section("optimizer")
    assert isinstance(opt, dict)
    opt["param_groups"] = []
    with pytest.raises(CheckpointFormatError, match="live groups"):
        check_loaded(FULL_1, loaded, None, LiveState.of(cap, sharded=False))


def test_the_memory_budget_refuses_a_candidate_too_large_to_decode(
    ck_config: ConfigFactory,
) -> None:
    loaded = _saved(ck_config(), _capture(ck_config()))
    m = loaded.manifest
    size = sum(t.nbytes for t in m.tensors.values()) + sum(f.nbytes for f in m.files.values())
    check_budget(FULL_1, [(m, list(m.tensors))], size)
    check_budget(FULL_1, [(m, list(m.tensors))], None)
    with pytest.raises(CandidateRejectedError) as info:
        check_budget(FULL_1, [(m, list(m.tensors))], size - 1)
    assert info.value.kind is RejectionKind.TOO_LARGE


def test_memory_budget_is_the_cgroup_limit_when_lower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(preflight, "_CGROUP_MEMORY_MAX", limit)
    limit.write_text("max\n")
    physical = preflight.memory_budget()
    assert physical is not None and physical > 4096
    limit.write_text("4096\n")
    assert preflight.memory_budget() == 4096


def test_the_live_objects_own_failure_is_raised_as_is(ck_config: ConfigFactory) -> None:
    cap = _capture(ck_config())

    def broken() -> dict[str, torch.Tensor]:
        raise RuntimeError("the training script's bug")

    cap.model.state_dict = broken  # type: ignore[assignment,method-assign]
    with pytest.raises(RuntimeError, match="training script's bug"):
        LiveState.of(cap, sharded=False)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (MemoryError(), RejectionKind.TOO_LARGE),
        (IntegrityError("flipped"), RejectionKind.INTEGRITY),
        (NotFoundError("gone"), RejectionKind.MISSING),
        (UnsafePathError("a planted link"), RejectionKind.FORMAT),
        (RetryableStorageError("reset"), RejectionKind.STORAGE),
        (ValueError("garbage"), RejectionKind.FORMAT),
        (CandidateRejectedError("x", RejectionKind.INCOMPATIBLE, "no"), RejectionKind.INCOMPATIBLE),
    ],
)
def test_who_is_at_fault_decides_the_kind(error: Exception, kind: RejectionKind) -> None:
    assert rejection_kind(error) is kind


def test_while_applying_only_our_own_errors_blame_the_candidate() -> None:
    live = as_rejection("c", ValueError("load_state_dict said no"), applying=True)
    assert live.kind is RejectionKind.INCOMPATIBLE and "applying it failed" in live.reason
    ours = as_rejection("c", IntegrityError("a shard flipped"), applying=True)
    assert ours.kind is RejectionKind.INTEGRITY
    before = as_rejection("c", ValueError("garbage"))
    assert before.kind is RejectionKind.FORMAT and "applying" not in before.reason


def test_a_heartbeat_rng_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(CheckpointFormatError, match="not a mapping"):
        check_heartbeat(Heartbeat(step=3, time=0.0, rng=[1, 2, 3]))
    assert check_heartbeat(Heartbeat(step=3, time=0.0)) == (None, None)
