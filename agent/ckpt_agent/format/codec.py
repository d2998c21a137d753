"""Blob codecs: how raw tensor bytes become the bytes stored in a blob, and back.

Torch-free and numpy-free (the operator may import it). A blob's codec is
recorded in the manifest next to the blob, so a checkpoint written with any
codec stays readable by every later version:

============ ================================================================
``none``     stored bytes are the raw bytes
``zstd``     Zstandard frame (``level`` recorded for information); optionally
             preceded by a byte shuffle (``shuffle`` = element size, 0 = off)
============ ================================================================

Byte shuffle (as in Blosc/HDF5): for elements of ``k`` bytes, the stored
stream holds byte 0 of every element, then byte 1 of every element, and so on.
Exponent bytes of floats cluster together and compress better. A trailing
partial element (never produced for tensors) is kept unshuffled at the end.

Decoding never executes anything from the data: unknown codecs are refused,
decompressed sizes are bounded by the size the manifest declares.

The pure-Python shuffle runs at a few hundred MB/s; the agent passes a numpy
implementation (:mod:`ckpt_agent.format.shuffle`) through the ``shuffler``
argument.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

import zstandard

from ckpt_agent.errors import CodecError
from ckpt_agent.format.layout import CHUNK_MAX_BYTES

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer as Buffer

__all__ = [
    "CODECS",
    "PY_SHUFFLER",
    "CodecSpec",
    "PyShuffler",
    "Shuffler",
    "check_zstd_frame",
    "decode",
    "encode",
    "zstd_version",
]

CODEC_NONE: Final = "none"
CODEC_ZSTD: Final = "zstd"
#: Every codec this version can decode.
CODECS: Final = frozenset({CODEC_NONE, CODEC_ZSTD})
#: Element sizes the shuffle accepts.
SHUFFLE_SIZES: Final = frozenset({0, 2, 4, 8})


class Shuffler(Protocol):
    """Byte (un)shuffle implementation."""

    def shuffle(self, data: memoryview, itemsize: int) -> Buffer:
        """Shuffled copy of ``data`` (``len(data)`` bytes)."""
        ...

    def unshuffle(self, data: Buffer, itemsize: int, out: memoryview) -> None:
        """Write the unshuffled bytes of ``data`` into ``out`` (same length)."""
        ...


class PyShuffler:
    """Pure-Python byte shuffle (C-speed slicing; ~300 MB/s)."""

    def shuffle(self, data: memoryview, itemsize: int) -> Buffer:
        n = len(data)
        body = n - n % itemsize
        src = bytes(data[:body])
        parts = [src[i::itemsize] for i in range(itemsize)]
        if body != n:
            parts.append(bytes(data[body:]))
        return b"".join(parts)

    def unshuffle(self, data: Buffer, itemsize: int, out: memoryview) -> None:
        src = memoryview(data).cast("B")
        n = len(src)
        if len(out) != n:
            raise CodecError(f"unshuffle: output has {len(out)} bytes, input {n}")
        body = n - n % itemsize
        m = body // itemsize
        tmp = bytearray(body)
        for i in range(itemsize):
            tmp[i::itemsize] = src[i * m : (i + 1) * m]
        out[:body] = tmp
        if body != n:
            out[body:] = src[body:]


PY_SHUFFLER: Final = PyShuffler()


@dataclass(frozen=True)
class CodecSpec:
    """How to encode one blob (and what its manifest entry records)."""

    codec: str = CODEC_ZSTD
    """``none`` or ``zstd``."""
    level: int = 3
    """zstd level (1..22)."""
    shuffle: int = 0
    """Element size for the byte shuffle; 0 = no shuffle."""

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise CodecError(f"unknown codec {self.codec!r}; known: {sorted(CODECS)}")
        if self.shuffle not in SHUFFLE_SIZES:
            raise CodecError(f"shuffle must be one of {sorted(SHUFFLE_SIZES)}, got {self.shuffle}")
        if self.codec == CODEC_NONE and self.shuffle:
            raise CodecError("a byte shuffle needs a compressing codec")
        if self.codec == CODEC_ZSTD and not 1 <= self.level <= 22:
            raise CodecError(f"zstd level must be within 1..22, got {self.level}")

    def to_json(self) -> dict[str, int | str]:
        out: dict[str, int | str] = {"codec": self.codec}
        if self.codec == CODEC_ZSTD:
            out["level"] = self.level
            out["shuffle"] = self.shuffle
        return out

    @classmethod
    def from_json(cls, data: object) -> CodecSpec:
        """Parse a manifest's blob entry (extra keys ignored); raises :class:`CodecError`."""
        if not isinstance(data, dict):
            raise CodecError("blob entry is not an object")
        codec = data.get("codec")
        level = data.get("level", 3)
        shuffle = data.get("shuffle", 0)
        if not isinstance(codec, str):
            raise CodecError("blob entry has no codec")
        if not isinstance(level, int) or not isinstance(shuffle, int):
            raise CodecError("blob entry level/shuffle must be integers")
        if isinstance(level, bool) or isinstance(shuffle, bool):
            raise CodecError("blob entry level/shuffle must be integers")
        return cls(codec=codec, level=level, shuffle=shuffle)


_NONE = CodecSpec(CODEC_NONE, 0, 0)


def zstd_version() -> str:
    return str(zstandard.__version__)


_contexts = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compression context for ``level`` (contexts are reused, never shared
    between threads: one context is not safe to use from two threads at once)."""
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_contexts, "by_level", None)
    if cache is None:
        cache = _contexts.by_level = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=False
        )
    return cctx


def encode(data: memoryview, spec: CodecSpec, shuffler: Shuffler = PY_SHUFFLER) -> Buffer:
    """Encode raw bytes; returns ``data`` itself for ``none`` (no copy).

    Thread-safe (zstd releases the GIL: blobs compress in parallel on the writer's
    threads); the result is a new buffer, never one the shuffler reuses.
    """
    if spec.codec == CODEC_NONE:
        return data
    src: Buffer = data
    if spec.shuffle and len(data) >= spec.shuffle:
        src = shuffler.shuffle(data, spec.shuffle)
    return _compressor(spec.level).compress(memoryview(src))


def decode(
    stored: Buffer,
    spec: CodecSpec,
    raw_size: int,
    out: memoryview | None = None,
    shuffler: Shuffler = PY_SHUFFLER,
) -> memoryview:
    """Decode ``stored`` into exactly ``raw_size`` bytes.

    With ``out`` (a writable byte view of ``raw_size`` bytes) the result is
    written there and ``out`` returned; otherwise a new buffer is returned.
    Raises :class:`CodecError` for a malformed frame or a size mismatch; the
    decompressor never produces more than ``raw_size`` bytes.
    """
    if not 0 <= raw_size <= CHUNK_MAX_BYTES:
        raise CodecError(f"raw size {raw_size} is outside 0..{CHUNK_MAX_BYTES} (the chunk limit)")
    if out is not None and len(out) != raw_size:
        raise CodecError(f"output buffer has {len(out)} bytes, expected {raw_size}")
    view = memoryview(stored).cast("B")
    if spec.codec == CODEC_NONE:
        if len(view) != raw_size:
            raise CodecError(f"stored size {len(view)} != declared raw size {raw_size}")
        if out is None:
            return view
        out[:] = view
        return out
    if spec.codec != CODEC_ZSTD:  # pragma: no cover - CodecSpec refuses it
        raise CodecError(f"unknown codec {spec.codec!r}")
    check_zstd_frame(view, raw_size)
    try:
        raw = zstandard.ZstdDecompressor().decompress(view, max_output_size=raw_size)
    except zstandard.ZstdError as e:
        raise CodecError(f"corrupt zstd data: {e}") from None
    if len(raw) != raw_size:
        raise CodecError(f"decompressed {len(raw)} bytes, manifest says {raw_size}")
    target = out if out is not None else memoryview(bytearray(raw_size))
    if spec.shuffle and raw_size >= spec.shuffle:
        shuffler.unshuffle(raw, spec.shuffle, target)
    else:
        target[:] = raw
    return target


def check_zstd_frame(view: memoryview, raw_size: int) -> None:
    """Refuse (:class:`CodecError`) what is not a zstd frame, or one declaring another size."""
    try:
        params = zstandard.get_frame_parameters(view)
    except zstandard.ZstdError as e:
        raise CodecError(f"not a zstd frame: {e}") from None
    if params.content_size not in (raw_size, zstandard.CONTENTSIZE_UNKNOWN):
        raise CodecError(
            f"zstd frame declares {params.content_size} bytes, manifest says {raw_size}"
        )


def none_spec() -> CodecSpec:
    return _NONE
