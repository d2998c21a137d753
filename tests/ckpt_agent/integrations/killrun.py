"""Run a framework trainer to the end through SIGKILLs at seeded random points, and compare.

A plan is a list of kill points: ``step`` (SIGKILL once a step past the last seen one
finished), ``save`` (during a save: every COMMIT is held 1.5 s and the kill lands in
that window) and ``commit`` (right after a COMMIT was written). Every rank of the
job is killed at once, as when a pod of a job fails and the operator restarts the job.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fw_harness import Child, Zygote, wait_for

from ckpt_e2e.api import free_port

TIMEOUT_S = 120.0


@dataclass
class Run:
    zygote: Zygote
    fn: str
    root: Path
    config: Path
    steps: int
    world: int = 1
    launches: int = 0
    log: list[str] = field(default_factory=list)

    @property
    def out(self) -> Path:
        return self.root / "out"

    def progress(self) -> list[int]:
        p = self.out / "progress.rank0"
        return [int(x.split()[0]) for x in p.read_text().splitlines()] if p.exists() else []

    def launch(self, **extra_env: str) -> list[Child]:
        self.launches += 1
        port = free_port()
        children = []
        for rank in range(self.world):
            env = {
                "CKPT_CONFIG": str(self.config),
                "STORE_DIR": str(self.root / "store"),
                **extra_env,
            }
            if self.world == 1:
                children.append(
                    self.zygote.start(
                        self.fn, self.out, str(self.out), self.steps, self.world, env=env
                    )
                )
                break
            env |= {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.world),
                "LOCAL_WORLD_SIZE": str(self.world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "kill-test",  # Lightning: ranks started outside (torchrun)
            }
            children.append(
                self.zygote.start(self.fn, self.out, str(self.out), self.steps, self.world, env=env)
            )
        return children

    def finish(self, children: list[Child]) -> None:
        codes = [c.wait(TIMEOUT_S) for c in children]
        if any(code != 0 for code in codes):
            for c in children:
                c.kill()
            errors = "\n".join(c.error() for c in children)
            raise AssertionError(f"{self.fn}: exit codes {codes}\n{errors}\n{self.log}")

    def to_end(self) -> dict[str, Any]:
        self.finish(self.launch())
        return torch.load(self.out / "final.pt", weights_only=True)

    def kill_at(self, kind: str, rng: random.Random) -> None:
        seen = self.progress()
        last = max(seen) if seen else 0
        env: dict[str, str] = {}
        commits = self.out / "commits"
        n_commits = len(commits.read_text().splitlines()) if commits.exists() else 0
        if kind == "save":
            env["COMMIT_DELAY_S"] = "1.5"
            (self.out / "committing").unlink(missing_ok=True)
        children = self.launch(**env)
        if kind == "step":
            target = min(last + rng.randint(1, 5), self.steps - 1)

            def cond() -> bool:
                done = self.progress()[len(seen) :]
                return bool(done) and max(done) >= target

            what = f"step {target}"
        elif kind == "save":
            cond = (self.out / "committing").exists
            what = "during a save"
        else:

            def cond() -> bool:
                return commits.exists() and len(commits.read_text().splitlines()) > n_commits

            what = "right after a commit"
        fired = wait_for(cond, TIMEOUT_S, children)
        for c in children:
            c.kill()
        done = self.progress()[len(seen) :]
        self.log.append(
            f"launch {self.launches}: SIGKILL {what} (ran steps {done[:1]}..{done[-1:]})"
        )
        if not fired:
            errors = "\n".join(c.error() for c in children)
            raise AssertionError(f"kill point {what} never came: {self.log}\n{errors}")


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Weights and optimizer state bitwise equal; the counters equal."""
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), f"weight {k} differs"
    go, wo = got["optimizer"], want["optimizer"]
    assert go["param_groups"] == wo["param_groups"]
    assert go["state"].keys() == wo["state"].keys()
    for pid, st in wo["state"].items():
        for k, v in st.items():
            g = go["state"][pid][k]
            assert torch.equal(g, v) if isinstance(v, torch.Tensor) else g == v, (pid, k)
    for k, value in want.items():
        if k not in ("model", "optimizer"):
            assert got[k] == value, k


def killed_run(run: Run, plan: list[str], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    print(f"{run.fn}: kill plan {plan} (seed {seed})")
    t0 = time.monotonic()
    for kind in plan:
        run.kill_at(kind, rng)
    final = run.to_end()
    print("\n".join(run.log), f"\n{run.launches} launches in {time.monotonic() - t0:.1f} s")
    return final
