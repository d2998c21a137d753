"""What a snapshot's chunks are: the unit a replica is sent, de-duplicated and verified by.

A snapshot (:class:`~ckpt_agent.flash.protocol.Descriptor`) lays its tensors and files
out in one slot; the persister records the SHA-256 of every ``chunk_bytes`` piece of
each of them (:class:`~ckpt_agent.flash.checksums.RecordedHashes`, the chunks' content
addresses in storage). :func:`plan_chunks` turns both into the list of :class:`Chunk`
(where each lies in the slot, its length and its digest); :class:`Offer` is what a sender
offers a peer (descriptor, hashes, chunk size), checked on arrival.

A stored replica keeps, next to those SHA-256s, the fast checksum of every chunk
(:func:`~ckpt_agent.flash.checksums.fast_checksum`), computed by the receiver from the
bytes it had just verified with SHA-256 (:func:`hashes_doc`, :class:`StoredHashes`): what
the replica is checked with at rest (docs/replicas.md, "What each check protects
against"). Torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ckpt_agent.errors import CheckpointFormatError, ReplicaError
from ckpt_agent.flash.checksums import FAST_SCHEME, fast_checksum
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.format.layout import sha256_hex, validate_run_id

__all__ = [
    "FORMAT_HASHES",
    "Chunk",
    "Offer",
    "StoredHashes",
    "check_disjoint",
    "hashes_doc",
    "parse_hashes_doc",
    "plan_chunks",
]

FORMAT_HASHES: Final = "ckpt-operator.replica-hashes"
_SHA = re.compile(r"[0-9a-f]{64}")
_FAST = re.compile(r"[0-9a-f]{33,48}")


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
        """``data`` is this chunk: its length and SHA-256 (the check against a peer)."""
        return len(data) == self.length and sha256_hex(data) == self.sha256

    def fast_ok(self, data: bytes | bytearray | memoryview, fast: str) -> bool:
        """``data`` still has the fast checksum ``fast`` recorded when it was verified with
        SHA-256 (the check at rest; not one against a peer)."""
        return len(data) == self.length and fast_checksum(data) == fast


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


def check_disjoint(chunks: Sequence[Chunk]) -> None:
    """:class:`ReplicaError` when two chunks overlap in the slot (no writer lays a snapshot
    out so; a received replica's chunks are written and verified side by side)."""
    end, last = 0, ""
    for c in sorted((c for c in chunks if c.length), key=lambda c: c.offset):
        if c.offset < end:
            raise ReplicaError(f"replica chunks overlap: {c.name!r} lies over {last!r}")
        end, last = c.offset + c.length, c.name


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


@dataclass(frozen=True)
class StoredHashes:
    """A stored replica's hash list (:func:`parse_hashes_doc`)."""

    chunk_bytes: int
    sha256: dict[str, list[str]]
    """The SHA-256 of every chunk (the offer's)."""
    fast: dict[str, list[str]] | None
    """The fast checksum of every chunk, recorded on arrival (None: a replica stored
    before they were recorded, or a list that does not cover every chunk)."""


def hashes_doc(offer: Offer, fast: Mapping[str, Sequence[str]] | None = None) -> bytes:
    """The hash list a stored replica keeps next to its data: the per-chunk SHA-256 of the
    offer and, when given, the fast checksum of every chunk as it arrived."""
    doc: dict[str, object] = {
        "format": FORMAT_HASHES,
        "version": 1,
        "seq": offer.desc.seq,
        "chunk_bytes": offer.chunk_bytes,
        "tensors": offer.hashes,
    }
    if fast is not None:
        doc["fast"] = {k: list(v) for k, v in fast.items()}
        doc["fast_scheme"] = FAST_SCHEME
    return json.dumps(doc, sort_keys=True).encode()


def parse_hashes_doc(raw: bytes, what: str) -> StoredHashes:
    """A stored replica's hash list (:class:`CheckpointFormatError` when it is not one; fast
    checksums of another scheme or shape are left out, the SHA-256s are then used)."""
    try:
        d = json.loads(raw)
        if not isinstance(d, dict) or d.get("format") != FORMAT_HASHES:
            raise CheckpointFormatError("not a replica hash list")
        chunk_bytes = d.get("chunk_bytes")
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise CheckpointFormatError("bad chunk_bytes")
        sha = _hash_lists(d.get("tensors"))
    except (ValueError, CheckpointFormatError) as e:
        raise CheckpointFormatError(f"{what}: {e}") from None
    return StoredHashes(chunk_bytes, sha, _fast_lists(d, sha))


def _fast_lists(
    d: Mapping[str, object], sha: Mapping[str, list[str]]
) -> dict[str, list[str]] | None:
    if d.get("fast_scheme") != FAST_SCHEME:
        return None
    try:
        fast = _hash_lists(d.get("fast"))
    except CheckpointFormatError:
        return None
    if fast.keys() != sha.keys() or any(len(fast[k]) != len(v) for k, v in sha.items()):
        return None
    if not all(_FAST.fullmatch(f) for v in fast.values() for f in v):
        return None
    return fast
