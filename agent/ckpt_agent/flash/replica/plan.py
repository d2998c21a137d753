"""What a snapshot's chunks are: the unit a replica is sent, de-duplicated and verified by.

A snapshot (:class:`~ckpt_agent.flash.protocol.Descriptor`) lays its tensors and files
out in one slot; the persister records the SHA-256 of every ``chunk_bytes`` piece of
each of them (:class:`~ckpt_agent.flash.checksums.RecordedHashes`, the chunks' content
addresses in storage). :func:`plan_chunks` turns both into the list of :class:`Chunk`
(where each lies in the slot, its length and its digest); :class:`Offer` is what a sender
offers a peer (descriptor, hashes, chunk size), checked on arrival. Torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ckpt_agent.errors import CheckpointFormatError, ReplicaError
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.format.layout import sha256_hex, validate_run_id

__all__ = ["FORMAT_HASHES", "Chunk", "Offer", "hashes_doc", "parse_hashes_doc", "plan_chunks"]

FORMAT_HASHES: Final = "ckpt-operator.replica-hashes"
_SHA = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Chunk:
    """One chunk of a snapshot: ``length`` bytes at ``offset`` in the slot."""

    index: int
    """Its position in the plan (what the wire names it by)."""
    name: str
    part: int
    offset: int
    length: int
    sha256: str

    def ok(self, data: bytes | bytearray | memoryview) -> bool:
        return len(data) == self.length and sha256_hex(data) == self.sha256


def plan_chunks(
    desc: Descriptor, hashes: Mapping[str, Sequence[str]], chunk_bytes: int
) -> list[Chunk]:
    """Every chunk of every tensor and file of ``desc`` (tensors, then files, by name).

    Raises :class:`ReplicaError` when the hashes do not cover the snapshot exactly (a
    name missing or extra, the wrong number of chunks, a malformed digest).
    """
    if chunk_bytes <= 0:
        raise ReplicaError(f"replica chunk size {chunk_bytes} must be positive")
    where = {**desc.tensors, **desc.files}
    extra = sorted(set(hashes) - set(where))
    if extra:
        raise ReplicaError(f"replica hashes name {extra[:3]} which the snapshot does not hold")
    out: list[Chunk] = []
    names = [*sorted(desc.tensors), *sorted(set(desc.files) - set(desc.tensors))]
    for name in names:
        t = where[name]
        digests = hashes.get(name)
        count = max(1, -(-t.nbytes // chunk_bytes))
        if digests is None or len(digests) != count:
            raise ReplicaError(
                f"replica hashes of {name!r}: {0 if digests is None else len(digests)} chunk "
                f"digests for {t.nbytes} bytes in {chunk_bytes}-byte chunks ({count} expected); "
                "were they recorded at another chunk size?"
            )
        for part, digest in enumerate(digests):
            if not isinstance(digest, str) or not _SHA.fullmatch(digest):
                raise ReplicaError(f"replica hashes of {name!r}: {digest!r} is not a SHA-256")
            start = part * chunk_bytes
            length = min(chunk_bytes, t.nbytes - start)
            out.append(Chunk(len(out), name, part, t.offset + start, length, digest))
    return out


@dataclass(frozen=True)
class Offer:
    """What a sender offers a peer: one rank's complete snapshot, by digest."""

    source: str
    """The sending node's name (the replica's folder on the receiver)."""
    desc: Descriptor
    hashes: dict[str, list[str]]
    chunk_bytes: int

    def __post_init__(self) -> None:
        validate_run_id(self.source)

    def chunks(self) -> list[Chunk]:
        return plan_chunks(self.desc, self.hashes, self.chunk_bytes)

    def to_header(self) -> dict[str, object]:
        return {
            "t": "offer",
            "source": self.source,
            "chunk_bytes": self.chunk_bytes,
            "descriptor": self.desc.to_bytes().decode(),
            "hashes": {k: list(v) for k, v in self.hashes.items()},
        }

    @classmethod
    def from_header(cls, header: Mapping[str, object]) -> Offer:
        """The offer in a received header (every field checked; :class:`ReplicaError`)."""
        try:
            raw = header.get("descriptor")
            if not isinstance(raw, str):
                raise CheckpointFormatError("no descriptor")
            desc = Descriptor.from_bytes(raw.encode(), "offered descriptor")
            hashes = _hash_lists(header.get("hashes"))
            chunk_bytes = header.get("chunk_bytes")
            if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool):
                raise CheckpointFormatError("chunk_bytes is not an integer")
            offer = cls(str(header.get("source")), desc, hashes, chunk_bytes)
        except (CheckpointFormatError, ValueError) as e:
            raise ReplicaError(f"malformed replica offer: {e}") from None
        offer.chunks()  # the hashes cover the snapshot exactly
        return offer


def _hash_lists(raw: object) -> dict[str, list[str]]:
    if not isinstance(raw, dict) or not all(isinstance(v, list) for v in raw.values()):
        raise CheckpointFormatError("hashes are not lists of digests by name")
    return {str(k): [str(h) for h in v] for k, v in raw.items()}


def hashes_doc(offer: Offer) -> bytes:
    """The per-chunk SHA-256 list a stored replica keeps next to its data."""
    return json.dumps(
        {
            "format": FORMAT_HASHES,
            "version": 1,
            "seq": offer.desc.seq,
            "chunk_bytes": offer.chunk_bytes,
            "tensors": offer.hashes,
        },
        sort_keys=True,
    ).encode()


def parse_hashes_doc(raw: bytes, what: str) -> tuple[int, dict[str, list[str]]]:
    """(chunk size, hashes by name) of a stored replica's hash list."""
    try:
        d = json.loads(raw)
        if not isinstance(d, dict) or d.get("format") != FORMAT_HASHES:
            raise CheckpointFormatError("not a replica hash list")
        chunk_bytes = d.get("chunk_bytes")
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise CheckpointFormatError("bad chunk_bytes")
        return chunk_bytes, _hash_lists(d.get("tensors"))
    except (ValueError, CheckpointFormatError) as e:
        raise CheckpointFormatError(f"{what}: {e}") from None
