"""Does a checkpoint fit the live model and optimizer? (Checked before anything is loaded.)"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.persist.validate import compare_meta
from ckpt_agent.runtime.core.serialization import dtype_name
from ckpt_agent.runtime.core.sharded import sharded_compat

__all__ = ["compat_problems", "live_meta"]

_OPTIMIZER_STATE = "optimizer/state/"


def live_meta(model: torch.nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``model/<name>`` → (dtype, shape) of the live model's tensors."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            out[f"model/{k}"] = (dtype_name(v.dtype), tuple(int(s) for s in v.shape))
    return out


def compat_problems(
    manifest: RankManifest, model: torch.nn.Module, optimizer: Any, *, sharded: bool
) -> list[str]:
    """Why this checkpoint does not fit the live model/optimizer (empty: it fits)."""
    if sharded or "sharded" in manifest.meta.sections:
        return sharded_compat(manifest, model, sharded)
    got = {n: (t.dtype, t.shape) for n, t in manifest.tensors.items()}
    problems = compare_meta(live_meta(model), got, prefix="model/")
    if "model" not in manifest.meta.sections:
        problems.append("the checkpoint holds no model weights")
    if optimizer is not None and "optimizer" in manifest.meta.sections:
        problems += _optimizer_problems(manifest, optimizer)
    return problems


def _optimizer_problems(manifest: RankManifest, optimizer: Any) -> list[str]:
    state = manifest.state.get("optimizer") if isinstance(manifest.state, dict) else None
    groups = state.get("param_groups") if isinstance(state, dict) else None
    live_groups = optimizer.param_groups
    counts = []
    if isinstance(groups, list):
        for g in groups:
            params = g.get("params") if isinstance(g, dict) else None
            counts.append(len(params) if isinstance(params, list) else -1)
    live_counts = [len(g["params"]) for g in live_groups]
    if counts != live_counts:
        return [
            f"optimizer: checkpoint has parameter groups of sizes {counts}, "
            f"live optimizer {live_counts}"
        ]
    problems = []
    params = [p for g in live_groups for p in g["params"]]
    for name, t in manifest.tensors.items():
        if not name.startswith(_OPTIMIZER_STATE):
            continue
        idx_s, _, key = name[len(_OPTIMIZER_STATE) :].partition("/")
        if not idx_s.isdigit() or int(idx_s) >= len(params) or len(t.shape) == 0:
            continue
        want = tuple(params[int(idx_s)].shape)
        if key not in ("step",) and t.shape != want:
            problems.append(f"{name}: checkpoint has {list(t.shape)}, parameter has {list(want)}")
    return problems
