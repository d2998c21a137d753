"""Sharded (FSDP / DTensor) state: DCP planning, our format around it, load at another world size.

``torch.distributed.checkpoint`` (DCP) knows how to cut DTensors into chunks
and how to compute, for a *different* sharding at load time, which saved
chunk pieces each rank needs (resharding). Its file format pickles its
metadata; ours never pickles. So this module uses DCP's *planners* only:

* **save** (:func:`plan_save`): ``create_default_local_save_plan`` lists this
  rank's write items — one chunk per DTensor shard (global offsets and sizes),
  one whole tensor per plain tensor. Plain tensors and replicated DTensor
  chunks are written once (by the coordinator, resp. the replica at mesh
  coordinate 0), the same de-duplication DCP does globally, decided locally.
  Everything that is not a tensor (``param_groups`` …) stays in a tagged-JSON
  tree where each tensor is ``{"__sharded__": "<fqn>"}``. The result is one
  section of the rank's part::

      "sharded": {"tree":   <tagged JSON, tensors as {"__sharded__": fqn}>,
                  "layout": {fqn: {"dtype", "size": [global], "chunks": [
                                   {"offsets": [...], "sizes": [...], "key": "<fqn>@<offsets>"}]}},
                  "chunks": {"<fqn>@<offsets>": <this rank's chunk tensor>}}

  The chunks are ordinary tensors of the rank manifest: they get our
  snapshot (copy into reusable buffers), chunking, de-duplication, zstd,
  SHA-256, two-phase commit, validation, catalog and retention.
* **load** (:func:`load_sharded`): the layouts of every rank part are merged
  into DCP's ``Metadata`` (in memory, built from our JSON), and
  ``create_default_local_load_plan`` computes this rank's read items for the
  *target* state (DTensors laid out for the new world size). Each needed
  chunk is read (hash-checked) once, narrowed and copied into the target's
  local shard.

Use it with ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` (FSDP2 ``fully_shard`` models and their optimizers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from ckpt_agent.errors import CheckpointFormatError, JsonTreeError
from ckpt_agent.format import jsontree
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.format.readers import read_checkpoint, read_commit, read_rank_manifest
from ckpt_agent.format.statecheck import chunk_names
from ckpt_agent.records import Json
from ckpt_agent.runtime.core.serialization import dtype_name, load_entry, torch_dtype
from ckpt_agent.storage.base import Storage

__all__ = [
    "SECTION",
    "SHARDED",
    "ShardedSave",
    "flat_tensors",
    "is_dtensor",
    "load_sharded",
    "plan_save",
    "restore_sharded",
    "sharded_compat",
    "sharded_state",
]


SHARDED: Final = "__sharded__"
"""Tag of a (possibly sharded) tensor in the tree, resolved through the layout."""
SECTION: Final = "sharded"


@dataclass
class ShardedSave:
    """One rank's share of a sharded state (see the module doc)."""

    tree: Json
    layout: dict[str, Json]
    chunks: dict[str, torch.Tensor] = field(default_factory=dict)

    def section(self) -> dict[str, object]:
        """The checkpoint section (the chunks are live tensors: snapshot them)."""
        return {"tree": self.tree, "layout": self.layout, "chunks": self.chunks}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.chunks.values())


def is_dtensor(v: object) -> bool:
    """Whether ``v`` is a DTensor (an FSDP2 / tensor-parallel shard)."""
    return _is_dtensor(v)


def _is_dtensor(v: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(v, DTensor)


def _encode(state: Mapping[str, object]) -> tuple[Json, dict[str, torch.Tensor]]:
    """Tree with ``{"__sharded__": fqn}`` tensor leaves, and fqn → tensor."""
    flat: dict[str, torch.Tensor] = {}

    def leaf(v: object, path: str) -> Json | None:
        if isinstance(v, torch.Tensor):
            fqn = path or "<root>"
            if fqn in flat:
                raise JsonTreeError(f"{fqn}: two tensors with one name")
            flat[fqn] = v
            return {SHARDED: fqn}
        if isinstance(v, torch.dtype):
            return {jsontree.DTYPE: dtype_name(v)}
        return None

    tree = jsontree.encode(dict(state), leaf)
    return tree, flat


def flat_tensors(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """fqn → tensor of ``state`` (the names :func:`plan_save` uses)."""
    return _encode(state)[1]


def _replica_owner(t: object) -> bool:
    """For a DTensor: whether this rank writes its chunk (coordinate 0 on replicated dims)."""
    from torch.distributed.tensor import DTensor, Replicate

    assert isinstance(t, DTensor)
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate))


def _key(fqn: str, offsets: tuple[int, ...]) -> str:
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


def plan_save(state: Mapping[str, object], *, coordinator: bool) -> ShardedSave:
    """This rank's chunks of ``state`` (DTensors, tensors and JSON values), planned by DCP."""
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.utils import find_state_dict_object

    tree, flat = _encode(state)
    plan = create_default_local_save_plan(dict(flat), coordinator)
    layout: dict[str, Json] = {}
    chunks: dict[str, torch.Tensor] = {}
    for item in plan.items:
        fqn = item.index.fqn
        obj = flat[fqn]
        td = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or td is None or td.chunk is None:
            raise CheckpointFormatError(f"{fqn}: not a tensor (DCP would pickle it)")
        entry = layout.setdefault(
            fqn,
            {"dtype": dtype_name(td.properties.dtype), "size": list(td.size), "chunks": []},
        )
        if _is_dtensor(obj):
            if not _replica_owner(obj):
                continue
        elif not coordinator:
            continue  # a plain tensor is replicated state: the coordinator writes it
        offsets = tuple(int(o) for o in td.chunk.offsets)
        key = _key(fqn, offsets)
        local = find_state_dict_object(flat, item.index)
        if not isinstance(local, torch.Tensor):
            raise CheckpointFormatError(f"{fqn}: DCP resolved no tensor")
        chunks[key] = local.detach()
        entry["chunks"].append(
            {"offsets": list(offsets), "sizes": [int(s) for s in td.chunk.sizes], "key": key}
        )
    return ShardedSave(tree=tree, layout=layout, chunks=chunks)


# --------------------------------------------------------------------------- load


@dataclass(frozen=True)
class _Source:
    manifest: RankManifest
    name: str


def _section(m: RankManifest, section: str) -> Mapping[str, Json]:
    state = m.state if isinstance(m.state, dict) else {}
    sec = state.get(section)
    if not isinstance(sec, dict):
        raise CheckpointFormatError(f"{m.checkpoint_id} rank {m.rank}: no {section!r} section")
    return sec


def _layout(sec: Mapping[str, Json], what: str) -> dict[str, Json]:
    lay = jsontree.decode(sec.get("layout"))
    if not isinstance(lay, dict):
        raise CheckpointFormatError(f"{what}: layout must be an object")
    return lay


def load_sharded(
    storage: Storage,
    run_id: str,
    ckpt_id: str,
    target: Mapping[str, object],
    *,
    section: str = SECTION,
    manifests: list[RankManifest] | None = None,
) -> dict[str, object]:
    """Fill ``target``'s tensors (DTensors at *this* world size) from a sharded checkpoint.

    ``target`` has the structure of the saved state (``get_state_dict`` of a
    model and optimizer built at the new world size). Returns the saved
    structure with its JSON values (learning rates …) and ``target``'s
    tensors, filled in place — hand it to ``set_state_dict``. Every chunk is
    hash-checked as it is read; a missing or mismatched tensor raises.
    """
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.utils import find_state_dict_object

    if manifests is None:
        committed = read_commit(storage, run_id, ckpt_id)
        manifests = [
            read_rank_manifest(storage, run_id, committed, r.rank) for r in committed.commit.ranks
        ]
    md: dict[str, TensorStorageMetadata] = {}
    where: dict[tuple[str, tuple[int, ...]], _Source] = {}
    tree: Json = None
    for m in sorted(manifests, key=lambda x: x.rank):
        what = f"{m.checkpoint_id} rank {m.rank}"
        sec = _section(m, section)
        if tree is None and "tree" in sec:
            tree = sec["tree"]
        names = chunk_names(sec, what)
        for fqn, entry in _layout(sec, what).items():
            if not isinstance(entry, dict):
                raise CheckpointFormatError(f"{what}: layout of {fqn!r} is not an object")
            dtype = torch_dtype(str(entry.get("dtype")))
            size = torch.Size(int(s) for s in entry.get("size") or [])
            tmd = md.setdefault(
                fqn, TensorStorageMetadata(TensorProperties(dtype=dtype), size, chunks=[])
            )
            if tmd.size != size:
                raise CheckpointFormatError(f"{what}: {fqn!r} has two global sizes")
            for c in entry.get("chunks") or []:
                offsets = tuple(int(o) for o in c["offsets"])
                sizes = tuple(int(s) for s in c["sizes"])
                key = str(c["key"])
                if key not in names or names[key] not in m.tensors:
                    raise CheckpointFormatError(f"{what}: chunk {key!r} is not in the manifest")
                if (fqn, offsets) in where:
                    continue  # a replica of a chunk already known
                tmd.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                where[(fqn, offsets)] = _Source(m, names[key])
    if tree is None:
        raise CheckpointFormatError(f"{ckpt_id}: no rank holds the {section!r} tree")
    flat = flat_tensors(target)
    missing = sorted(set(md) - set(flat))
    extra = sorted(set(flat) - set(md))
    if missing or extra:
        raise CheckpointFormatError(
            f"{ckpt_id}: the target state does not match the checkpoint "
            f"(missing in target: {missing[:5]}, not in checkpoint: {extra[:5]})"
        )
    for fqn, tmd in md.items():
        n = 1
        for s in tmd.size:
            n *= s
        covered = sum(_numel(c.sizes) for c in tmd.chunks)
        if covered != n:
            raise CheckpointFormatError(
                f"{ckpt_id}: chunks of {fqn!r} cover {covered} of {n} elements (a part is missing)"
            )
    plan = create_default_local_load_plan(dict(flat), Metadata(dict(md)), True)
    # The tree went through the snapshot's own tagged-JSON encoding once more (its tag-like
    # one-key objects were escaped): undo that, then decode the tree itself.
    decoded = jsontree.decode(jsontree.decode(tree), _resolve_dtype)
    out = _fill(decoded, flat)
    if not isinstance(out, dict):
        raise CheckpointFormatError(f"{ckpt_id}: the sharded tree is not an object")
    # Read and check every piece first, then copy: a bad chunk leaves the target untouched.
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    cache: dict[tuple[int, str], torch.Tensor] = {}
    for ri in plan.items:
        src_at = where[(ri.storage_index.fqn, tuple(int(o) for o in ri.storage_index.offset or ()))]
        k = (src_at.manifest.rank, src_at.name)
        src = cache.get(k)
        if src is None:
            entry_ = src_at.manifest.tensors[src_at.name]
            src = load_entry(storage, run_id, src_at.manifest, entry_, src_at.name)
            cache[k] = src
        piece = narrow_tensor_by_index(src, ri.storage_offsets, ri.lengths)
        dest = find_state_dict_object(flat, ri.dest_index)
        if not isinstance(dest, torch.Tensor):
            raise CheckpointFormatError(f"{ri.dest_index.fqn}: the target is not a tensor")
        target_piece = narrow_tensor_by_index(dest, ri.dest_offsets, ri.lengths)
        if target_piece.shape != piece.shape:
            raise CheckpointFormatError(
                f"{ckpt_id}: chunk {src_at.name!r} does not fit {ri.dest_index.fqn!r}"
            )
        copies.append((target_piece, piece))
    for target_piece, piece in copies:
        target_piece.copy_(piece)
    return out


def _numel(sizes: torch.Size) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _resolve_dtype(tag: str, payload: Json, path: str) -> object:
    if tag == jsontree.DTYPE and isinstance(payload, str):
        return torch_dtype(payload)
    raise JsonTreeError(f"{path}: unexpected {tag} in a sharded tree")


def _fill(value: object, flat: Mapping[str, torch.Tensor]) -> object:
    if isinstance(value, dict):
        if len(value) == 1 and SHARDED in value:
            fqn = value[SHARDED]
            if not isinstance(fqn, str) or fqn not in flat:
                raise CheckpointFormatError(f"tensor {fqn!r} is not in the target state")
            return flat[fqn]
        return {k: _fill(v, flat) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, flat) for v in value]
    if isinstance(value, tuple):
        return tuple(_fill(v, flat) for v in value)
    return value


# --------------------------------------------------------------------------- Checkpointer glue


def sharded_state(model: torch.nn.Module, optimizer: Any, lightweight: bool) -> dict[str, object]:
    """The model's (and optimizer's) DTensor state as DCP's ``get_state_dict`` gives it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None or lightweight:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def sharded_compat(manifest: RankManifest, model: torch.nn.Module, live_sharded: bool) -> list[str]:
    """Global shapes of the saved model shards vs the live (DTensor) model (empty: it fits)."""
    if SECTION not in manifest.meta.sections:
        return ["the checkpoint holds no sharded state (saved without FSDP)"]
    if not live_sharded:
        return ["the checkpoint holds sharded (FSDP) state; the live model is not sharded"]
    state = manifest.state if isinstance(manifest.state, dict) else {}
    sec = state.get(SECTION)
    layout = jsontree.decode(sec.get("layout")) if isinstance(sec, dict) else None
    if not isinstance(layout, dict):
        return ["the sharded section has no layout"]
    live = {
        f"model/{k}": tuple(int(x) for x in v.shape)
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    saved = {
        k: tuple(int(x) for x in v.get("size") or [])
        for k, v in layout.items()
        if k.startswith("model/") and isinstance(v, dict)
    }
    problems = [f"{k}: missing from the checkpoint" for k in sorted(live.keys() - saved)]
    problems += [f"{k}: not in the live model" for k in sorted(saved.keys() - live)]
    problems += [
        f"{k}: checkpoint has {list(saved[k])}, live model {list(live[k])}"
        for k in sorted(live.keys() & saved.keys())
        if live[k] != saved[k]
    ]
    return problems


def restore_sharded(
    storage: Storage,
    run_id: str,
    ckpt_id: str,
    model: torch.nn.Module,
    optimizer: Any,
    warnings: list[str],
) -> None:
    """Reshard the saved model (and optimizer) into this world size's DTensors, in place."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    saved = read_checkpoint(storage, run_id, ckpt_id, 0)[1]
    sec = saved.state.get(SECTION) if isinstance(saved.state, dict) else None
    layout = jsontree.decode(sec.get("layout")) if isinstance(sec, dict) else {}
    has_optim = isinstance(layout, dict) and any(k.startswith("optimizer/") for k in layout)
    target = sharded_state(model, optimizer, lightweight=not has_optim)
    state = load_sharded(storage, run_id, ckpt_id, target)
    if optimizer is not None and "optimizer" in state:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],  # type: ignore[arg-type]
            optim_state_dict=state["optimizer"],  # type: ignore[arg-type]
        )
        return
    set_model_state_dict(model, state["model"])  # type: ignore[arg-type]
    if optimizer is not None:
        warnings.append(f"optimizer state is not in {ckpt_id} (lightweight checkpoint)")
