"""Before a candidate checkpoint touches the live objects: decode all of it, check it fits.

:class:`~ckpt_agent.runtime.restore.restorer.Restorer` applies a checkpoint with the
live objects' own ``load_state_dict``; several of those mutate as they go
(``Module.load_state_dict`` copies every matching tensor before it complains
about the others, ``GradScaler`` sets field after field). So a candidate is
decoded completely and checked against the live objects *first*
(:func:`check_loaded`); only a candidate that passes is applied.

Who is at fault decides what happens:

* the candidate's bytes or tree are wrong (it contradicts itself, or the
  format) → :class:`~ckpt_agent.errors.CheckpointFormatError` and friends:
  the restorer marks it corrupted and tries the next rung;
* it does not fit the live objects or this machine →
  :class:`~ckpt_agent.errors.CandidateRejectedError` with ``INCOMPATIBLE`` or
  ``TOO_LARGE``: tried no further, not marked;
* the live objects themselves fail (``model.state_dict()`` raises) → that is
  the training script's bug: :meth:`LiveState.of` runs *before* any candidate
  is read, outside the restorer's per-candidate error handling, so it
  surfaces unchanged instead of condemning good checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckpt_agent.errors import (
    CandidateRejectedError,
    CheckpointFormatError,
    CkptError,
    IntegrityError,
    NotFoundError,
    RejectionKind,
    StorageError,
    UnsafePathError,
    one_line,
)
from ckpt_agent.format.heartbeat import Heartbeat
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.format.statecheck import check_state
from ckpt_agent.runtime.core.capture import StateCapture
from ckpt_agent.runtime.core.inline import heartbeat_state
from ckpt_agent.runtime.core.serialization import LoadedState, check_rng_live

__all__ = [
    "LiveState",
    "as_rejection",
    "check_budget",
    "check_heartbeat",
    "check_loaded",
    "memory_budget",
    "rejection_kind",
]

_CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")


@dataclass(frozen=True)
class LiveState:
    """What the live objects look like, taken once per resume (before any candidate)."""

    model: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    """Tensor entries of ``model.state_dict()`` (empty when the model is sharded)."""
    model_keys: frozenset[str]
    params: list[list[tuple[int, ...]]] | None
    """Parameter shapes per optimizer group (None: no optimizer)."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    """The optimizer's groups without their parameters."""
    objects: Mapping[str, tuple[object, dict[str, Any]]] = field(default_factory=dict)
    """``lr_scheduler`` / ``grad_scaler``: the object and its ``state_dict()``."""

    @classmethod
    def of(cls, capture: StateCapture, *, sharded: bool) -> LiveState:
        model: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        keys: frozenset[str] = frozenset()
        if not sharded:
            sd = capture.model.state_dict()
            keys = frozenset(sd)
            model = {
                k: (v.dtype, tuple(int(s) for s in v.shape))
                for k, v in sd.items()
                if isinstance(v, torch.Tensor)
            }
        params: list[list[tuple[int, ...]]] | None = None
        groups: list[dict[str, Any]] = []
        if capture.optimizer is not None:
            params = [[tuple(p.shape) for p in g["params"]] for g in capture.optimizer.param_groups]
            groups = [
                {k: v for k, v in g.items() if k != "params"}
                for g in capture.optimizer.param_groups
            ]
        objects = {
            name: (obj, dict(obj.state_dict()))
            for name, obj in (
                ("lr_scheduler", capture.lr_scheduler),
                ("grad_scaler", capture.grad_scaler),
            )
            if obj is not None
        }
        return cls(model=model, model_keys=keys, params=params, groups=groups, objects=objects)


def memory_budget() -> int | None:
    """Bytes this process may hold at most: physical memory, or the cgroup's limit if lower."""
    limits: list[int] = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        pass
    try:
        text = _CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        text = ""
    if text.isdigit():
        limits.append(int(text))
    return min(limits) if limits else None


def check_budget(
    checkpoint_id: str, manifests: Iterable[tuple[RankManifest, list[str]]], budget: int | None
) -> None:
    """Refuse (``TOO_LARGE``) a candidate whose decoded tensors and files exceed ``budget``."""
    if budget is None:
        return
    total = sum(
        sum(m.tensors[n].nbytes for n in names) + sum(f.nbytes for f in m.files.values())
        for m, names in manifests
    )
    if total > budget:
        raise CandidateRejectedError(
            checkpoint_id,
            RejectionKind.TOO_LARGE,
            f"its tensors hold {total} bytes, more than this process's {budget}-byte memory",
        )


def rejection_kind(e: Exception) -> RejectionKind:
    """The kind of rejection an error raised by a candidate is."""
    if isinstance(e, CandidateRejectedError):
        return e.kind
    if isinstance(e, MemoryError):
        return RejectionKind.TOO_LARGE
    if isinstance(e, IntegrityError):
        return RejectionKind.INTEGRITY
    if isinstance(e, NotFoundError):
        return RejectionKind.MISSING
    if isinstance(e, UnsafePathError):  # the manifest names a planted non-file: its fault
        return RejectionKind.FORMAT
    if isinstance(e, StorageError):
        return RejectionKind.STORAGE
    return RejectionKind.FORMAT


def as_rejection(
    checkpoint_id: str, err: Exception, *, applying: bool = False
) -> CandidateRejectedError:
    """``err`` (raised by a candidate) as a rejection of it.

    While applying, a candidate has passed every check: an error of our own
    types still blames its bytes (a shard read during resharding); anything else
    came from the live objects' ``load_state_dict`` and blames neither
    (``INCOMPATIBLE``: not marked corrupted; the next rung overwrites what it set).
    """
    if isinstance(err, CandidateRejectedError):
        return err
    kind = rejection_kind(err)
    if applying and not isinstance(err, CkptError | MemoryError):
        kind = RejectionKind.INCOMPATIBLE
    what = "applying it failed: " if applying else ""
    return CandidateRejectedError(checkpoint_id, kind, f"{what}{one_line(err)}")


def check_loaded(
    checkpoint_id: str, loaded: LoadedState, own: LoadedState | None, live: LiveState
) -> None:
    """Decode every section of ``loaded`` (and ``own``) and check it fits ``live``."""
    for part in (loaded, own):
        if part is None:
            continue
        check_state(part.manifest)
        state = part.manifest.state
        assert isinstance(state, dict)  # check_state says so
        for name in state:
            if name != "sharded":
                part.section(name)  # decoded once, kept for the apply
        rng = part.section("rng")
        if isinstance(rng, dict):
            check_rng_live(rng)
    sections = loaded.manifest.meta.sections
    if "sharded" in sections:
        return  # resharding reads and checks every piece before it copies (sharded.py)
    _check_model(loaded.section("model"), live)
    if live.params is not None and "optimizer" in sections:
        _check_optimizer(loaded.section("optimizer"), live)
    for name, (obj, live_sd) in live.objects.items():
        if name in sections:
            _check_object(checkpoint_id, name, loaded.section(name), obj, live_sd)


def check_heartbeat(hb: Heartbeat) -> tuple[object, object]:
    """Decode a heartbeat's data position and RNG state; refuse an RNG state this process
    cannot take."""
    data, rng = heartbeat_state(hb)
    if rng is not None:
        if not isinstance(rng, dict):
            raise CheckpointFormatError("the heartbeat's rng is not a mapping")
        check_rng_live(rng)
    return data, rng


def _check_model(saved: object, live: LiveState) -> None:
    if not isinstance(saved, dict):
        raise CheckpointFormatError("the model section is not a mapping")
    if set(saved) != live.model_keys:
        diff = sorted(str(k) for k in set(saved) ^ live.model_keys)
        raise CheckpointFormatError(
            f"the model tree names other entries than its tensors: {diff[:4]}"
        )
    for k, (dtype, shape) in live.model.items():
        v = saved[k]
        if not isinstance(v, torch.Tensor) or v.dtype != dtype or tuple(v.shape) != shape:
            got = f"{v.dtype}{list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise CheckpointFormatError(
                f"model entry {k!r} of the tree is {got}, the live model has {dtype}{list(shape)}"
            )


def _check_optimizer(saved: object, live: LiveState) -> None:
    assert live.params is not None
    ok = (
        isinstance(saved, dict)
        and isinstance(saved.get("state"), dict)
        and isinstance(saved.get("param_groups"), list)
        and len(saved["param_groups"]) == len(live.params)
    )
    if not ok:
        raise CheckpointFormatError("the optimizer section does not have the live groups")
    assert isinstance(saved, dict)
    shapes: dict[object, tuple[int, ...]] = {}
    for group, live_shapes, live_group in zip(
        saved["param_groups"], live.params, live.groups, strict=True
    ):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or len(ids) != len(live_shapes):
            raise CheckpointFormatError("an optimizer group does not have the live parameters")
        for pid, shape in zip(ids, live_shapes, strict=True):
            if type(pid) is not int or pid in shapes:
                raise CheckpointFormatError("optimizer parameter ids must be distinct integers")
            shapes[pid] = shape
        for k, v in group.items():
            if k in live_group and not _same_kind(live_group[k], v):
                raise CheckpointFormatError(f"optimizer group setting {k!r} has the wrong type")
    for pid, st in saved["state"].items():
        if pid not in shapes or not isinstance(st, dict):
            raise CheckpointFormatError(f"optimizer state for unknown parameter {pid!r}")
        for k, v in st.items():
            bad_shape = isinstance(v, torch.Tensor) and v.dim() > 0 and k != "step"
            if bad_shape and tuple(v.shape) != shapes[pid]:
                raise CheckpointFormatError(
                    f"optimizer state {pid}/{k} is {list(v.shape)}, its parameter "
                    f"{list(shapes[pid])}"
                )


def _check_object(
    checkpoint_id: str, name: str, saved: object, obj: object, live_sd: Mapping[str, Any]
) -> None:
    """An LR scheduler's / grad scaler's state: no foreign attributes, the live types."""

    def refuse(why: str) -> CandidateRejectedError:
        return CandidateRejectedError(
            checkpoint_id, RejectionKind.INCOMPATIBLE, f"{name} state does not fit: {why}"
        )

    if not isinstance(saved, dict):
        raise CheckpointFormatError(f"the {name} section is not a mapping")
    for k, v in saved.items():
        if k in live_sd:
            if not _same_kind(live_sd[k], v):
                raise refuse(f"{k!r} is a {type(v).__name__}, live {type(live_sd[k]).__name__}")
        elif not isinstance(k, str) or hasattr(obj, k):
            raise refuse(f"{k!r} would overwrite an attribute that is not part of its state")
    if name == "grad_scaler" and not set(live_sd) <= set(saved):
        raise refuse(f"missing {sorted(set(live_sd) - set(saved))}")


def _kind(v: object) -> str:
    if isinstance(v, int | float | torch.Tensor):
        return "number"
    if isinstance(v, list | tuple):
        return "sequence"
    if isinstance(v, dict):
        return "mapping"
    return type(v).__name__


def _same_kind(live: object, saved: object) -> bool:
    return live is None or saved is None or _kind(live) == _kind(saved)
