#!/usr/bin/env python
"""Recovery from a peer's replica against recovery from storage (#31; not a timed test).

A rank's node is lost and its pod recreated on another node (docs/replicas.md,
"Recovering a lost node's rank"). On one run and the same state (an MLP whose weights +
AdamW moments total ``--size-mb``):

* **node a** trains with flash checkpoints and its sidecar (in this process), which
  persists a pulse to storage and pushes it to **node b**: a replica server in a child
  process of its own, so that its **peak RSS** while it receives is the peer's memory
  cost (``VmHWM`` above its baseline, against the snapshot's size);
* **node c**, each restore in a fresh child process (page cache warm), rounds
  interleaved: ``Checkpointer(...)`` + ``start()`` with node c's sidecar, either
  replicating with node b (the rank's snapshot comes from the peer's replica, over
  loopback TCP, every chunk verified, then the in-place restart's checks) or not
  replicating (the same code path; the state comes from storage: local disk, and with
  ``--minio`` a real MinIO built from ``e2e/tools/minio``). It reports the seconds of
  ``start()``, the resume action and the child's peak RSS above its baseline (the fresh
  model and optimizer).

The nodes' shared-memory areas and node b's replicas live in ``--memory-dir`` (default: a
new folder in ``/dev/shm``, a tmpfs like the pod's emptyDir of medium Memory); storage,
MinIO's data and the work folders in a temporary folder on disk.

    python benchmarks/bench_replica.py --size-mb 256 --repeat 3 [--minio] [--write-doc docs/performance.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _common import MIB, machine, median, mlp_layers, state_bytes, write_marked
from torch import nn

from ckpt_agent.flash.replica.replicator import ReplicaOptions
from ckpt_agent.flash.sidecar import Sidecar, SidecarOptions
from ckpt_agent.policy import AgentConfig
from ckpt_agent.runtime.checkpointer import Checkpointer

RUN = "bench-replica"
SECRET = "0123456789abcdef0123456789abcdef"
MARKER = "<!-- bench_replica results -->"
REPO = Path(__file__).resolve().parent.parent


def build(size_mb: float, hidden: int = 1024) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [nn.Linear(hidden, hidden) for _ in range(mlp_layers(size_mb, hidden))]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def train_step(model: nn.Module, opt: torch.optim.Optimizer, hidden: int = 1024) -> float:
    x = torch.randn(4, hidden)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.item())


def config(root: Path, mem: Path, node: str, storage: dict[str, Any]) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "runId": RUN,
            "shmDir": str(mem / f"shm-{node}"),
            "workDir": str(root / f"work-{node}"),
            "agent": {"sidecar": True},
            "tiers": {
                "heartbeat": {"enabled": False},
                "pulse": {"baseInterval": 1, "minInterval": 1, "maxInterval": 1},
                "full": {"everySteps": 100000},
            },
            "scheduler": {"risk": {"enabled": False}},
            "validation": {"loadInSubprocess": False},
            **storage,
        }
    )


@contextlib.contextmanager
def sidecar(
    root: Path, mem: Path, node: str, storage: dict[str, Any], peer: str | None
) -> Iterator[Sidecar]:
    """Node ``node``'s sidecar in a thread; replicating with ``peer`` (None: not)."""
    secret = root / "secret"
    secret.write_text(SECRET)
    replicas = None
    if peer is not None:
        replicas = ReplicaOptions(
            node=f"node-{node}", namespace="bench", job_id="job", secret_file=str(secret),
            peers=(peer,), timeout_s=120.0,
        )  # fmt: skip
    sc = Sidecar(
        config(root, mem, node, storage),
        SidecarOptions(metrics_port=0, poll_s=0.01, replicas=replicas),
    )
    stop = threading.Event()
    thread = threading.Thread(target=sc.run, kwargs={"until": stop.is_set}, daemon=True)
    thread.start()
    try:
        yield sc
    finally:
        stop.set()
        thread.join(60)
        sc.close()


# --------------------------------------------------------------------------- node b


def serve(store_dir: str) -> int:
    """Node b: a replica server until stdin closes; prints its port, then its peak RSS."""
    from ckpt_agent.flash.replica.auth import JobScope
    from ckpt_agent.flash.replica.marks import MarkStore
    from ckpt_agent.flash.replica.server import ReplicaServer
    from ckpt_agent.flash.replica.store import ReplicaStore

    base = _rss_kib("VmRSS")
    server = ReplicaServer(
        ReplicaStore(store_dir, RUN),
        JobScope("bench", "job", SECRET.encode()),
        host="127.0.0.1",
        timeout_s=120.0,
        marks=MarkStore(store_dir, RUN),
    ).start()  # fmt: skip  (marks: a rehydration also asks for the rank's step heartbeat)
    print(json.dumps({"port": server.address[1]}), flush=True)
    sys.stdin.read()
    server.close()
    print(json.dumps({"peak_rss_above_base_mib": (_rss_kib("VmHWM") - base) / 1024}), flush=True)
    return 0


def start_node_b(mem: Path) -> tuple[subprocess.Popen[str], str]:
    """Node b's server in a child process over ``mem/shm-b``; (process, host:port)."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(mem / "shm-b")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, f"127.0.0.1:{json.loads(proc.stdout.readline())['port']}"


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# --------------------------------------------------------------------------- node c


def restore(args: argparse.Namespace) -> dict[str, Any]:
    """One restore on a fresh node c (a child process): the seconds of start()."""
    root, mem, storage = Path(args.root), Path(args.mem), json.loads(args.storage)
    model, opt = build(args.size_mb)
    Path("/proc/self/clear_refs").write_text("5\n")  # VmHWM from here: the restore's own
    base = _rss_kib("VmRSS")
    node = f"c{os.getpid()}"
    with sidecar(root, mem, node, storage, args.peer):
        t0 = time.perf_counter()
        ckpt = Checkpointer(config(root, mem, node, storage), model=model, optimizer=opt)
        resume = ckpt.start()
        seconds = time.perf_counter() - t0
        peak = (_rss_kib("VmHWM") - base) / 1024
        ckpt.close()
    shutil.rmtree(mem / f"shm-{node}", ignore_errors=True)
    shutil.rmtree(root / f"work-{node}", ignore_errors=True)
    return {"seconds": seconds, "action": resume.action, "step": resume.step, "peak_mib": peak}


# --------------------------------------------------------------------------- the run


def minio_storage(workdir: Path) -> tuple[Any, dict[str, Any], dict[str, str]]:
    sys.path.insert(0, str(REPO / "e2e"))
    from ckpt_e2e import s3servers

    print("building/locating MinIO (e2e/build-tools.sh --path minio) ...", file=sys.stderr)
    server = s3servers.start_minio(s3servers.build_tool("minio"), workdir)
    server.client().create_bucket(Bucket="bench")
    env = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
    storage = {
        "storageUrl": "s3://bench/replica",
        "s3": {"endpoint": server.endpoint, "pathStyle": True},
    }
    return server, storage, env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=256.0, help="weights + AdamW moments, MiB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--minio", action="store_true", help="also restore from a real MinIO")
    p.add_argument("--write-doc", help="put the results table into this doc (between markers)")
    p.add_argument(
        "--memory-dir",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="where the nodes' shared memory lives (a tmpfs; default /dev/shm, else on disk)",
    )
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--mem", help=argparse.SUPPRESS)
    p.add_argument("--storage", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.child:
        print(json.dumps(restore(args)))
        return 0
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-replica-"))
    mem = Path(tempfile.mkdtemp(prefix="bench-replica-", dir=args.memory_dir))
    minio = None
    try:
        storages = {"local disk": {"storageUrl": (root / "store").as_uri()}}
        env = dict(os.environ)
        if args.minio:
            minio, s3, s3_env = minio_storage(root / "minio")
            storages["MinIO"] = s3
            env.update(s3_env)
            os.environ.update(s3_env)
        node_b, peer = start_node_b(mem)
        model, opt = build(args.size_mb)
        for name, storage in storages.items():  # node a: two pulses in each storage
            pushing = peer if name == "local disk" else None  # and to node b, once
            with sidecar(root, mem, "a", storage, pushing) as sc:
                ckpt = Checkpointer(config(root, mem, "a", storage), model=model, optimizer=opt)
                ckpt.start()
                for step in range(2):
                    ckpt.step(step, train_step(model, opt))
                ckpt.wait()
                rep = sc.replicator
                deadline = time.monotonic() + 600
                while rep is not None and not (rep.idle() and rep.pushed >= 1):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"node a's pushes did not finish: {rep.summary()}")
                    time.sleep(0.05)
                ckpt.close()
            shutil.rmtree(mem / "shm-a")  # node a is lost
        size = state_bytes(model, opt)  # AdamW's moments exist once it stepped
        assert node_b.stdin is not None and node_b.stdout is not None
        node_b.stdin.close()
        peer_peak = json.loads(node_b.stdout.readline())["peak_rss_above_base_mib"]
        node_b.wait(60)
        # node b is gone too now: restart it over the same store, serving what it holds
        node_b, peer = start_node_b(mem)
        kinds = [(f"storage ({name})", storage, None) for name, storage in storages.items()]
        kinds.append(("peer's replica", storages["local disk"], peer))
        results: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.repeat):
            for label, storage, via in kinds:
                cmd = [sys.executable, __file__, "--child", "--root", str(root), "--mem", str(mem)]
                cmd += ["--size-mb", str(args.size_mb), "--storage", json.dumps(storage)]
                cmd += ["--peer", via] if via else []
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if out.returncode != 0:
                    raise SystemExit(f"{label}: {out.stderr.strip()[-2000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault(label, []).append(r)
                print(f"  {label}: {json.dumps(r)}", file=sys.stderr, flush=True)
        assert node_b.stdin is not None
        node_b.stdin.close()
        node_b.wait(60)
    finally:
        if minio is not None:
            minio.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    base = median([r["seconds"] for r in results[kinds[0][0]]])
    lines = [
        f"# {machine()}, state {size / MIB:.0f} MiB, median of {args.repeat} restores each "
        f"(fresh process, page cache warm), shared memory in {args.memory_dir or 'the temp dir'}",
        "",
        "| node c resumes from | start() s | vs storage (local disk) | resume action "
        "| peak RSS above baseline, MiB |",
        "|---|---:|---:|---|---:|",
    ]
    for label, _, _ in kinds:
        rs = results[label]
        s = median([r["seconds"] for r in rs])
        lines.append(
            f"| {label} | {s:.2f} | {s / base:.2f}x | {rs[-1]['action']} "
            f"| {median([r['peak_mib'] for r in rs]):.0f} |"
        )
    if "storage (MinIO)" in results:
        ratio = median([r["seconds"] for r in results["peer's replica"]]) / median(
            [r["seconds"] for r in results["storage (MinIO)"]]
        )
        lines += ["", f"From the peer's replica: {ratio:.2f}x the time from MinIO (#31: <= 0.5x)."]
    lines += [
        "",
        f"Node b (the peer) peak RSS above its baseline while it received node a's pushes "
        f"of a {size / MIB:.0f} MiB snapshot: {peer_peak:.0f} MiB.",
    ]
    print("\n".join(lines))
    if args.write_doc:
        write_marked(Path(args.write_doc), MARKER, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
