"""The FIT trainer process: the example script's ``main()`` in a process forked from a
"zygote" that already imported torch and the agent (starting one takes ~0.2 s, not the
5-20 s of a fresh interpreter on a loaded 2-core machine, so a 200-trial campaign fits).

``python -m ckpt_e2e.fit.child`` is the zygote: it reads JSON requests on stdin, one per
line (``{"op": "spawn", "argv", "env", "log"}`` -> ``{"pid"}``; ``{"op": "status",
"pid"}`` -> ``{"exitcode"}``, null while running), forks trainers and reaps them; it exits
when its stdin closes, and its trainers die with it (``PR_SET_PDEATHSIG``). Each trainer
is still a separate OS process with its own environment, session and log file, killed
with real signals; only the imports are shared (copy-on-write). Not multiprocessing's
fork server: that one is process-wide (another test may have started it with other
preloads) and, on Python 3.11, ignores the parent's ``sys.path`` when it preloads.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

import numpy  # noqa: F401  (preloaded for the children)
import torch

import ckpt_agent  # noqa: F401  (preloaded for the children)
from ckpt_agent.runtime import checkpointer  # noqa: F401  (preloaded for the children)

from ..training import TRAIN_SCRIPT
from . import faults

_PR_SET_PDEATHSIG = 1


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fit_train_mnist_like", TRAIN_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warm_up() -> None:
    """Trigger torch's lazy imports once here (AdamW's first construction imports
    torch._dynamo: ~10 s on a loaded 2-core machine), not in every forked trainer."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    scaler = torch.amp.GradScaler("cpu")
    loss = model(torch.ones(1, 2)).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


EXAMPLE = _example()
_warm_up()


def run_trainer(argv: Sequence[str], env: Mapping[str, str], log_path: str) -> None:
    """Child body: new session, the given environment, output to ``log_path``, faults, main()."""
    os.setsid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # never read the zygote's requests
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    code = 1
    try:
        faults.install_from_env()
        main: Callable[[list[str]], int] = EXAMPLE.main
        code = int(main(list(argv)))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _reap(exits: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exits[pid] = os.waitstatus_to_exitcode(status)


def serve() -> None:
    """The zygote's loop (see the module doc)."""
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    exits: dict[int, int] = {}
    for line in requests:
        req = json.loads(line)
        _reap(exits)
        if req["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                replies.close()
                try:
                    run_trainer(req["argv"], req["env"], req["log"])
                finally:
                    os._exit(1)
            reply: dict[str, object] = {"pid": pid}
        else:
            reply = {"exitcode": exits.get(int(req["pid"]))}
        replies.write(json.dumps(reply).encode() + b"\n")


if __name__ == "__main__":
    serve()
