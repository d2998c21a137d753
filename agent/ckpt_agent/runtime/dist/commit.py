"""Multi-rank checkpoints: a two-phase commit, so a checkpoint holds every rank's part or is
not there (:class:`TwoPhaseCommit`).

**Two-phase commit** (:class:`TwoPhaseCommit`, on the persister thread, on its
own gloo group so that it never interleaves with the training thread's
collectives):

1. *prepare*: each rank writes its part (blobs, then ``rank_<r>.json``) and
   verifies it: the manifest is read back and hashed, every blob it
   references exists with its recorded size. Its vote (ok/error, the
   manifest's SHA-256 and size, byte counts) is all-gathered.
2. *commit*: the coordinator (rank 0) checks that every rank voted yes for
   the same checkpoint id, re-reads every rank manifest from storage and
   compares it with the hash its rank announced, and only then publishes
   ``COMMIT`` (listing every rank manifest with its hash). The outcome (the
   COMMIT's hash, or why there is none) is broadcast.

A rank that dies mid-save (SIGKILL, OOM) makes the collective fail on every
other rank (gloo notices the closed connection; a hung rank hits the group's
timeout): no COMMIT is published, the folder does not exist for readers, and
the previous checkpoint stays the newest valid one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckpt_agent.errors import CommitAbortedError
from ckpt_agent.format.manifest import CheckpointMeta, RankRef
from ckpt_agent.format.parts import verify_part
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource, WrittenCheckpoint, WrittenRank
from ckpt_agent.records import Json
from ckpt_agent.runtime.dist.comm import Comm
from ckpt_agent.text import clean

__all__ = ["CommitResult", "TwoPhaseCommit", "Vote"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Vote:
    """One rank's answer to phase 1 (JSON on the wire)."""

    rank: int
    checkpoint_id: str
    ok: bool
    error: str = ""
    ref: RankRef | None = None
    bytes_new: int = 0
    bytes_reused: int = 0
    blobs_new: int = 0
    blobs_reused: int = 0
    raw_bytes: int = 0

    def to_json(self) -> dict[str, Json]:
        return {
            "rank": self.rank,
            "checkpoint_id": self.checkpoint_id,
            "ok": self.ok,
            "error": self.error[:2000],
            "ref": None if self.ref is None else self.ref.to_json(),
            "bytes_new": self.bytes_new,
            "bytes_reused": self.bytes_reused,
            "blobs_new": self.blobs_new,
            "blobs_reused": self.blobs_reused,
            "raw_bytes": self.raw_bytes,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Json]) -> Vote:
        ref = d.get("ref")
        return cls(
            rank=int(d["rank"]),
            checkpoint_id=str(d["checkpoint_id"]),
            ok=bool(d["ok"]),
            error=str(d.get("error") or ""),
            ref=None
            if not isinstance(ref, dict)
            else RankRef(
                rank=int(ref["rank"]),
                key=str(ref["key"]),
                sha256=str(ref["sha256"]),
                size=int(ref["size"]),
            ),
            bytes_new=int(d.get("bytes_new", 0)),
            bytes_reused=int(d.get("bytes_reused", 0)),
            blobs_new=int(d.get("blobs_new", 0)),
            blobs_reused=int(d.get("blobs_reused", 0)),
            raw_bytes=int(d.get("raw_bytes", 0)),
        )


@dataclass
class CommitResult:
    """What :meth:`TwoPhaseCommit.run` did (on every rank)."""

    checkpoint_id: str
    manifest_hash: str
    written: WrittenRank
    """This rank's part."""
    checkpoint: WrittenCheckpoint | None = None
    """The committed checkpoint (coordinator only)."""
    votes: list[Vote] = field(default_factory=list)
    size_bytes: int = 0
    """Bytes the checkpoint added to storage, all ranks (new blobs + manifests)."""
    timings: dict[str, float] = field(default_factory=dict)


class TwoPhaseCommit:
    """Write this rank's part, vote, and let the coordinator publish COMMIT (module doc).

    Every rank calls :meth:`run` for the same checkpoint, in the same order
    (the persister thread of each rank, on its own :class:`Comm`).
    """

    def __init__(
        self,
        comm: Comm,
        writer: CheckpointWriter,
        *,
        coordinator: int = 0,
    ) -> None:
        self.comm = comm
        self.writer = writer
        self.coordinator = coordinator

    @property
    def is_coordinator(self) -> bool:
        return self.comm.rank == self.coordinator

    def run(
        self,
        meta: CheckpointMeta,
        state: Json,
        tensors: Sequence[TensorSource],
        files: Mapping[str, bytes] | None = None,
    ) -> CommitResult:
        """Both phases; returns on every rank once COMMIT is published, else raises.

        Raises :class:`CommitAbortedError` when any rank failed (its error is in the
        message), :class:`DistributedError` when a rank died or hung.
        """
        storage, run_id = self.writer.storage, self.writer.run_id
        ckpt_id = meta.checkpoint_id
        rank = self.comm.rank
        if meta.world_size != self.comm.world_size:
            raise ValueError(
                f"meta.world_size {meta.world_size} != world size {self.comm.world_size}"
            )
        t0 = time.perf_counter()
        # ---- phase 1: write and verify this rank's part
        written: WrittenRank | None = None
        vote: Vote
        try:
            written = self.writer.write_rank(meta, rank, state, tensors, files)
            verify_part(storage, run_id, ckpt_id, written.ref)
            vote = Vote(
                rank=rank,
                checkpoint_id=ckpt_id,
                ok=True,
                ref=written.ref,
                bytes_new=written.bytes_new,
                bytes_reused=written.bytes_reused,
                blobs_new=written.blobs_new,
                blobs_reused=written.blobs_reused,
                raw_bytes=written.raw_bytes,
            )
        except Exception as e:  # any failure is a "no" vote: the others must not hang
            log.error("rank %d: writing its part of %s failed: %s", rank, ckpt_id, clean(e))
            vote = Vote(
                rank=rank, checkpoint_id=ckpt_id, ok=False, error=f"{type(e).__name__}: {e}"
            )
        t1 = time.perf_counter()
        votes = [Vote.from_json(v) for v in self.comm.all_gather_json(vote.to_json())]
        t2 = time.perf_counter()
        # ---- phase 2: the coordinator checks every part and publishes COMMIT
        checkpoint: WrittenCheckpoint | None = None
        outcome: dict[str, Json] = {}
        if self.is_coordinator:
            try:
                assert written is not None or not vote.ok
                checkpoint = self._commit(meta, votes, written)
                outcome = {
                    "ok": True,
                    "manifest_hash": checkpoint.manifest_hash,
                    "size_bytes": checkpoint.size_bytes,
                }
            except Exception as e:  # whatever it is, the others learn it (no hang)
                log.error("coordinator: %s not committed: %s", ckpt_id, clean(e))
                outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
        outcome = self.comm.broadcast_json(
            outcome if self.is_coordinator else None, src=self.coordinator
        )
        t3 = time.perf_counter()
        if not outcome.get("ok"):
            raise CommitAbortedError(f"{ckpt_id} was not committed: {outcome.get('error')}")
        assert written is not None  # a failed part makes the coordinator refuse
        if not self.is_coordinator:
            self.writer.index.seed(written.manifest)
        return CommitResult(
            checkpoint_id=ckpt_id,
            manifest_hash=str(outcome["manifest_hash"]),
            written=written,
            checkpoint=checkpoint,
            votes=votes,
            size_bytes=int(outcome.get("size_bytes", 0)),
            timings={"write_s": t1 - t0, "vote_s": t2 - t1, "commit_s": t3 - t2},
        )

    def _commit(
        self, meta: CheckpointMeta, votes: list[Vote], own: WrittenRank | None
    ) -> WrittenCheckpoint:
        ckpt_id = meta.checkpoint_id
        world = self.comm.world_size
        bad = [v for v in votes if not v.ok]
        if bad:
            raise CommitAbortedError(
                "; ".join(f"rank {v.rank} failed its part: {v.error}" for v in bad[:4])
            )
        ids = {v.checkpoint_id for v in votes}
        if ids != {ckpt_id}:
            raise CommitAbortedError(f"ranks wrote different checkpoints: {sorted(ids)}")
        if sorted(v.rank for v in votes) != list(range(world)):
            raise CommitAbortedError(f"votes from ranks {sorted(v.rank for v in votes)}")
        parts: list[WrittenRank] = []
        storage, run_id = self.writer.storage, self.writer.run_id
        for v in sorted(votes, key=lambda x: x.rank):
            assert v.ref is not None
            if v.rank == self.comm.rank and own is not None:
                manifest = own.manifest
                if own.ref != v.ref:
                    raise CommitAbortedError("own vote differs from own part")
                verify_part(storage, run_id, ckpt_id, v.ref)
            else:
                manifest = verify_part(storage, run_id, ckpt_id, v.ref)
            if manifest.meta.world_size != world:
                raise CommitAbortedError(
                    f"rank {v.rank}'s manifest says world size {manifest.meta.world_size}"
                )
            parts.append(
                WrittenRank(
                    manifest=manifest,
                    ref=v.ref,
                    bytes_new=v.bytes_new,
                    bytes_reused=v.bytes_reused,
                    blobs_new=v.blobs_new,
                    blobs_reused=v.blobs_reused,
                    raw_bytes=v.raw_bytes,
                )
            )
        return self.writer.commit(meta, parts)
