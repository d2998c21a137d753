"""A real small training run (the real Checkpointer, a local storage root) for the report tests.

Run 1 trains 40 steps and takes an emergency save; a byte of that newest
checkpoint's weights is then flipped, so run 2's resume rejects it and takes the
next rung of the recovery ladder; run 2 trains on and closes with a final save.
:func:`make_flash_run` is a run in shared-memory (flash) mode, as injected pods run;
:func:`make_preempted_run` one that a node drain and then a Kueue preemption interrupt.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_agent.format.layout import blob_key, rank_manifest_key
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_operator.planners.disruption_signals import preemption_disruption
from ckpt_operator.planners.workload import Eviction

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
    cfg: AgentConfig,
    stop: int,
    *,
    save: str | None,
    final: bool,
    wait: bool = False,
    before_step: Mapping[int, Callable[[], None]] | None = None,
    sigterm: bool = False,
) -> None:
    """Train to ``stop``; ``before_step[s]()`` runs after step ``s`` trained, before
    ``ckpt.step(s)``; ``sigterm``: the agent's SIGTERM handler, the loop going on after it."""
    torch.manual_seed(stop)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.ReLU(), torch.nn.Linear(300, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(
        cfg,
        model=model,
        optimizer=opt,
        backpressure="wait" if wait else "defer",
        handle_sigterm=sigterm,
        exit_on_sigterm=False,
    )
    for s in range(ckpt.start().step, stop):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        if before_step and s in before_step:
            before_step[s]()
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


#: The save-now request of the node drain in :func:`make_preempted_run` (a pod evicted
#: through the eviction API: the operator's ``DisruptionTarget`` reason), not a preemption.
DRAIN_REQUEST = "EvictionByEvictionAPI-aaaaaaaaaaaa"
#: Steps of :func:`make_preempted_run`: the drain's save-now, the Kueue eviction's, SIGTERM,
#: the last step the evicted pod trained, the last step of the resumed run.
DRAIN_AT, PREEMPT_AT, SIGTERM_AT, EVICTED_LAST, RESUMED_LAST = 10, 30, 33, 36, 44


def _signal(path: Path, content: str) -> None:
    """Write the save-now signal file as the downward API does (a new mtime: a change)."""
    path.write_text(content)
    later = time.time_ns() + 10**9
    os.utime(path, ns=(later, later))


def make_preempted_run(
    make_config: Callable[..., AgentConfig], root: Path, request: str, run_id: str = "pre1"
) -> RealRun:
    """A run that a node drain and a Kueue preemption interrupt, then resumed.

    The drain's save-now (:data:`DRAIN_REQUEST`) comes after step :data:`DRAIN_AT`; the
    operator's preemption signal ``request`` after step :data:`PREEMPT_AT` (the emergency
    full save of that step), SIGTERM after :data:`SIGTERM_AT` (saved too); the pod trains
    on to :data:`EVICTED_LAST` within its grace (nothing saved: no heartbeat, a pulse
    every 100 steps), ends; the re-admitted run resumes from step :data:`SIGTERM_AT`'s
    checkpoint and trains to :data:`RESUMED_LAST`: 3 steps lost. Needs the main thread
    (a SIGTERM handler)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the SIGTERM of a preemption needs the main thread")
    work = root / "work" / run_id
    sig = root / "save-now"
    sig.write_text("")
    cfg = make_config(
        root,
        runId=run_id,
        workDir=str(work),
        signalFile=str(sig),
        tiers={
            "heartbeat": {"enabled": False},
            "pulse": {"baseInterval": 100, "minInterval": 50, "maxInterval": 500},
        },
        retention={"routineKeep": 10, "importantKeep": 10},  # the drain's save stays stored
    )
    hooks = {
        DRAIN_AT: lambda: _signal(sig, DRAIN_REQUEST),
        PREEMPT_AT: lambda: _signal(sig, request),
        SIGTERM_AT: lambda: os.kill(os.getpid(), signal.SIGTERM),
    }
    _train(
        cfg, EVICTED_LAST + 1, save=None, final=False, wait=True, before_step=hooks, sigterm=True
    )
    _train(cfg, RESUMED_LAST + 1, save=None, final=True, wait=True)
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
def rp_preempted_run(
    tmp_path_factory: pytest.TempPathFactory, ck_make_config: Callable[..., AgentConfig]
) -> RealRun:
    """A real run a drain and a Kueue preemption interrupt (:func:`make_preempted_run`),
    with the operator's request id of a preemption; read-only."""
    eviction = Eviction("Preempted", "Preempted to accommodate a workload", "t0", "uid-1")
    request = preemption_disruption(eviction).signal
    return make_preempted_run(ck_make_config, tmp_path_factory.mktemp("report-preempt"), request)


@pytest.fixture(scope="session")
def rp_clean_run(
    tmp_path_factory: pytest.TempPathFactory, ck_make_config: Callable[..., AgentConfig]
) -> RealRun:
    """Another real run ("run2"), nothing corrupted (it restarts from its newest checkpoint)."""
    return make_run(ck_make_config, tmp_path_factory.mktemp("report-clean"), "run2", corrupt=False)
