"""The sidecar and just-in-time snapshots: hashes recorded, never written to storage; a
durable save not handled yet goes first (so the save right before a failure commits)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.runtime.shm.writer import ShmWriter
from ckpt_agent.storage.fs import LocalStorage

RUN = "jit-side"


def _config(tmp_path: Path) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "runId": RUN,
            "storageUrl": (tmp_path / "store").as_uri(),
            "shmDir": str(tmp_path / "shm"),
            "workDir": str(tmp_path / "work"),
            "agent": {"sidecar": True},
            "validation": {"loadInSubprocess": False},
        }
    )


def _sections(step: int) -> dict[str, object]:
    return {
        "progress": {"step": step, "world_size": 1, "rank": 0},
        "model": {"w": torch.full((64,), float(step))},
    }


def _meta(token: str, jit: bool) -> dict[str, object]:
    meta: dict[str, object] = {"token": token, "lineage": {"epoch": 0, "pins": []}}
    return {**meta, "jit": True} if jit else meta


def test_a_pulse_before_a_jit_snapshot_is_persisted_first_and_the_jit_one_only_hashed(
    tmp_path: Path,
) -> None:
    writer = ShmWriter(tmp_path / "shm", RUN, 0)
    pulse = writer.write(10, Tier.PULSE, _sections(10), meta=_meta("10-pulse-1", False))
    jit = writer.write(12, Tier.PULSE, _sections(12), meta=_meta("12-jit-0", True))
    assert pulse is not None and jit is not None
    writer.close()  # the trainer is gone
    sidecar = Sidecar(_config(tmp_path), SidecarOptions(metrics_port=0, poll_s=0.01))
    try:
        sidecar.areas.discover()
        assert [d.seq for _, d in sidecar.pending()] == [pulse.seq]  # the durable one first
        assert sidecar.run_once() == 1
        assert [d.seq for _, d in sidecar.pending()] == [jit.seq]
        assert sidecar.run_once() == 1
        assert sidecar.pending() == []
    finally:
        sidecar.close()
    steps = [r.step for r in list_checkpoints(LocalStorage(tmp_path / "store"), RUN)]
    assert steps == [10]  # the JIT snapshot never reaches storage
    reader = ShmReader(tmp_path / "shm", RUN, 0)
    assert reader.hashes(jit.slot, jit.seq) is not None  # ... but can be restored in place
    mark = reader.persisted()
    assert mark is not None and (mark.seq, mark.ok, mark.committed) == (jit.seq, True, False)
    events = [json.loads(x) for x in (tmp_path / "work" / "sidecar.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "jit_recorded"] == [12]
