"""What the DCP writer and reader share: the manifest section, step ids, DCP's
``Metadata`` as JSON (never pickled), the plan data and small tensor helpers."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlanner,
    WriteItem,
)

from ckpt_agent.errors import (
    CheckpointFormatError,
    IntegrityError,
    JsonTreeError,
)
from ckpt_agent.format import jsontree
from ckpt_agent.format.layout import (
    parse_checkpoint_id,
)
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import CheckpointRecord, Json, Lineage
from ckpt_agent.runtime.core.serialization import (
    dtype_name,
    torch_dtype,
)

log = logging.getLogger(__name__)

SECTION: Final = "dcp"
"""The rank manifests' section holding DCP's write items (and, on rank 0, its metadata)."""

_TRAILING_NUMBER = re.compile(r"(\d+)$")
RANK_PART = "__ckpt_rank_part__"
"""The fqn of each rank's extra :class:`WriteResult` announcing its manifest's hash."""


class CorruptedCheckpointError(IntegrityError):
    """A piece of the checkpoint being loaded failed its hash: it is marked corrupted;
    loading again (:func:`load_latest` does) takes the previous valid checkpoint."""

    def __init__(self, checkpoint_id: str, reason: str) -> None:
        super().__init__(f"{checkpoint_id}: {reason}")
        self.checkpoint_id = checkpoint_id
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers rank failures by pickling them
        return (type(self), (self.checkpoint_id, self.reason))


def step_of(checkpoint_id: str | os.PathLike[str] | int) -> int:
    """The step a DCP ``checkpoint_id`` names: ``step-200``, ``/ckpt/step_200``, our own
    ``full_step_000000000200`` or ``200``."""
    if isinstance(checkpoint_id, int):
        return checkpoint_id
    name = os.path.basename(os.fspath(checkpoint_id).rstrip("/"))
    with contextlib.suppress(ValueError):
        return parse_checkpoint_id(name)[1]
    m = _TRAILING_NUMBER.search(name)
    if m is None:
        raise ValueError(
            f"checkpoint_id {os.fspath(checkpoint_id)!r} names no step: end it with the step "
            "number (torchtitan's 'step-200' does)"
        )
    return int(m.group(1))


# --------------------------------------------------------------------------- metadata as JSON


def metadata_to_json(md: Metadata) -> Json:
    """DCP's ``Metadata`` as tagged JSON (never pickled); :func:`metadata_from_json` inverts it."""
    entries: dict[str, object] = {}
    for fqn, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            p = v.properties
            if p.layout != torch.strided:
                raise CheckpointFormatError(f"{fqn}: only dense (strided) tensors are supported")
            entries[fqn] = {
                "kind": "tensor",
                "dtype": dtype_name(p.dtype),
                "requires_grad": bool(p.requires_grad),
                "size": [int(s) for s in v.size],
                "chunks": [
                    {"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]}
                    for c in v.chunks
                ],
            }
        elif isinstance(v, BytesStorageMetadata):
            entries[fqn] = {"kind": "bytes"}
        else:  # pragma: no cover - DCP knows these two kinds only
            raise CheckpointFormatError(f"{fqn}: unknown DCP storage metadata {type(v).__name__}")
    sm = md.storage_meta
    storage_meta = (
        None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        }
    )
    try:
        return jsontree.encode(
            {
                "state_dict_metadata": entries,
                "planner_data": md.planner_data,
                "storage_meta": storage_meta,
                "version": md.version,
            }
        )
    except JsonTreeError as e:
        raise CheckpointFormatError(
            f"DCP metadata cannot be stored as JSON ({e}): a custom planner's planner_data "
            "must be plain values"
        ) from None


def as_size(v: object, what: str) -> torch.Size:
    if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
        raise CheckpointFormatError(f"{what}: must be a list of non-negative integers")
    return torch.Size(v)


def metadata_from_json(tree: Json, what: str = "DCP metadata") -> Metadata:
    """Rebuild DCP's ``Metadata`` from :func:`metadata_to_json` (checked, nothing unpickled)."""
    d = jsontree.decode(tree)
    if not isinstance(d, dict) or not isinstance(d.get("state_dict_metadata"), dict):
        raise CheckpointFormatError(f"{what}: not DCP metadata")
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, e in d["state_dict_metadata"].items():
        if not isinstance(e, dict):
            raise CheckpointFormatError(f"{what}: {fqn!r} is not an object")
        if e.get("kind") == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        if e.get("kind") != "tensor":
            raise CheckpointFormatError(f"{what}: {fqn!r} has unknown kind {e.get('kind')!r}")
        chunks = e.get("chunks")
        if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            raise CheckpointFormatError(f"{what}: {fqn!r} chunks must be a list of objects")
        size = as_size(e.get("size"), f"{what}: {fqn!r} size")
        parsed = []
        for c in chunks:
            offsets = as_size(c.get("offsets"), f"{what}: {fqn!r} offsets")
            sizes = as_size(c.get("sizes"), f"{what}: {fqn!r} sizes")
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True))
            ):
                raise CheckpointFormatError(f"{what}: a chunk of {fqn!r} lies outside its tensor")
            parsed.append(ChunkStorageMetadata(offsets, sizes))
        props = TensorProperties(
            dtype=torch_dtype(str(e.get("dtype"))), requires_grad=bool(e.get("requires_grad"))
        )
        sdm[fqn] = TensorStorageMetadata(props, size, parsed)
    sm = d.get("storage_meta")
    storage_meta = None
    if isinstance(sm, dict):
        modules = sm.get("modules") or []
        storage_meta = StorageMeta(
            checkpoint_id=_opt_str(sm.get("checkpoint_id")),
            save_id=_opt_str(sm.get("save_id")),
            load_id=_opt_str(sm.get("load_id")),
            modules=[str(m) for m in modules] if isinstance(modules, list) else [],
        )
    return Metadata(
        state_dict_metadata=dict(sdm),
        planner_data=d.get("planner_data"),
        storage_meta=storage_meta,
        version=_opt_str(d.get("version")),
    )


def _opt_str(v: object) -> str | None:
    return None if v is None else str(v)


# --------------------------------------------------------------------------- shared set-up


def config_or_env(config: AgentConfig | None) -> AgentConfig:
    return config if config is not None else AgentConfig.from_env()


@dataclass(frozen=True)
class PlanData:
    """What the coordinator tells every rank about the checkpoint (the plans' storage_data)."""

    step: int
    world_size: int
    rank: int
    created_at: float
    prev_hash: str | None


@dataclass(frozen=True)
class ItemAt:
    """Where one write item went: its rank's manifest, item number."""

    rank: int
    item: int


@dataclass(frozen=True)
class RankPart:
    """A rank's manifest as it announced it to the coordinator."""

    rank: int
    sha256: str
    size: int


def index_key(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    return (index.fqn, None if index.offset is None else tuple(int(o) for o in index.offset))


# --------------------------------------------------------------------------- writer


def current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def cpu_tensor(data: object) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise CheckpointFormatError(f"DCP resolved a {type(data).__name__} for a tensor item")
    t = data.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def object_of(item: WriteItem, planner: SavePlanner) -> object:
    """The value behind a bytes item: from the planner's state dict (the default planner
    keeps it), else the planner's own serialization of it read back with ``weights_only``
    (plain values only; in memory, just made by the planner)."""
    from torch.distributed.checkpoint.utils import find_state_dict_object

    sd = getattr(planner, "state_dict", None)
    if isinstance(sd, dict):
        with contextlib.suppress(KeyError, ValueError):
            return find_state_dict_object(sd, item.index)
    data = planner.resolve_data(item)
    if isinstance(data, io.BytesIO):
        data.seek(0)
        return torch.load(data, weights_only=True)
    return data


def entry_nbytes(entry: Mapping[str, object]) -> int:
    t = entry.get("tensor")
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# --------------------------------------------------------------------------- reader


class Loaded(Protocol):
    """What a reader loaded (:class:`~ckpt_agent.integrations.dcp.reader.DcpReader`), as
    :meth:`~ckpt_agent.integrations.dcp.writer.DcpWriter.resumed_from` reads it."""

    @property
    def resumed(self) -> CheckpointRecord | None: ...

    @property
    def lineage(self) -> Lineage: ...
