"""The operator's resume pin through the DCP reader (one process): ``CKPT_RESUME_FROM`` is
applied once, exactly, and retires the branch it abandons; an in-place restart of the
pinned job continues the pin's lineage instead of rewinding again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.integrations.dcp import DcpReader, DcpWriter, load_latest
from ckpt_agent.policy import AgentConfig
from ckpt_agent.records import CheckpointStatus

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _cfg(tmp_path: Path, **over: Any) -> AgentConfig:
    data: dict[str, Any] = {
        "runId": "pinned",
        "storageUrl": (tmp_path / "store").as_uri(),
        "validation": {"loadInSubprocess": False},
        "retention": {"routineKeep": 10, "importantKeep": 10},
    }
    data.update(over)
    return AgentConfig.model_validate(data)


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4, 4), float(step)), "step": step}


def _save(writer: DcpWriter, step: int) -> None:
    dcp.save(_state(step), storage_writer=writer, checkpoint_id=f"step-{step}", no_dist=True)


def test_resume_pin_applied_once_then_its_lineage_continues(tmp_path: Path) -> None:
    with DcpWriter(_cfg(tmp_path)) as w:
        for s in (1, 2, 3):
            _save(w, s)
    pinned = _cfg(tmp_path, resumeFrom="full_step_000000000002")

    target = _state(0)
    w2 = DcpWriter(pinned)
    assert load_latest(target, DcpReader(pinned), writer=w2) == "full_step_000000000002"
    assert target["step"] == 2 and torch.equal(target["w"], _state(2)["w"])
    status = {r.step: r.status for r in list_checkpoints(w2.storage, "pinned")}
    assert status[3] == CheckpointStatus.EXPIRED  # the abandoned branch
    _save(w2, 3)  # the new lineage's step 3 (allowed: the old one is expired)
    w2.close()

    target = _state(0)  # an in-place restart with the same CKPT_RESUME_FROM
    assert load_latest(target, DcpReader(pinned)) == "full_step_000000000003"
    assert target["step"] == 3
    records = {r.step: r for r in list_checkpoints(w2.storage, "pinned")}
    assert records[3].status == CheckpointStatus.VALID
    assert records[3].lineage.epoch == 1
    assert records[3].lineage.pins == ("CKPT_RESUME_FROM:full_step_000000000002",)
