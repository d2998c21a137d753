"""Training state ↔ pickle-free payloads: tensors as raw bytes, everything else as JSON.

The torch side of the format (the byte-level side is :mod:`ckpt_agent.format.readers`).

* :func:`flatten` walks a state tree (``model.state_dict()``,
  ``optimizer.state_dict()`` — AdamW state keyed by parameter index and its
  ``param_groups`` —, LR scheduler, GradScaler, data position, RNG) and
  returns a tagged-JSON tree (:mod:`ckpt_agent.format.jsontree`) whose tensors and
  numpy arrays are references to a flat ``name → array`` table. Names are
  the tree paths (``model/fc.weight``, ``optimizer/state/0/exp_avg``).
* :func:`capture_rng` / :func:`restore_rng`: python ``random``, numpy's legacy
  global generator, torch CPU and every CUDA device, converted exactly to
  JSON integers/floats and uint8 tensors.
* :func:`load_tensors` decodes a rank manifest's tensors into torch tensors
  (every chunk's stored and raw SHA-256 checked) and :func:`unflatten` puts
  the tree back together. Nothing here unpickles: a file can at worst hold
  wrong numbers, which the hash checks refuse.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import torch

from ckpt_agent.errors import CheckpointFormatError, JsonTreeError
from ckpt_agent.format import jsontree
from ckpt_agent.format.entries import TensorEntry
from ckpt_agent.format.heartbeat import PackedRng
from ckpt_agent.format.layout import DTYPE_ITEMSIZE
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.format.manifest import library_versions as format_library_versions
from ckpt_agent.format.parallel_read import Target, read_into
from ckpt_agent.format.readers import read_tensor_bytes
from ckpt_agent.format.shuffle import NUMPY_SHUFFLER
from ckpt_agent.format.statecheck import check_rng, scalar_value
from ckpt_agent.records import Json
from ckpt_agent.storage.base import Storage

__all__ = [
    "LiveArray",
    "LoadedState",
    "capture_rng",
    "check_rng_live",
    "dtype_name",
    "flatten",
    "library_versions",
    "load_tensors",
    "restore_rng",
    "torch_dtype",
    "unflatten",
]


_TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    name: dt for name in DTYPE_ITEMSIZE if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_NAME_OF: Final[dict[torch.dtype, str]] = {dt: name for name, dt in _TORCH_DTYPES.items()}
_INT_OF_SIZE: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise JsonTreeError(f"unsupported tensor dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise CheckpointFormatError(f"dtype {name!r} is not available in this torch") from None


def library_versions() -> dict[str, str]:
    """The format's versions plus torch, numpy and CUDA."""
    extra = {"torch": str(torch.__version__), "numpy": str(np.__version__)}
    cuda = torch.version.cuda
    if cuda:
        extra["cuda"] = str(cuda)
    return format_library_versions(extra)


# --------------------------------------------------------------------------- flatten


@dataclass(frozen=True)
class LiveArray:
    """A tensor or numpy array found in the live state (a reference, not a copy)."""

    name: str
    value: torch.Tensor | np.ndarray

    @property
    def is_numpy(self) -> bool:
        return isinstance(self.value, np.ndarray)

    @property
    def dtype(self) -> str:
        if isinstance(self.value, np.ndarray):
            return str(self.value.dtype)
        return dtype_name(self.value.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.value.shape)


def flatten(value: object, prefix: str, out: dict[str, LiveArray]) -> Json:
    """Encode ``value`` as tagged JSON; its tensors/arrays go into ``out`` by name.

    ``prefix`` namespaces the names (``model``, ``optimizer``...). Nothing is
    copied: ``out`` holds references (the snapshot copies them into buffers).
    """

    def leaf(v: object, path: str) -> Json | None:
        if isinstance(v, torch.Tensor):
            return {jsontree.TENSOR: _add(v, path)}
        if isinstance(v, np.ndarray):
            if v.dtype.kind not in "biufc" or str(v.dtype) not in DTYPE_ITEMSIZE:
                raise JsonTreeError(f"{path}: numpy dtype {v.dtype} cannot be checkpointed")
            return {jsontree.NDARRAY: _add(v, path)}
        if isinstance(v, np.generic):
            if str(v.dtype) not in DTYPE_ITEMSIZE:
                raise JsonTreeError(f"{path}: numpy dtype {v.dtype} cannot be checkpointed")
            item = v.item()
            enc = jsontree.encode(item, None, path)
            return {jsontree.NPSCALAR: [str(v.dtype), enc]}
        if isinstance(v, torch.dtype):
            return {jsontree.DTYPE: dtype_name(v)}
        if isinstance(v, torch.device):
            return str(v)
        if isinstance(v, float):  # float subclasses other than numpy's
            return jsontree.encode(float(v))
        return None

    def _add(v: torch.Tensor | np.ndarray, path: str) -> str:
        name = f"{prefix}/{path}" if path else prefix
        base, n = name, 1
        while name in out:
            n += 1
            name = f"{base}#{n}"
        if isinstance(v, torch.Tensor):
            if v.is_sparse or v.layout != torch.strided:
                raise JsonTreeError(f"{name}: only dense (strided) tensors are supported")
            if v.is_quantized:
                raise JsonTreeError(f"{name}: quantized tensors are not supported")
            dtype_name(v.dtype)
        out[name] = LiveArray(name, v)
        return name

    return jsontree.encode(value, leaf)


def unflatten(tree: Json, arrays: Mapping[str, torch.Tensor]) -> object:
    """Inverse of :func:`flatten` (tensors come from :func:`load_tensors`)."""

    def resolve(tag: str, payload: Json, path: str) -> object:
        if tag == jsontree.TENSOR:
            return _lookup(payload, path)
        if tag == jsontree.NDARRAY:
            t = _lookup(payload, path)
            return _to_numpy(t)
        if tag == jsontree.NPSCALAR:
            dtype, value = scalar_value(payload, path)
            return np.dtype(dtype).type(value)
        if tag == jsontree.DTYPE:
            if not isinstance(payload, str):
                raise JsonTreeError(f"{path}: bad dtype")
            return torch_dtype(payload)
        raise JsonTreeError(f"{path}: unknown tag {tag}")

    def _lookup(payload: Json, path: str) -> torch.Tensor:
        if not isinstance(payload, str) or payload not in arrays:
            raise CheckpointFormatError(f"{path}: reference to a tensor the manifest does not hold")
        return arrays[payload]

    return jsontree.decode(tree, resolve)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        raise CheckpointFormatError("numpy arrays cannot be bfloat16")
    return t.numpy().copy()


def raw_bytes(t: torch.Tensor | np.ndarray) -> memoryview:
    """Zero-copy byte view of a C-contiguous CPU tensor/array."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise ValueError("array is not C-contiguous")
        return t.reshape(-1).view(np.uint8).data
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor must be a contiguous CPU tensor")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


# --------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, object]:
    """Every global RNG state, as JSON values and uint8 tensors (exact)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)
    kind, keys, pos, has_gauss, cached = np_state
    out: dict[str, object] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {
            "bit_generator": str(kind),
            "key": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def rng_from_packed(packed: PackedRng) -> dict[str, object]:
    """A heartbeat's packed RNG states in :func:`capture_rng`'s shape (for :func:`restore_rng`)."""
    out: dict[str, object] = {}
    if packed.python is not None:
        version, words, gauss = packed.python
        out["python"] = {"version": version, "internal": list(words), "gauss_next": gauss}
    if packed.numpy is not None:
        name, key, pos, has_gauss, cached = packed.numpy
        out["numpy"] = {
            "bit_generator": name,
            "key": np.frombuffer(key, dtype="<u4").tolist(),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached,
        }
    if packed.torch_cpu is not None:
        out["torch_cpu"] = _uint8(packed.torch_cpu)
    if packed.cuda:
        out["cuda"] = [_uint8(b) for b in packed.cuda]
    return out


def _uint8(raw: bytes) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def check_rng_live(state: Mapping[str, object]) -> None:
    """Refuse an RNG state this process cannot take (checked before any generator is set)."""
    check_rng(dict(state), "rng")
    for t in [state.get("torch_cpu"), *_list(state.get("cuda"))]:
        if isinstance(t, torch.Tensor) and (t.dtype != torch.uint8 or t.dim() != 1):
            raise CheckpointFormatError(f"rng: a generator state of {t.dtype}{list(t.shape)}")


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def restore_rng(state: Mapping[str, object], *, strict_cuda: bool = False) -> list[str]:
    """Restore :func:`capture_rng` output; returns warnings (e.g. CUDA device count changed).

    The whole state is checked first (:func:`check_rng_live`): a bad one sets no generator.
    """
    check_rng_live(state)
    warnings: list[str] = []
    py = state.get("python")
    if isinstance(py, dict):
        internal = py["internal"]
        random.setstate((py["version"], tuple(internal), py.get("gauss_next")))
    npst = state.get("numpy")
    if isinstance(npst, dict):
        key = npst.get("key")
        cached = npst.get("cached_gaussian", 0.0)
        np.random.set_state(
            (
                str(npst.get("bit_generator", "MT19937")),
                np.array(key, dtype=np.uint32),
                int(_num(npst.get("pos"))),
                int(_num(npst.get("has_gauss"))),
                float(_num(cached)),
            )
        )
    cpu = state.get("torch_cpu")
    if isinstance(cpu, torch.Tensor):
        if cpu.shape == torch.get_rng_state().shape:
            torch.set_rng_state(cpu.clone())
        else:  # another torch version's generator: its numbers are not ours to continue
            warnings.append(f"torch CPU RNG state of {cpu.numel()} bytes not restored")
    cuda = state.get("cuda")
    if isinstance(cuda, list) and cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all([t.clone() for t in cuda if isinstance(t, torch.Tensor)])
        else:
            msg = (
                f"checkpoint holds {len(cuda)} CUDA RNG state(s) but this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} device(s): "
                "CUDA RNG not restored"
            )
            if strict_cuda:
                raise RuntimeError(msg)
            warnings.append(msg)
    return warnings


def _num(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise CheckpointFormatError("rng.numpy fields must be numbers")
    return v


# --------------------------------------------------------------------------- loading


@dataclass
class LoadedState:
    """A rank manifest's tree plus its decoded tensors."""

    manifest: RankManifest
    arrays: dict[str, torch.Tensor]
    files: dict[str, bytes]

    _decoded: dict[str, object] = field(default_factory=dict, repr=False)

    def section(self, name: str) -> object:
        """The decoded section (decoded once: the restorer checks what it later applies)."""
        state = self.manifest.state
        if not isinstance(state, dict) or name not in state:
            return None
        if name not in self._decoded:
            self._decoded[name] = unflatten(state[name], self.arrays)
        return self._decoded[name]


def _staging(entry: TensorEntry) -> tuple[torch.Tensor, memoryview]:
    """A fresh byte tensor for ``entry`` and its writable view (checks the dtype first)."""
    torch_dtype(entry.dtype)
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    return buf, buf.numpy().data if entry.nbytes else memoryview(bytearray(0))


def _as_loaded(buf: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The decoded bytes as the entry's dtype and shape (byte-swapped if saved elsewhere)."""
    dtype = torch_dtype(entry.dtype)
    itemsize = DTYPE_ITEMSIZE[entry.dtype]
    if entry.byte_order != sys.byteorder and itemsize > 1:
        as_int = buf.view(_INT_OF_SIZE.get(itemsize, torch.uint8))
        swapped = torch.from_numpy(as_int.numpy().byteswap())
        buf = swapped.view(torch.uint8)
    return buf.view(dtype).reshape(entry.shape)


def load_entry(
    storage: Storage, run_id: str, manifest: RankManifest, entry: TensorEntry, name: str
) -> torch.Tensor:
    """Decode one tensor (hash-checked) into a new CPU tensor."""
    buf, view = _staging(entry)
    read_tensor_bytes(storage, run_id, manifest, entry, name, out=view, shuffler=NUMPY_SHUFFLER)
    return _as_loaded(buf, entry)


def load_tensors(
    storage: Storage,
    run_id: str,
    manifest: RankManifest,
    names: Iterable[str] | None = None,
    *,
    on_tensor: Callable[[str, int], None] | None = None,
    workers: int | None = None,
) -> LoadedState:
    """Decode the manifest's tensors (all, or ``names``) and files.

    Each tensor is decoded straight into a fresh tensor (staging, never a live
    one): every chunk of every tensor is read, decoded and verified on
    ``workers`` threads (default: the usable CPUs, at most 8;
    :func:`~ckpt_agent.format.parallel_read.read_into`). Nothing is returned
    before every chunk is verified; the first error is raised once the chunks
    already running have finished.
    """
    wanted = list(manifest.tensors) if names is None else list(names)
    for name in wanted:
        if name not in manifest.tensors:
            raise CheckpointFormatError(f"{manifest.checkpoint_id}: no tensor {name!r}")
    bufs: dict[str, torch.Tensor] = {}
    targets: list[Target] = []
    for name in wanted:
        entry = manifest.tensors[name]
        bufs[name], view = _staging(entry)
        targets.append(Target(name, entry, view))
    read_into(storage, run_id, manifest, targets, shuffler=NUMPY_SHUFFLER, workers=workers)
    arrays: dict[str, torch.Tensor] = {}
    for name in wanted:
        arrays[name] = _as_loaded(bufs.pop(name), manifest.tensors[name])
        if on_tensor is not None:
            on_tensor(name, manifest.tensors[name].nbytes)
    files: dict[str, bytes] = {}
    for fname, fentry in manifest.files.items():
        files[fname] = bytes(
            read_tensor_bytes(storage, run_id, manifest, fentry, fname, shuffler=NUMPY_SHUFFLER)
        )
    return LoadedState(manifest=manifest, arrays=arrays, files=files)
