"""A rank manifest's entries: the stored blobs and the tensors made of them.

:class:`BlobEntry` is one stored chunk of raw bytes (its SHA-256, size and
codec); :class:`TensorEntry` is one tensor (dtype, shape, byte order) and the
blobs it is cut into. Torch-free; the rank manifest that lists them is
:mod:`ckpt_agent.format.manifest`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from ckpt_agent.errors import CheckpointFormatError, CodecError
from ckpt_agent.format.codec import CodecSpec
from ckpt_agent.format.layout import (
    BLOB_MAX_BYTES,
    CHUNK_MAX_BYTES,
    DTYPE_ITEMSIZE,
    TENSOR_MAX_BYTES,
    TENSOR_MAX_DIMS,
    TENSOR_MAX_ELEMENTS,
)
from ckpt_agent.format.schema import digest_field, nonneg_field, required_field
from ckpt_agent.records import Json

__all__ = ["BlobEntry", "TensorEntry"]


@dataclass(frozen=True)
class BlobEntry:
    """One stored blob: a chunk of a tensor's raw bytes, encoded by ``codec``."""

    digest: str
    """SHA-256 of the stored bytes (its key in the blob store)."""
    size: int
    """Stored bytes."""
    raw_sha256: str
    """SHA-256 of the decoded (raw) bytes: the identity used for de-duplication."""
    raw_size: int
    """Decoded bytes."""
    codec: CodecSpec
    """How it was encoded."""
    raw_blake3: str | None = None
    """BLAKE3-256 of the decoded bytes, where the writer had the ``blake3`` package: the
    restore's check of every byte it uses (as strong as SHA-256, several times faster)."""

    def to_json(self) -> dict[str, Json]:
        return {
            "size": self.size,
            "raw_sha256": self.raw_sha256,
            "raw_size": self.raw_size,
            **({} if self.raw_blake3 is None else {"raw_blake3": self.raw_blake3}),
            **self.codec.to_json(),
        }

    @classmethod
    def from_json(cls, digest: str, d: Json, what: str) -> BlobEntry:
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{what}: blob entry is not an object")
        try:
            codec = CodecSpec.from_json(d)
        except CodecError as e:
            raise CheckpointFormatError(f"{what}: {e}") from None
        entry = cls(
            digest=digest_field(digest, what),
            size=nonneg_field(d.get("size"), f"{what}.size"),
            raw_sha256=digest_field(d.get("raw_sha256"), f"{what}.raw_sha256"),
            raw_size=nonneg_field(d.get("raw_size"), f"{what}.raw_size"),
            codec=codec,
            raw_blake3=None
            if d.get("raw_blake3") is None
            else digest_field(d.get("raw_blake3"), f"{what}.raw_blake3"),
        )
        if entry.raw_size > CHUNK_MAX_BYTES or entry.size > BLOB_MAX_BYTES:
            raise CheckpointFormatError(
                f"{what}: a chunk of {entry.raw_size} bytes ({entry.size} stored); "
                f"the format's chunks hold at most {CHUNK_MAX_BYTES}"
            )
        if codec.codec == "none" and (
            entry.size != entry.raw_size or entry.raw_sha256 != entry.digest
        ):
            raise CheckpointFormatError(
                f"{what}: an uncompressed blob whose stored and raw size or hash differ"
            )
        return entry


@dataclass(frozen=True)
class TensorEntry:
    """A tensor (or file) in a rank manifest: dtype, shape and where its bytes are."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    byte_order: str = "little"
    chunks: tuple[str, ...] = ()
    """Blob digests, in order; their raw bytes concatenate to the tensor's bytes."""
    inline: bytes | None = None
    """Small tensors live in the manifest itself."""
    inline_sha256: str | None = None

    def to_json(self) -> dict[str, Json]:
        out: dict[str, Json] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "byte_order": self.byte_order,
        }
        if self.inline is not None:
            out["inline"] = base64.b64encode(self.inline).decode("ascii")
            out["sha256"] = self.inline_sha256
        else:
            out["chunks"] = list(self.chunks)
        return out

    @classmethod
    def from_json(cls, d: Json, what: str) -> TensorEntry:
        if not isinstance(d, dict):
            raise CheckpointFormatError(f"{what}: not an object")
        dtype = required_field(d, "dtype", str, what)
        if dtype not in DTYPE_ITEMSIZE:
            raise CheckpointFormatError(f"{what}: unknown dtype {dtype!r}")
        shape_raw = required_field(d, "shape", list, what)
        if len(shape_raw) > TENSOR_MAX_DIMS:
            raise CheckpointFormatError(f"{what}: more than {TENSOR_MAX_DIMS} dimensions")
        shape = tuple(nonneg_field(s, f"{what}.shape") for s in shape_raw)
        nbytes = nonneg_field(d.get("nbytes"), f"{what}.nbytes")
        numel = 1
        for s in shape:
            numel *= s
        if max(shape, default=0) > TENSOR_MAX_ELEMENTS or numel > TENSOR_MAX_ELEMENTS:
            raise CheckpointFormatError(
                f"{what}: shape {list(shape)} is over the format's {TENSOR_MAX_ELEMENTS} elements"
            )
        if nbytes > TENSOR_MAX_BYTES:
            raise CheckpointFormatError(f"{what}: over the format's {TENSOR_MAX_BYTES} bytes")
        if numel * DTYPE_ITEMSIZE[dtype] != nbytes:
            raise CheckpointFormatError(
                f"{what}: nbytes {nbytes} does not match shape {list(shape)} of {dtype}"
            )
        order = d.get("byte_order", "little")
        if order not in ("little", "big"):
            raise CheckpointFormatError(f"{what}: byte_order must be little or big")
        if "inline" in d:
            b64 = required_field(d, "inline", str, what)
            try:
                data = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise CheckpointFormatError(f"{what}: inline data is not base64") from None
            if len(data) != nbytes:
                raise CheckpointFormatError(
                    f"{what}: inline data has {len(data)} bytes, not {nbytes}"
                )
            return cls(
                dtype=dtype,
                shape=shape,
                nbytes=nbytes,
                byte_order=order,
                inline=data,
                inline_sha256=digest_field(d.get("sha256"), f"{what}.sha256"),
            )
        chunks = required_field(d, "chunks", list, what)
        return cls(
            dtype=dtype,
            shape=shape,
            nbytes=nbytes,
            byte_order=order,
            chunks=tuple(digest_field(c, f"{what}.chunks") for c in chunks),
        )
