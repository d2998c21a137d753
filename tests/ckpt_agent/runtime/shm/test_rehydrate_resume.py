"""A rank whose node is lost resumes on another node from a peer's replica, bitwise (#31).

Node a: a trainer with flash checkpoints and its sidecar, which persists the snapshots and
pushes each to node b (a peer's replica server). Node a is then lost (its shared memory
gone) before its last pulse reached storage, which holds nothing newer than step 5. The rank is recreated on node c, whose sidecar replicates with b: the trainer's
``start()`` asks it for the rank's snapshot, the sidecar fetches the replica from b and
installs it, and the in-place restart restores it. Training goes on to the end and the
weights and optimizer state are ``torch.equal`` to an uninterrupted run's.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckpt_agent import tuning
from ckpt_agent.flash.replica.auth import JobScope
from ckpt_agent.flash.replica.rehydrate import REQUEST, advertise
from ckpt_agent.flash.replica.replicator import ReplicaOptions
from ckpt_agent.flash.replica.server import ReplicaServer
from ckpt_agent.flash.replica.store import ReplicaStore
from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer
from ckpt_agent.runtime.shm.target import FlashTarget
from ckpt_agent.storage.fs import LocalStorage
from ckpt_e2e.local_flash import same_state, sidecar_thread

pytestmark = pytest.mark.timeout(180)

RUN = "rehydrate-1"
SECRET = b"0123456789abcdef0123456789abcdef"
STEPS, LOST_AFTER = 20, 12


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def _config(tmp_path: Path, node: str) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "runId": RUN,
            "storageUrl": (tmp_path / "store").as_uri(),
            "shmDir": str(tmp_path / f"shm-{node}"),
            "workDir": str(tmp_path / f"work-{node}"),
            "agent": {"sidecar": True},
            "tiers": {
                "heartbeat": {"everySteps": 1000},
                "pulse": {"baseInterval": 5, "minInterval": 5, "maxInterval": 5},
                "full": {"everySteps": 1000},
            },
            "scheduler": {"risk": {"enabled": False}},
            "validation": {"loadInSubprocess": False},
        }
    )


@contextmanager
def _sidecar(tmp_path: Path, node: str, peer: str) -> Iterator[Sidecar]:
    """The node's sidecar, replicating with ``peer``, running its loop in a thread."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    options = ReplicaOptions(
        node=f"node-{node}", namespace="team-a", job_id="job-1", secret_file=str(secret),
        peers=(peer,), timeout_s=10.0,
    )  # fmt: skip
    opts = SidecarOptions(metrics_port=0, poll_s=0.01, replicas=options)
    with sidecar_thread(_config(tmp_path, node), opts) as sidecar:
        yield sidecar


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def test_a_rank_recreated_on_another_node_resumes_from_a_peers_replica_bitwise(
    tmp_path: Path,
) -> None:
    ref_model, ref_opt = _model()
    for step in range(STEPS):
        _step(ref_model, ref_opt, step)

    store_b = ReplicaStore(tmp_path / "shm-b", RUN)
    server_b = ReplicaServer(
        store_b, JobScope("team-a", "job-1", SECRET), host="127.0.0.1", timeout_s=10.0
    ).start()
    peer_b = "{}:{}".format(*server_b.address)
    try:
        # node a: train, every pulse persisted and pushed to node b
        model, opt = _model()
        with _sidecar(tmp_path, "a", peer_b) as sidecar_a:
            ckpt = Checkpointer(_config(tmp_path, "a"), model=model, optimizer=opt,
                                storage=None, preallocate=False)  # fmt: skip
            assert ckpt.start().step == 0
            for step in range(LOST_AFTER):
                ckpt.step(step, _step(model, opt, step))
            ckpt.wait()
            replicator = sidecar_a.replicator
            assert replicator is not None
            deadline = time.monotonic() + 60

            def pushed_newest() -> bool:  # under load the sidecar may skip step 5's pulse
                return any(r.desc.step == 10 for r in store_b.replicas())

            while not (replicator.idle() and pushed_newest()):
                assert time.monotonic() < deadline, replicator.summary()
                time.sleep(0.02)
            ckpt.close()
        (held,) = store_b.replicas()
        assert held.source == "node-a" and held.desc.step == 10  # the newest pulse
        shutil.rmtree(tmp_path / "shm-a")  # node a is lost, with its shared memory ...
        # ... before its last pulse reached storage (step 5's, if kept, is the newest there)
        store = LocalStorage(tmp_path / "store")
        pulses = list_checkpoints(store, RUN, include_heartbeat=False)
        (last,) = [r for r in pulses if r.step == 10]
        shutil.rmtree(tmp_path / "store" / RUN / "steps" / last.id)
        assert all(r.step <= 5 for r in list_checkpoints(store, RUN, include_heartbeat=False))

        # node c: the rank is recreated there; its sidecar gets the replica from node b
        model, opt = _model()
        with _sidecar(tmp_path, "c", peer_b):
            ckpt = Checkpointer(_config(tmp_path, "c"), model=model, optimizer=opt,
                                storage=None, preallocate=False)  # fmt: skip
            resume = ckpt.start()
            assert (resume.step, resume.action, resume.exact) == (11, "resume_shm", True)
            assert "shared memory" in resume.reason
            for step in range(resume.step, STEPS):
                ckpt.step(step, _step(model, opt, step))
            ckpt.close()
    finally:
        server_b.close()
    assert same_state(_state(model, opt), _state(ref_model, ref_opt))
    lines = (tmp_path / "work-c" / "decisions.rank0.jsonl").read_text().splitlines()
    (asked,) = [e for e in map(json.loads, lines) if e["event"] == "rehydrate"]
    assert (asked["found"], asked["step"], asked["source"]) == (True, 10, "node-a")
    assert f"from peer {peer_b}" in asked["why"]


def test_no_sidecar_that_answers_means_no_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar of an older version never answers: without its advertisement the trainer
    does not ask; one that advertised but does not take the area is not waited for."""
    monkeypatch.setattr(tuning, "REHYDRATE_CLAIM_S", 0.2)
    target = FlashTarget(_config(tmp_path, "c"), 0, 1, work_dir=tmp_path / "work-c")
    t0 = time.monotonic()
    assert target.rehydrate() is None
    assert not (target.reader.dir / REQUEST).exists()  # never asked
    advertise(tmp_path / "shm-c", RUN)
    assert target.rehydrate() is None  # asked; nobody took the area
    assert (target.reader.dir / REQUEST).exists()
    assert time.monotonic() - t0 < 5
