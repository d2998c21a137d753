"""Two DCP writers on one run id (#28): the later one fences the first, whose next
``dcp.save`` stops with :class:`FencedError`; nothing the holder committed is lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_agent.errors import FencedError
from ckpt_agent.format.fence import generations
from ckpt_agent.format.layout import commit_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CommitManifest
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.integrations.dcp import DcpReader, DcpWriter, load_latest
from ckpt_agent.policy import AgentConfig
from ckpt_agent.records import CheckpointStatus

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

RUN = "shared"


def _cfg(tmp_path: Path) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "runId": RUN,
            "storageUrl": (tmp_path / "store").as_uri(),
            "validation": {"loadInSubprocess": False},
            "retention": {"routineKeep": 10, "importantKeep": 10},
        }
    )


def _state(step: int, who: float) -> dict[str, Any]:
    return {"w": torch.full((4, 4), who * 1000 + step), "step": step}


def _save(writer: DcpWriter, step: int, who: float) -> None:
    dcp.save(_state(step, who), storage_writer=writer, checkpoint_id=f"step-{step}", no_dist=True)


def _raises_fenced(excinfo: pytest.ExceptionInfo[BaseException]) -> FencedError:
    """DCP may wrap a rank's error (CheckpointException): find the FencedError."""
    err: BaseException | None = excinfo.value
    seen = [err]
    while err is not None and not isinstance(err, FencedError):
        failures = getattr(err, "failures", None)
        nested = list(failures.values()) if isinstance(failures, dict) else []
        if nested:  # DCP keeps (exception, traceback) per rank
            first = nested[0]
            err = first[0] if isinstance(first, tuple) else first
        else:
            err = err.__cause__ or err.__context__
        seen.append(err)
    assert isinstance(err, FencedError), seen
    return err


@pytest.mark.parametrize("same_steps", [True, False])
def test_the_later_writer_fences_the_first_and_nothing_of_it_is_lost(
    tmp_path: Path, same_steps: bool
) -> None:
    zombie, holder = DcpWriter(_cfg(tmp_path)), DcpWriter(_cfg(tmp_path))
    try:
        _save(zombie, 1, 1)
        _save(zombie, 2, 1)
        zombie.wait()
        assert zombie.generation == 1
        # the restarted job resumes and claims the run
        target = _state(0, 0)
        assert load_latest(target, DcpReader(_cfg(tmp_path)), writer=holder) is not None
        assert holder.generation == 2 and generations(holder.storage, RUN) == [1, 2]
        _save(holder, 3, 2)
        _save(holder, 4, 2)
        holder.wait()
        # the zombie wakes and saves: the same step as the holder's, or a later one
        with pytest.raises(BaseException) as excinfo:
            _save(zombie, 4 if same_steps else 7, 1)
        err = _raises_fenced(excinfo)
        assert "generation 2" in str(err) and err.generation == 1
        with pytest.raises(BaseException) as excinfo:  # sticky
            _save(zombie, 8, 1)
        _raises_fenced(excinfo)
        zombie.wait()
        # every checkpoint the holder committed and kept is there, verifies, and is its own
        store = holder.storage
        listed = {r.step: r for r in list_checkpoints(store, RUN, include_heartbeat=False)}
        for cid in holder.committed:
            step = int(cid.rsplit("_", 1)[1])
            assert listed[step].status == CheckpointStatus.VALID, (cid, listed[step])
            raw = store.read(commit_key(RUN, cid))
            assert CommitManifest.from_bytes(raw, cid).meta.generation == 2
            assert verify_hashes(store, RUN, cid).ok
        assert 7 not in listed and 8 not in listed
        target = _state(0, 0)
        assert load_latest(target, DcpReader(_cfg(tmp_path))) == holder.committed[-1]
        assert torch.equal(target["w"], _state(4, 2)["w"])
        assert holder.committed == ["full_step_000000000003", "full_step_000000000004"]
    finally:
        holder.close()
        zombie.close()  # its background work had finished before it was fenced
