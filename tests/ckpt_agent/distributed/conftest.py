"""Multi-process tests: real ``torch.distributed`` (gloo) jobs of 2–4 ranks on the CPU.

Workers live in ``ckpt_dist_workers`` (next to this file, importable by name so
that the forkserver can start them); :mod:`ckpt_dist_harness` launches them. The
forkserver imports torch and the agent once, so each rank starts in
milliseconds instead of paying torch's import again (these machines have 2
cores). Never more than one job runs at a time.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
