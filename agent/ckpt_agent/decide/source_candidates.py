"""Where a rank's state can be read back from after a failure, and how fast (pure, #31).

A :class:`SourceCandidate` is one place holding (part of) one rank's state at one step:
the node's shared memory (``local_memory``), a peer node's replica (``peer_replica``) or
a committed checkpoint (``storage``). :class:`SourceCosts` estimates the read time from
the bytes and a bandwidth and latency per read path, and orders candidates by it
(ties: memory, then a replica, then storage). Memory is fast only where it lives: read
on its own node it is ``local_memory``, from any other node a network read at
``peer_replica`` speed. :mod:`ckpt_agent.decide.recovery_sources` chooses among them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import astuple, dataclass, field
from types import MappingProxyType
from typing import Literal, get_args

from ckpt_agent.records import Json

__all__ = [
    "DEFAULT_LATENCY_S",
    "DEFAULT_READ_GBPS",
    "KINDS",
    "MEMORY_KINDS",
    "Part",
    "SourceCandidate",
    "SourceCosts",
    "SourceKind",
    "SourceVerdict",
]

SourceKind = Literal["local_memory", "peer_replica", "storage"]
SourceVerdict = Literal["verified", "unverified", "corrupted"]
Part = Literal["state", "items"]
"""What is read: the whole state (its bytes) or only the rank's own items (a few KiB)."""
KINDS: tuple[str, ...] = get_args(SourceKind)
"""Fastest first."""
MEMORY_KINDS = ("local_memory", "peer_replica")
_VERDICTS: tuple[str, ...] = get_args(SourceVerdict)

DEFAULT_READ_GBPS = MappingProxyType({"local_memory": 20.0, "peer_replica": 5.0, "storage": 1.0})
"""GB/s per read path: the simulator's (:class:`~ckpt_agent.decide.sim_memory.TierCosts`)."""
DEFAULT_LATENCY_S = MappingProxyType({"local_memory": 1e-3, "peer_replica": 0.01, "storage": 0.05})
"""Seconds to the first byte per read path (orders of magnitude: shm, a LAN, S3 or NFS)."""


@dataclass(frozen=True)
class SourceCandidate:
    """One place that holds (part of) one rank's state at one step."""

    kind: SourceKind
    rank: int
    """The rank whose snapshot or checkpoint part this is."""
    step: int
    location: str
    """The node holding it (memory, replica) or the checkpoint id (storage)."""
    verdict: SourceVerdict = "unverified"
    """``verified``: its hashes checked (a replica on arrival, a checkpoint by the
    validator); ``unverified``: checked while loading; ``corrupted``: never used."""
    nbytes: int = 0
    has_state: bool = True
    """Holds the complete model and optimizer state (a lightweight pulse does not): DDP's
    replicated copy (serves every rank) or, sharded, the shard of :attr:`rank` (serves
    only that rank)."""
    has_rank_items: bool = True
    """Holds :attr:`rank`'s own RNG and data position (a heartbeat: these and no state)."""
    epoch: int = 0
    """The resume lineage epoch it was written in (:class:`~ckpt_agent.records.Lineage`)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.verdict not in _VERDICTS:
            raise ValueError(
                f"recovery source of kind {self.kind!r}, verdict {self.verdict!r}: "
                f"the kind is one of {KINDS}, the verdict one of {_VERDICTS}"
            )
        if self.rank < 0 or self.step < 0 or self.nbytes < 0 or self.epoch < 0:
            raise ValueError(f"{self.label}: rank, step, bytes and epoch are never negative")
        if not self.location:
            raise ValueError(f"{self.kind} source of rank {self.rank}: name its node or checkpoint")
        if not (self.has_state or self.has_rank_items):
            raise ValueError(f"{self.label} holds neither state nor rank items: leave it out")

    @property
    def label(self) -> str:
        """Names it in reasons, Events and report lines."""
        where = "checkpoint" if self.kind == "storage" else "on node"
        return f"rank {self.rank} {self.kind} step {self.step} {where} {self.location}"

    def to_json(self) -> Json:
        """The fields in order (gathered from every rank, handed to the operator)."""
        return list(astuple(self))

    @classmethod
    def from_json(cls, v: Json) -> SourceCandidate:
        if not isinstance(v, list) or len(v) != 9:
            raise ValueError(f"not a recovery source (a list of 9 fields): {v!r}")
        kind, rank, step, loc, verdict, nbytes, state, items, epoch = v
        if not (isinstance(state, bool) and isinstance(items, bool)):
            raise ValueError(f"recovery source {v!r}: has_state and has_rank_items are booleans")
        n = [int(x) for x in (rank, step, nbytes, epoch)]
        return cls(kind, n[0], n[1], str(loc), verdict, n[2], state, items, n[3])


@dataclass(frozen=True)
class SourceCosts:
    """Read bandwidth (GB/s) and first-byte latency (s) per read path.

    Defaults: :data:`DEFAULT_READ_GBPS` (shared memory 20 ≫ a peer over the network 5 ≫
    S3 or NFS 1) and :data:`DEFAULT_LATENCY_S`. Only their order matters for the choice;
    the seconds go into its reason.
    """

    gbps: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_READ_GBPS))
    latency_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_LATENCY_S))

    def __post_init__(self) -> None:
        for kind in KINDS:
            if not self.gbps.get(kind, 0.0) > 0 or not self.latency_s.get(kind, -1.0) >= 0:
                raise ValueError(
                    f"read costs of {kind!r}: give a bandwidth > 0 GB/s and a latency >= 0 s "
                    f"(got {self.gbps.get(kind)!r} and {self.latency_s.get(kind)!r})"
                )

    @staticmethod
    def path(c: SourceCandidate, reader: str | None) -> SourceKind:
        """How ``c`` is read from node ``reader``: memory on the reader's node is local, on
        any other node a network read; None (not placed yet): the candidate's own kind."""
        if c.kind == "storage" or reader is None:
            return c.kind
        return "local_memory" if reader == c.location else "peer_replica"

    def read_seconds(self, c: SourceCandidate, reader: str | None, part: Part = "state") -> float:
        """Estimated seconds to read ``c``'s state (its bytes) or only its rank items."""
        path = self.path(c, reader)
        body = c.nbytes / (self.gbps[path] * 1e9) if part == "state" else 0.0
        return self.latency_s[path] + body

    def order(self, c: SourceCandidate, reader: str | None, part: Part) -> tuple[object, ...]:
        """Sort key, fastest first: read time, read path, kind, verified first, then every
        field (the same order in every process)."""
        return (
            self.read_seconds(c, reader, part),
            KINDS.index(self.path(c, reader)),
            KINDS.index(c.kind),
            _VERDICTS.index(c.verdict),
            c.epoch,
            c.step,
            astuple(c),
        )
