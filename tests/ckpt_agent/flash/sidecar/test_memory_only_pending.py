"""The sidecar and memory-only snapshots (memory-tier snapshots and just-in-time saves):
hashes recorded, replicated, never written to storage; a durable save not handled yet goes
first (so the save right before a failure commits). And the trainer's writer never lets a
newer memory-only snapshot overwrite a durable one nobody handled yet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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


def _meta(token: str, kind: str | None) -> dict[str, object]:
    """``kind``: None (durable), ``jit`` or ``memory_only``."""
    meta: dict[str, object] = {"token": token, "lineage": {"epoch": 0, "pins": []}}
    return {**meta, kind: True} if kind else meta


@pytest.mark.parametrize(
    ("kind", "event"), [("jit", "jit_recorded"), ("memory_only", "memory_recorded")]
)
def test_a_pulse_before_a_memory_only_snapshot_is_persisted_first_and_the_other_only_hashed(
    tmp_path: Path, kind: str, event: str
) -> None:
    writer = ShmWriter(tmp_path / "shm", RUN, 0)
    pulse = writer.write(10, Tier.PULSE, _sections(10), meta=_meta("10-pulse-1", None))
    jit = writer.write(12, Tier.PULSE, _sections(12), meta=_meta(f"12-{kind}-0", kind))
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
    assert [e["step"] for e in events if e["event"] == event] == [12]
    assert [e["step"] for e in events if e["event"] == "persisted"] == [10]


@pytest.mark.parametrize("slots", [2, 3])
def test_a_memory_only_snapshot_never_overwrites_a_durable_one_nobody_handled(
    tmp_path: Path, slots: int
) -> None:
    writer = ShmWriter(tmp_path / "shm", RUN, 0, slots=slots)
    try:
        pulse = writer.write(10, Tier.PULSE, _sections(10), meta=_meta("10-pulse-1", None))
        assert pulse is not None
        memory = [
            writer.write(s, Tier.PULSE, _sections(s), meta=_meta(f"{s}-memory-1", "memory_only"))
            for s in (11, 12, 13)
        ]
        if slots == 2:  # the pulse and the newest memory snapshot are kept: busy
            assert memory[0] is not None and memory[1] is None and writer.busy
        else:  # the memory snapshots take turns in the other two slots
            assert all(d is not None for d in memory)
            assert {d.slot for d in memory if d is not None} == {0, 1, 2} - {pulse.slot}
        complete = {d.seq: d.step for d in writer.complete()}
        assert complete[pulse.seq] == 10  # still there, whole
    finally:
        writer.close()
