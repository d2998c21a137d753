"""Is a rank manifest's state tree restorable? Decoded in full, tensors as placeholders.

Torch-free and numpy-free: the validator (``load_check``, ``ckpt verify``) runs
it, and the trainer runs it before it builds a single tensor
(:mod:`ckpt_agent.runtime.restore.restorer`). Whatever a restore would refuse because
of the checkpoint's own content is refused here, so a checkpoint the
validator calls valid is one ``Checkpointer.start()`` can apply (given a live
model of the same shape — that part is the restorer's).

Checked: every section decodes (:mod:`ckpt_agent.format.jsontree`: at most 64
levels, known tags), every tensor/array reference names a tensor the manifest
holds, numpy scalars and dtypes are well formed and in range, the sections
the trainer hands to ``load_state_dict`` are mappings, the RNG state has the
exact shape Python's and numpy's generators accept, and the sharded section's
layout names chunks the manifest holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, TypeGuard

from ckpt_agent.errors import CheckpointFormatError, JsonTreeError
from ckpt_agent.format import jsontree
from ckpt_agent.format.entries import TensorEntry
from ckpt_agent.format.layout import DTYPE_ITEMSIZE
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.records import Json

__all__ = [
    "MAPPING_SECTIONS",
    "TensorRef",
    "check_rng",
    "check_state",
    "chunk_names",
    "scalar_value",
]

#: Sections whose decoded value goes to a ``load_state_dict``: they must be mappings.
MAPPING_SECTIONS: Final = frozenset({"model", "optimizer", "lr_scheduler", "grad_scaler"})

#: Mersenne Twister state sizes (Python's ``random`` and numpy's legacy generator).
_MT_WORDS: Final = 624
_U32: Final = 2**32


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor would be in a decoded tree (its manifest entry, no bytes)."""

    name: str
    entry: TensorEntry
    numpy: bool = False


def scalar_value(payload: Json, path: str) -> tuple[str, bool | int | float]:
    """A ``__npscalar__`` payload's dtype name and value, checked to fit that dtype."""
    if not (isinstance(payload, list) and len(payload) == 2 and isinstance(payload[0], str)):
        raise JsonTreeError(f"{path}: bad numpy scalar")
    dtype = payload[0]
    if dtype not in DTYPE_ITEMSIZE or dtype == "bfloat16" or dtype.startswith("float8"):
        raise JsonTreeError(f"{path}: bad numpy scalar dtype {dtype!r}")
    value = jsontree.decode(payload[1], None, path)
    if not isinstance(value, bool | int | float):
        raise JsonTreeError(f"{path}: numpy scalar value must be a number")
    if dtype.startswith(("int", "uint")):
        bits = DTYPE_ITEMSIZE[dtype] * 8
        lo, hi = (0, 2**bits) if dtype.startswith("u") else (-(2 ** (bits - 1)), 2 ** (bits - 1))
        if type(value) is not int or not lo <= value < hi:
            raise JsonTreeError(f"{path}: {value!r} is not a {dtype}")
    return dtype, value


def check_state(manifest: RankManifest) -> dict[str, object]:
    """Decode every section of ``manifest.state`` (tensors as :class:`TensorRef`).

    Returns the decoded sections; raises :class:`CheckpointFormatError` or
    :class:`JsonTreeError` for anything a restore would refuse.
    """
    what = f"{manifest.checkpoint_id} rank {manifest.rank}"
    state = manifest.state
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"{what}: the state is not an object")

    def resolve(tag: str, payload: Json, path: str) -> object:
        if tag in (jsontree.TENSOR, jsontree.NDARRAY):
            entry = manifest.tensors.get(payload) if isinstance(payload, str) else None
            if entry is None:
                raise CheckpointFormatError(
                    f"{what}: {path}: reference to a tensor the manifest does not hold"
                )
            if payload != path and not str(payload).startswith(f"{path}#"):
                # the writer names every tensor by its place in the tree (``#n``: repeats)
                raise CheckpointFormatError(f"{what}: {path} refers to the tensor of {payload}")
            if tag == jsontree.NDARRAY and entry.dtype in ("bfloat16",):
                raise CheckpointFormatError(f"{what}: {path}: numpy arrays cannot be bfloat16")
            return TensorRef(str(payload), entry, numpy=tag == jsontree.NDARRAY)
        if tag == jsontree.NPSCALAR:
            return scalar_value(payload, path)
        if tag == jsontree.DTYPE and isinstance(payload, str) and payload in DTYPE_ITEMSIZE:
            return payload
        raise JsonTreeError(f"{path}: bad {tag} {payload!r}")

    missing = [s for s in manifest.meta.sections if s not in state]
    if missing:
        raise CheckpointFormatError(f"{what}: sections {missing} are listed but not stored")
    out: dict[str, object] = {}
    for name, tree in state.items():
        if name == "sharded":
            _check_sharded(manifest, tree, what)
            continue
        value = jsontree.decode(tree, resolve, name)
        if name in MAPPING_SECTIONS and not isinstance(value, dict):
            raise CheckpointFormatError(f"{what}: section {name!r} is not a mapping")
        if name == "rng":
            check_rng(value, what)
        out[name] = value
    return out


def check_rng(rng: object, what: str) -> None:
    """An RNG section as :func:`ckpt_agent.runtime.core.serialization.capture_rng` writes it.

    Tensors may be :class:`TensorRef` placeholders or real tensors (the caller
    checks their sizes against the live generator).
    """
    if not isinstance(rng, dict):
        raise CheckpointFormatError(f"{what}: rng is not a mapping")
    py = rng.get("python")
    if py is not None:
        if not isinstance(py, dict) or py.get("version") != 3 or type(py["version"]) is not int:
            raise CheckpointFormatError(f"{what}: rng.python is not a version 3 generator state")
        internal = py.get("internal")
        if not _words(internal, _MT_WORDS + 1) or not 0 <= internal[-1] <= _MT_WORDS:
            raise CheckpointFormatError(f"{what}: rng.python.internal is not a generator state")
        if py.get("gauss_next") is not None and type(py.get("gauss_next")) is not float:
            raise CheckpointFormatError(f"{what}: rng.python.gauss_next must be a float or null")
    npst = rng.get("numpy")
    if npst is not None:
        ok = (
            isinstance(npst, dict)
            and npst.get("bit_generator", "MT19937") == "MT19937"
            and _words(npst.get("key"), _MT_WORDS)
            and type(npst.get("pos")) is int
            and 0 <= npst["pos"] <= _MT_WORDS
            and npst.get("has_gauss") in (0, 1)
            and type(npst.get("cached_gaussian", 0.0)) in (int, float)
        )
        if not ok:
            raise CheckpointFormatError(f"{what}: rng.numpy is not an MT19937 generator state")
    cpu, cuda = rng.get("torch_cpu"), rng.get("cuda", [])
    if not isinstance(cuda, list):
        raise CheckpointFormatError(f"{what}: rng.cuda must be a list")
    for t in ([] if cpu is None else [cpu]) + cuda:
        if isinstance(t, TensorRef):
            if t.entry.dtype != "uint8" or len(t.entry.shape) != 1:
                raise CheckpointFormatError(f"{what}: rng tensor {t.name} is not a uint8 vector")
        elif t is None or isinstance(t, bool | int | float | str | list | dict | tuple):
            raise CheckpointFormatError(f"{what}: rng generator states must be tensors")


def _words(value: object, n: int) -> TypeGuard[list[int]]:
    """A list of ``n`` unsigned 32-bit integers."""
    return (
        isinstance(value, list)
        and len(value) == n
        and all(type(x) is int and 0 <= x < _U32 for x in value)
    )


def chunk_names(sec: Mapping[str, Json], what: str) -> dict[str, str]:
    """A sharded section's chunk key → manifest tensor name (its ``chunks`` are references)."""
    raw = sec.get("chunks") or {}
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{what}: chunks must be an object")
    out: dict[str, str] = {}
    for k, v in raw.items():
        ref = v.get(jsontree.TENSOR) if isinstance(v, dict) else None
        if not isinstance(ref, str):
            raise CheckpointFormatError(f"{what}: chunk {k!r} is not a tensor reference")
        out[str(k)] = ref
    return out


def _check_sharded(manifest: RankManifest, sec: Json, what: str) -> None:
    """The sharded section: a layout of chunks that the manifest holds (tree decodes)."""
    if not isinstance(sec, dict):
        raise CheckpointFormatError(f"{what}: the sharded section is not an object")
    jsontree.decode(jsontree.decode(sec.get("tree"), None, "sharded/tree"), _dtype_only)
    names = chunk_names(sec, what)
    for key, name in names.items():
        if name not in manifest.tensors:
            raise CheckpointFormatError(f"{what}: sharded chunk {key!r} is not in the manifest")
    layout = jsontree.decode(sec.get("layout"), None, "sharded/layout")
    if not isinstance(layout, dict):
        raise CheckpointFormatError(f"{what}: sharded layout must be an object")
    for fqn, entry in layout.items():
        _check_layout_entry(manifest, names, fqn, entry, what)


def _check_layout_entry(
    manifest: RankManifest, names: Mapping[str, str], fqn: str, entry: object, what: str
) -> None:
    where = f"{what}: sharded layout of {fqn!r}"
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_ITEMSIZE:
        raise CheckpointFormatError(f"{where}: not an object with a known dtype")
    size = entry.get("size")
    if not _dims(size):
        raise CheckpointFormatError(f"{where}: size must be a list of non-negative integers")
    chunks = entry.get("chunks") or []
    if not isinstance(chunks, list):
        raise CheckpointFormatError(f"{where}: chunks must be a list")
    for c in chunks:
        ok = (
            isinstance(c, dict)
            and _dims(c.get("offsets"))
            and _dims(c.get("sizes"))
            and len(c["offsets"]) == len(size) == len(c["sizes"])
            and all(o + s <= g for o, s, g in zip(c["offsets"], c["sizes"], size, strict=True))
        )
        if not ok:
            raise CheckpointFormatError(f"{where}: a chunk's offsets/sizes do not fit {size}")
        name = names.get(str(c.get("key")))
        if name is None:
            raise CheckpointFormatError(f"{where}: chunk {c.get('key')!r} is not in the manifest")
        if list(manifest.tensors[name].shape) != c["sizes"]:
            raise CheckpointFormatError(f"{where}: chunk {name!r} does not have the sizes listed")


def _dims(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)


def _dtype_only(tag: str, payload: Json, path: str) -> object:
    if tag == jsontree.DTYPE and isinstance(payload, str) and payload in DTYPE_ITEMSIZE:
        return payload
    raise JsonTreeError(f"{path}: unexpected {tag} in a sharded tree")
