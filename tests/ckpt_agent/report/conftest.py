"""A real small training run (the real Checkpointer, a local storage root) for the report tests.

Run 1 trains 40 steps and takes an emergency save; a byte of that newest
checkpoint's weights is then flipped, so run 2's resume rejects it and takes the
next rung of the recovery ladder; run 2 trains on and closes with a final save.
:func:`make_flash_run` is a run in shared-memory (flash) mode, as injected pods run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_agent.format.layout import blob_key, rank_manifest_key
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer

RUN = "run1"


@dataclass(frozen=True)
class RealRun:
    store: Path
    work: Path
    run_id: str
    rejected: str
    """The checkpoint the second start rejected (its bytes were flipped)."""

    def events(self) -> list[dict[str, Any]]:
        """Rank 0's decision log."""
        path = self.work / "decisions.rank0.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]


def _train(
    cfg: AgentConfig, stop: int, *, save: str | None, final: bool, wait: bool = False
) -> None:
    torch.manual_seed(stop)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(cfg, model=model, optimizer=opt, backpressure="wait" if wait else "defer")
    for s in range(ckpt.start().step, stop):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        ckpt.step(s, loss)
        if wait:  # each snapshot persisted before the next (none coalesced into a newer one)
            assert ckpt.wait(60, validation=False)
    if save:
        ckpt.save_now(save)
    ckpt.close(final_save=final)


def _flip_a_weight_blob(store: Path, run_id: str, ckpt_id: str) -> None:
    manifest = json.loads((store / rank_manifest_key(run_id, ckpt_id, 0)).read_text())
    digest = next(iter(manifest["blobs"]))
    path = store / blob_key(run_id, digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def make_flash_run(
    make_config: Callable[..., AgentConfig], root: Path, run_id: str = "flash1"
) -> RealRun:
    """A run in shared-memory (flash) mode, the way every injected pod runs: the trainer logs
    ``persisted`` (no ``committed``); the persister subprocess logs its persists (with bytes),
    validation verdicts and retention actions to ``sidecar.jsonl``. 40 steps, a final save."""
    work = root / "work" / run_id
    cfg = make_config(root, runId=run_id, workDir=str(work), shmDir=str(root / "shm"))
    # every due save taken and persisted (a loaded machine would defer or coalesce some)
    _train(cfg, 40, save=None, final=True, wait=True)
    return RealRun(root / "store", work, run_id, rejected="")


def make_run(
    make_config: Callable[..., AgentConfig], root: Path, run_id: str = RUN, *, corrupt: bool = True
) -> RealRun:
    """The run described above, in ``root`` (``make_config``: tests/ckpt_agent/conftest.py)."""
    cfg = make_config(root, runId=run_id, workDir=str(root / "work" / run_id))
    # wait: every due save is taken, so the plots have the same checkpoints on a loaded machine
    _train(cfg, 40, save="manual", final=False, wait=True)
    rejected = "full_step_000000000039"
    if corrupt:
        _flip_a_weight_blob(root / "store", run_id, rejected)
    _train(cfg, 70, save=None, final=True, wait=True)
    return RealRun(root / "store", root / "work" / run_id, run_id, rejected)


@pytest.fixture(scope="session")
def rp_run(
    tmp_path_factory: pytest.TempPathFactory, ck_make_config: Callable[..., AgentConfig]
) -> RealRun:
    """One real run, shared by the report tests (read-only)."""
    return make_run(ck_make_config, tmp_path_factory.mktemp("report-run"))


@pytest.fixture(scope="session")
def rp_flash_run(
    tmp_path_factory: pytest.TempPathFactory, ck_make_config: Callable[..., AgentConfig]
) -> RealRun:
    """A real run in shared-memory mode (:func:`make_flash_run`), read-only."""
    return make_flash_run(ck_make_config, tmp_path_factory.mktemp("report-flash"))


@pytest.fixture(scope="session")
def rp_clean_run(
    tmp_path_factory: pytest.TempPathFactory, ck_make_config: Callable[..., AgentConfig]
) -> RealRun:
    """Another real run ("run2"), nothing corrupted (it restarts from its newest checkpoint)."""
    return make_run(ck_make_config, tmp_path_factory.mktemp("report-clean"), "run2", corrupt=False)
