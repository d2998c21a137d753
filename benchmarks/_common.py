"""What the benchmarks share: the size of the MLP state they measure, medians, the
machine they ran on, and the results table they write into a doc between two markers.

Not a benchmark: imported by ``bench_engine.py`` and ``bench_distributed.py`` (run as
scripts, so this folder is on ``sys.path``).
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

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
