"""A process that imports torch, transformers and Lightning once and forks trainers on request.

These tests start a trainer a dozen times (a SIGKILL, a restart...); importing
transformers or Lightning costs 6-8 s of CPU each time on these machines, so the
imports are paid once here and each trainer is an ``os.fork()`` of this process.

Protocol (one JSON object a line on stdin): ``{"fn": name, "args": [...], "env": {...},
"out": dir}``; the zygote answers the child's pid on stdout. The child runs
``fw_workers.<fn>(*args)`` with ``env`` added, writes its exit code to
``<out>/exit.<pid>`` (a SIGKILLed child writes none) and its traceback to
``<out>/error.<pid>.txt``. Children are reaped here (SIGCHLD ignored), so a dead
child's pid no longer answers ``os.kill(pid, 0)``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fw_workers
import lightning.pytorch  # noqa: F401
import torch
import transformers  # noqa: F401

torch.set_num_threads(1)


def _child(cmd: dict[str, object]) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.stdin.close()
    os.environ.update({str(k): str(v) for k, v in dict(cmd["env"]).items()})  # type: ignore[call-overload]
    out = Path(str(cmd["out"]))
    log = os.open(out / f"log.{os.getpid()}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 0
    try:
        getattr(fw_workers, str(cmd["fn"]))(*list(cmd["args"]))  # type: ignore[call-overload]
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        (out / f"error.{os.getpid()}.txt").write_text(traceback.format_exc())
        code = 1
    (out / f"exit.{os.getpid()}").write_text(str(code))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(cmd)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
