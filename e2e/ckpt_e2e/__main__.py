"""Command line: ``python -m ckpt_e2e {up,build,paths}`` (with ``e2e/`` on PYTHONPATH).

* ``up``: start a LocalCluster, print the ``export KUBECONFIG=...`` line, stay up until
  Ctrl-C (or SIGTERM), then tear down. ``--trainer-v2`` adds the JobSet and Kubeflow
  Trainer v2 controllers, their CRDs and the torch runtime (``ckpt_e2e.trainer_v2``).
  With ``--detach``: print the exports and return, leaving the cluster running; stop it
  later with ``down``.
* ``down WORKDIR [--keep]``: stop a detached cluster (its processes are listed in
  ``WORKDIR/pids``) and remove the workdir.
* ``build [NAME ...]``: run ``e2e/build-tools.sh`` (all tool modules by default).
* ``paths``: print where each binary is (building what is missing).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from pathlib import Path

from . import tools
from .cluster import LocalCluster
from .errors import ClusterError
from .procs import stop_workdir
from .trainer_v2 import TrainerV2


def _up(args: argparse.Namespace) -> int:
    cluster = LocalCluster(
        args.workdir,
        scheduler=not args.no_scheduler,
        training_operator=not args.no_training_operator,
        nodes=args.nodes,
        verbosity=args.v,
        startup_timeout=args.timeout,
        keep_workdir=args.keep,
        persistent=args.detach,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        if args.trainer_v2:
            cluster.timings["trainer-v2"] = TrainerV2(cluster).start().timings["total"]
    except (ClusterError, tools.ToolError, TimeoutError) as e:
        cluster.mark_failed()  # keep the logs
        cluster.stop()
        print(f"cluster failed to start:\n{e}", file=sys.stderr)
        return 1
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in cluster.timings.items())
    print(f"# local cluster up ({timings}); workdir {cluster.workdir}", file=sys.stderr)
    print(f"# logs: {cluster.log_dir}; Ctrl-C to stop", file=sys.stderr)
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    print(f"export PATH={cluster.bin['kubectl'].parent}:$PATH")
    sys.stdout.flush()
    if args.detach:
        print(f"# stop with: python -m ckpt_e2e down {cluster.workdir}", file=sys.stderr)
        cluster.release()
        return 0
    rc = 0
    try:
        while not stop.wait(2.0):
            try:
                cluster.check_alive()
            except ClusterError as e:
                print(str(e), file=sys.stderr)
                cluster.mark_failed()
                rc = 1
                break
    finally:
        cluster.stop()
    return rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpt_e2e", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a local cluster and keep it up until Ctrl-C")
    up.add_argument("--workdir", type=Path, default=None, help="state folder (default: temp)")
    up.add_argument("--keep", action="store_true", help="keep the workdir after stopping")
    up.add_argument("--nodes", type=int, default=1, help="number of kwok nodes")
    up.add_argument("--no-scheduler", action="store_true")
    up.add_argument("--no-training-operator", action="store_true")
    up.add_argument(
        "--trainer-v2", action="store_true", help="also run JobSet + Kubeflow Trainer v2"
    )
    up.add_argument("--timeout", type=float, default=180.0, help="readiness timeout per component")
    up.add_argument("-v", type=int, default=1, help="klog verbosity of the components")
    up.add_argument("--detach", action="store_true", help="leave it running and return")
    down = sub.add_parser("down", help="stop a cluster started with 'up --detach'")
    down.add_argument("workdir", type=Path)
    down.add_argument("--keep", action="store_true", help="keep the workdir (logs)")
    b = sub.add_parser("build", help="build (or reuse) the pinned Go tools")
    all_tools = ", ".join(sorted(set(tools.BINARIES.values())))
    b.add_argument(
        "names",
        nargs="*",
        help=f"tool modules (default: all, e.g. {all_tools})",
    )
    sub.add_parser("paths", help="print the path of each binary")
    args = p.parse_args(argv)
    if args.cmd == "up":
        return _up(args)
    if args.cmd == "down":
        for what in stop_workdir(args.workdir):
            print(f"stopped {what}")
        # only ever delete a folder that looks like a harness workdir
        if not args.keep and (args.workdir / "pki" / "ca.crt").exists():
            shutil.rmtree(args.workdir, ignore_errors=True)
        return 0
    if args.cmd == "build":
        try:
            tools.build(args.names or None)
        except tools.ToolError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    for name in tools.BINARIES:
        print(f"{name}\t{tools.binary(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
