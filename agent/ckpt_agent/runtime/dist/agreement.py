"""Multi-rank checkpoints: agreed save decisions and a two-phase commit over ``torch.distributed``.

Two problems, two protocols, both on tensor collectives only (nothing is
pickled: ``torch.distributed``'s object collectives pickle, so every message
here is a JSON document carried in a ``uint8`` tensor, or a float64 vector).

**Agreement** (:class:`DecisionAgreement`, on the training thread, once per step).
Every rank must save the same step with the same tier, or the checkpoint has
parts from different steps. Each step takes two small ``all_gather`` rounds on
a dedicated gloo group (``Comm``):

1. *inputs*: every rank contributes ``[step, loss, grad_norm, gpu_errors,
   write_latency_ms, now, busy, emergency, stop]``. Every rank reduces the
   same table in the same order, so the results are bitwise identical
   everywhere: the loss is the mean over ranks (a NaN anywhere is a NaN for
   all), the gradient norm and the write latency the maximum, GPU errors the
   sum, the clock rank 0's. A rank-local emergency (its save-now file, its
   SIGTERM) becomes an emergency request on *every* rank's scheduler.
   Every scheduler then observes identical inputs.
2. *decisions*: each rank's :class:`~ckpt_agent.decide.scheduler.Decision` is
   all-gathered (JSON), merged with :func:`~ckpt_agent.decide.scheduler.merge_decisions`
   (order-independent: any save, highest tier, max score) and adopted by every
   scheduler. Costs measured per rank (stall, persist) can make intervals
   differ slightly; the merge makes the *decision* identical regardless, and
   the adoption resets every scheduler's counters the same way.

The scheduler state stored in a checkpoint is rank 0's (shared state is
written once) and every rank restores it, so a restart with a different rank
order — or a different world size — starts from one state on all ranks.
Whether each rank's persister is busy travels in round 2 too: a save is
deferred (or waited for) by all ranks or by none.

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

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ckpt_agent.decide.scheduler import AdaptiveScheduler, Decision, SystemSignals, merge_decisions
from ckpt_agent.errors import CommitAbortedError, DistributedError
from ckpt_agent.format.manifest import CheckpointMeta, RankRef
from ckpt_agent.format.parts import verify_part
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource, WrittenCheckpoint, WrittenRank
from ckpt_agent.records import Json

__all__ = [
    "Agreed",
    "Comm",
    "CommitAbortedError",
    "CommitResult",
    "DecisionAgreement",
    "DistributedError",
    "LocalComm",
    "LocalSignals",
    "TwoPhaseCommit",
    "Vote",
    "verify_part",
]

log = logging.getLogger(__name__)


#: Default timeout of the agent's own process groups (a hung rank fails the save after it).
DEFAULT_TIMEOUT_S = 600.0
#: Fixed message size of the decision round (one collective instead of two).
DECISION_BYTES = 4096


# --------------------------------------------------------------------------- collectives


class Comm:
    """Pickle-free collectives over one process group (bytes, JSON, float64 rows).

    Create it with :meth:`new_group` on every rank in the same order (it is a
    collective call); each :class:`Comm` owns its own gloo group, so one
    thread may use it while another thread uses a different one.
    """

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def new_group(cls, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
        """A new gloo group over the default world (collective: every rank calls it)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError(
                "torch.distributed is not initialized: call init_process_group() before "
                "creating a Checkpointer with world_size > 1"
            )
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        return cls(group, dist.get_rank(), dist.get_world_size())

    # ------------------------------------------------------------------ primitives

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.world_size)]
        try:
            dist.all_gather(out, t, group=self.group)
        except RuntimeError as e:
            raise DistributedError(f"all_gather failed (a rank died or hung?): {e}") from e
        return out

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        try:
            dist.broadcast(t, src=self._global(src), group=self.group)
        except RuntimeError as e:
            raise DistributedError(f"broadcast failed (a rank died or hung?): {e}") from e

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return int(dist.get_global_rank(self.group, group_rank))

    def barrier(self) -> None:
        self.all_gather_f64([0.0])

    # ------------------------------------------------------------------ typed helpers

    def all_gather_f64(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's vector (same length on all ranks), in rank order."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        return [r.tolist() for r in self._all_gather(t)]

    def all_gather_bytes(self, data: bytes, *, fixed: int | None = None) -> list[bytes]:
        """Every rank's bytes, in rank order.

        With ``fixed`` one collective of ``fixed + 8`` bytes per rank (the
        message must fit); otherwise the lengths are gathered first.
        """
        if fixed is not None:
            if len(data) > fixed:
                raise ValueError(f"message of {len(data)} bytes exceeds the fixed size {fixed}")
            buf = torch.zeros(fixed + 8, dtype=torch.uint8)
            buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            if data:
                buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            rows = self._all_gather(buf)
            out = []
            for r in rows:
                n = int(r[:8].clone().view(torch.int64).item())
                if not 0 <= n <= fixed:
                    raise DistributedError(f"garbled message length {n}")
                out.append(bytes(r[8 : 8 + n].numpy().tobytes()))
            return out
        lengths = self._all_gather(torch.tensor([len(data)], dtype=torch.int64))
        size = max(int(n.item()) for n in lengths)
        buf = torch.zeros(max(size, 1), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self._all_gather(buf)
        return [
            bytes(r[: int(n.item())].numpy().tobytes()) for r, n in zip(rows, lengths, strict=True)
        ]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``src``'s bytes on every rank (other ranks pass None)."""
        if self.rank == src and data is None:
            raise ValueError("the source rank must pass data")
        n = torch.tensor([len(data) if self.rank == src and data is not None else 0])
        self._broadcast(n, src)
        size = int(n.item())
        buf = torch.zeros(max(size, 1), dtype=torch.uint8)
        if self.rank == src and data:
            buf[:size] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._broadcast(buf, src)
        return bytes(buf[:size].numpy().tobytes())

    def all_gather_json(self, obj: Json, *, fixed: int | None = None) -> list[Json]:
        rows = self.all_gather_bytes(_dumps(obj), fixed=fixed)
        return [json.loads(r) for r in rows]

    def broadcast_tensor(self, t: torch.Tensor, src: int = 0) -> None:
        """``src``'s tensor into ``t`` on every rank (same shape and dtype everywhere)."""
        self._broadcast(t, src)

    def broadcast_json(self, obj: Json, src: int = 0) -> Json:
        data = _dumps(obj) if self.rank == src else None
        return json.loads(self.broadcast_bytes(data, src))


class LocalComm(Comm):
    """The trivial world of one rank (no torch.distributed needed)."""

    def __init__(self) -> None:
        super().__init__(None, 0, 1)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone()]

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        del t, src

    def _global(self, group_rank: int) -> int:
        return group_rank


def _dumps(obj: Json) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


# --------------------------------------------------------------------------- agreement


@dataclass(frozen=True)
class LocalSignals:
    """One rank's inputs to the agreement at one step."""

    step: int
    loss: float
    grad_norm: float | None = None
    system: SystemSignals = field(default_factory=SystemSignals)
    busy: bool = False
    """This rank cannot take a snapshot right now (its persister still owns the buffers)."""
    emergency: bool = False
    """This rank wants an emergency save (its save-now signal, its SIGTERM)."""
    stop: bool = False
    """This rank received SIGTERM: every rank saves and stops."""


@dataclass(frozen=True)
class Agreed:
    """The decision every rank acts on, and what the agreement learned on the way."""

    decision: Decision
    any_busy: bool
    busy_ranks: tuple[int, ...]
    emergency_ranks: tuple[int, ...]
    stop: bool
    stop_ranks: tuple[int, ...]
    loss: float
    """The global loss the schedulers observed (mean over ranks)."""
    grad_norm: float | None
    per_rank: tuple[Decision, ...]


_NAN = float("nan")
_F_STEP, _F_LOSS, _F_GRAD, _F_HAS_GRAD, _F_GPU, _F_LAT, _F_NOW, _F_BUSY, _F_EMERG, _F_STOP = range(
    10
)
_F_WARN = 10
_ROW = 11


def _opt(x: float | None) -> float:
    return _NAN if x is None else float(x)


class DecisionAgreement:
    """Agree on every step's save decision (see the module doc)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.rounds = 0
        self.seconds = 0.0

    def agree(
        self, scheduler: AdaptiveScheduler, local: LocalSignals, *, now: float | None = None
    ) -> Agreed:
        t0 = time.perf_counter()
        now = time.time() if now is None else now
        sys_ = local.system
        row = [0.0] * _ROW
        row[_F_STEP] = float(local.step)
        row[_F_LOSS] = float(local.loss)
        row[_F_GRAD] = _opt(local.grad_norm)
        row[_F_HAS_GRAD] = 0.0 if local.grad_norm is None else 1.0
        row[_F_GPU] = _opt(None if sys_.gpu_errors is None else float(sys_.gpu_errors))
        row[_F_LAT] = _opt(sys_.write_latency_ms)
        row[_F_NOW] = now
        row[_F_BUSY] = 1.0 if local.busy else 0.0
        row[_F_EMERG] = 1.0 if local.emergency else 0.0
        row[_F_STOP] = 1.0 if local.stop else 0.0
        row[_F_WARN] = 1.0 if sys_.node_warning else 0.0
        rows = self.comm.all_gather_f64(row)
        steps = sorted({int(r[_F_STEP]) for r in rows})
        if len(steps) != 1:
            raise DistributedError(
                f"ranks are at different steps {steps}: call step() at every step on every rank"
            )
        n = len(rows)
        loss = sum(r[_F_LOSS] for r in rows) / n  # same order on every rank: bitwise equal
        grads = [r[_F_GRAD] for r in rows if r[_F_HAS_GRAD]]
        grad: float | None = None
        if grads:  # a non-finite norm anywhere is the global norm (the anomaly is global)
            bad = [g for g in grads if not math.isfinite(g)]
            grad = bad[0] if bad else max(grads)
        gpus = [r[_F_GPU] for r in rows if not math.isnan(r[_F_GPU])]
        lats = [r[_F_LAT] for r in rows if not math.isnan(r[_F_LAT])]
        warned = [i for i, r in enumerate(rows) if r[_F_WARN]]
        system = SystemSignals(
            gpu_errors=int(sum(gpus)) if gpus else None,
            write_latency_ms=max(lats) if lats else None,
            node_warning=f"node warning on rank(s) {warned}" if warned else None,
        )
        emergency = tuple(i for i, r in enumerate(rows) if r[_F_EMERG])
        stop = tuple(i for i, r in enumerate(rows) if r[_F_STOP])
        if emergency or stop:
            who = sorted(set(emergency) | set(stop))
            what = "SIGTERM" if stop else "save-now"
            scheduler.request_emergency(f"{what} on rank(s) {who}")
        decision = scheduler.observe(local.step, loss, grad, system=system, now=rows[0][_F_NOW])
        # Round 2: decisions and busy flags; merge, adopt.
        mine = {"d": _fit(decision.to_dict()), "busy": local.busy}
        gathered = self.comm.all_gather_json(mine, fixed=DECISION_BYTES)
        per_rank = tuple(Decision.from_dict(g["d"]) for g in gathered)
        merged = merge_decisions(per_rank)
        scheduler.adopt(merged)
        busy = tuple(i for i, g in enumerate(gathered) if g.get("busy"))
        self.rounds += 1
        self.seconds += time.perf_counter() - t0
        return Agreed(
            decision=merged,
            any_busy=bool(busy),
            busy_ranks=busy,
            emergency_ranks=emergency,
            stop=bool(stop),
            stop_ranks=stop,
            loss=loss,
            grad_norm=grad,
            per_rank=per_rank,
        )


def _fit(d: dict[str, Any]) -> dict[str, Any]:
    """A decision dict whose JSON fits :data:`DECISION_BYTES` (long reasons are cut)."""
    if len(_dumps(d)) + 64 <= DECISION_BYTES:
        return d
    out = dict(d)
    out["reason"] = str(out.get("reason", ""))[:1024] + "…"
    return out


# --------------------------------------------------------------------------- two-phase commit


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
            log.error("rank %d: writing its part of %s failed: %s", rank, ckpt_id, e)
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
                log.error("coordinator: %s not committed: %s", ckpt_id, e)
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
