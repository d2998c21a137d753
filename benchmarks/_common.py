"""What the benchmarks share: the size of the MLP state they measure, medians, the
machine they ran on, and the results table they write into a doc between two markers.

Not a benchmark: imported by ``bench_engine.py``, ``bench_distributed.py`` and
``bench_gpu.py`` (run as scripts, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_agent.policy import AgentConfig

MIB = 1024 * 1024


def mlp_layers(size_mb: float, hidden: int) -> int:
    """How many ``hidden x hidden`` fp32 layers make weights of ~size_mb/3 MiB (AdamW's
    two moments add 2x that), at least 2."""
    per_layer = hidden * hidden * 4
    return max(2, round(size_mb * MIB / 3 / per_layer))


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the model's state dict plus the optimizer's tensors."""
    n: int = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


def agent_config(root: Path, run_id: str, pulse_every: int, **over: Any) -> AgentConfig:
    """A benchmark's agent config under ``root``: pulses every ``pulse_every`` steps, no
    heartbeats, no routine full checkpoint, no risk signals, validation in process."""
    data: dict[str, Any] = {
        "runId": run_id,
        "storageUrl": (root / "store").as_uri(),
        "workDir": str(root / "work"),
        "tiers": {
            "heartbeat": {"enabled": False},
            "pulse": {
                "baseInterval": pulse_every,
                "minInterval": pulse_every,
                "maxInterval": pulse_every,
            },
            "full": {"everySteps": 100000},
        },
        "scheduler": {"risk": {"enabled": False}},
        "validation": {"loadInSubprocess": False},
        "retention": {"routineKeep": 2, "importantKeep": 2},
    }
    data.update(over)
    return AgentConfig.model_validate(data)


def timed_torch_save(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> float:
    """Seconds of ``torch.save`` of the model and optimizer state + fsync (the baseline)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> str:
    """``x86_64, 8 CPUs, Python 3.11.7, torch 2.x``."""
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def results_table(rows: Sequence[tuple[str, str, str]]) -> list[str]:
    """The markdown table of ``(measure, value, comparison)`` rows."""
    return [
        "| measure | value | comparison |",
        "|---|---:|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
    ]


def write_marked(doc: Path, marker: str, lines: Sequence[str]) -> None:
    """Put ``lines`` between two ``marker`` lines in ``doc``: replace what stands between
    them, or append the block when the doc has none."""
    table = "\n".join([marker, *lines, marker])
    text = doc.read_text() if doc.exists() else ""
    if marker in text:
        head, _, rest = text.partition(marker)
        _, _, tail = rest.partition(marker)
        text = head + table + tail
    else:
        text = text.rstrip() + "\n\n" + table + "\n"
    doc.write_text(text)
