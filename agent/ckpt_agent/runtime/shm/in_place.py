"""In-place restarts from shared memory, on one rank or many: :class:`InPlaceRestore`.

After a process crash on a node that survives, every rank's shared-memory area
(:mod:`ckpt_agent.flash.protocol`) may still hold its newest snapshots, already
hashed by the persister. A restart restores them — no storage read — when all
of this holds, agreed by every rank (three small all-gathers on the agent's
control group; none with a single rank):

1. *offers*: each rank lists its complete snapshots with recorded hashes; rank 0
   adds storage's newest usable step and whether a resume source was requested
   (``CKPT_RESUME_FROM``, ``RECOVER.json``: then never memory).
   :func:`~ckpt_agent.decide.inplace.choose_inplace` picks the newest save (one
   save token) that every rank holds, at least as new as storage's newest.
2. *checks*: each rank copies its snapshot out of shared memory (one copy per
   section, never a view of the area) and checks the copy against the recorded
   checksums; rank > 0 needs rank 0's shared state too: it copies and checks it
   from rank 0's area when that is on the same node, else rank 0 broadcasts its
   checked copy (tensor broadcasts, nothing pickled) and the rank checks what it
   received. Rank 0's snapshot must also fit the live model. One failure
   anywhere: every rank resumes from storage.
3. *apply*: each rank applies the state (:meth:`Restorer.restore`); if that
   fails anywhere, every rank resumes from storage, whose restore overwrites
   whatever was applied.

A just-in-time save (:mod:`ckpt_agent.runtime.shm.jit`) is the one save some ranks may
lack: the survivors of a rank that died mid-step wrote it with the whole replicated state.
Every rank also offers its step mark (the step heartbeat's step and lineage epoch); the
choice takes such a save when every rank without it marked that very step. The replicated
state then comes from the first rank holding it (the *source*: read from its area on this
node, else broadcast by it), a survivor's RNG and data position from its own snapshot, a
dead rank's from its step heartbeat.

Exactly once, never a mix: every rank restores the same save from memory, or
every rank goes to storage. :func:`resume_from_memory` is what
:meth:`Checkpointer.start <ckpt_agent.runtime.checkpointer.Checkpointer.start>` runs with
shared memory: the snapshots a dead trainer left are persisted first, then the protocol
above. What the save side continues from (the chain's previous link, the lineage) comes
back in the :class:`~ckpt_agent.runtime.restore.resume_point.ResumePoint`, nothing is
written into the engine.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from ckpt_agent import tuning
from ckpt_agent.decide.inplace import (
    InplaceChoice,
    ShmOffer,
    StepMark,
    all_usable,
    choose_inplace,
)
from ckpt_agent.errors import CandidateRejectedError, CheckpointFormatError
from ckpt_agent.flash.checksums import RecordedHashes
from ckpt_agent.flash.protocol import Descriptor
from ckpt_agent.flash.reader import ShmReader, ShmSnapshot, verify_views
from ckpt_agent.flash.step_heartbeat import StepHeartbeat, read_step_heartbeat
from ckpt_agent.format.entries import TensorEntry
from ckpt_agent.format.manifest import CheckpointMeta, RankManifest, lineage_from_json
from ckpt_agent.format.parallel_read import restore_workers
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Json
from ckpt_agent.runtime.core.context import Engine
from ckpt_agent.runtime.core.serialization import LoadedState, torch_dtype
from ckpt_agent.runtime.dist.rank_group import RankGroup
from ckpt_agent.runtime.restore.restorer import Restorer
from ckpt_agent.runtime.restore.resume_point import Candidate, ResumePoint
from ckpt_agent.runtime.shm.target import FlashTarget
from ckpt_agent.storage.memory import populate
from ckpt_agent.text import clean

__all__ = ["InPlaceRestore", "ShmCopy", "copy_snapshot", "shm_offers"]

log = logging.getLogger(__name__)


@dataclass
class ShmCopy:
    """A checked copy of one rank's snapshot: per-section buffers and tensor views of them."""

    desc: Descriptor
    hashes: RecordedHashes
    buffers: list[torch.Tensor]
    """One uint8 buffer per section region (:func:`regions`), in order."""
    arrays: dict[str, torch.Tensor]
    files: dict[str, bytes]


def shm_offers(reader: ShmReader) -> list[ShmOffer]:
    """This rank's complete snapshots whose hashes the persister recorded (not checked yet)."""
    out = []
    for desc in reader.complete():
        if reader.hashes(desc.slot, desc.seq) is None:
            continue
        token = desc.meta.get("token")
        try:
            epoch = lineage_from_json(desc.meta.get("lineage"), "snapshot lineage").epoch
        except CheckpointFormatError:
            continue
        if isinstance(token, str) and token:
            jit = desc.jit
            out.append(ShmOffer(desc.step, token, desc.seq, desc.world_size, epoch, jit))
    return out


def step_mark(reader: ShmReader) -> StepHeartbeat | None:
    """This rank's step heartbeat (``jitSave``), read and checked (None: none intact)."""
    return read_step_heartbeat(reader.dir)


def regions(desc: Descriptor) -> list[tuple[int, int, list[str]]]:
    """(start, end, tensor names) of each section's bytes in the slot (sections are laid out
    one after the other): one copy per region, and the buffer freed with its last tensor."""
    groups: dict[str, list[str]] = {}
    for name in desc.tensors:
        groups.setdefault(name.split("/", 1)[0], []).append(name)
    out = []
    for names in groups.values():
        lo = min(desc.tensors[n].offset for n in names)
        hi = max(desc.tensors[n].offset + desc.tensors[n].nbytes for n in names)
        out.append((lo, hi, names))
    return out


def _arrays(desc: Descriptor, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    arrays: dict[str, torch.Tensor] = {}
    for (lo, _, names), buf in zip(regions(desc), buffers, strict=True):
        for name in names:
            t = desc.tensors[name]
            raw = buf[t.offset - lo : t.offset - lo + t.nbytes]
            arrays[name] = raw.view(torch_dtype(t.dtype)).reshape(t.shape)
    return arrays


def _check(copy: ShmCopy) -> list[str]:
    """Problems of the copy (its bytes against the recorded checksums)."""
    views: dict[str, memoryview] = {}
    for (lo, _, names), buf in zip(regions(copy.desc), copy.buffers, strict=True):
        mv = buf.numpy().data if buf.numel() else memoryview(b"")
        for name in names:
            t = copy.desc.tensors[name]
            views[name] = mv[t.offset - lo : t.offset - lo + t.nbytes]
    views.update({name: memoryview(data) for name, data in copy.files.items()})
    return verify_views(views, copy.hashes)


def copy_snapshot(reader: ShmReader, desc: Descriptor) -> tuple[ShmCopy | None, str]:
    """Copy ``desc`` out of shared memory and check the copy; (None, why) when unusable."""
    hashes = reader.hashes(desc.slot, desc.seq)
    if hashes is None:
        return None, f"no recorded hashes for snapshot {desc.seq} of rank {desc.rank}"
    with reader.open(desc) as snap:
        if snap is None:
            return None, f"snapshot {desc.seq} of rank {desc.rank} is gone or being rewritten"
        buffers = _copy_regions(snap)
        files = {name: bytes(snap.file(name)) for name in desc.files}
    copy = ShmCopy(desc, hashes, buffers, _arrays(desc, buffers), files)
    problems = _check(copy)
    if problems:
        return None, f"snapshot of step {desc.step} (rank {desc.rank}): " + "; ".join(problems[:3])
    return copy, ""


def _copy_regions(snap: ShmSnapshot) -> list[torch.Tensor]:
    """Each section's bytes copied out of the slot into fresh memory, in chunk-sized pieces
    on the restore's threads (:func:`restore_workers`: copies and page faults release the
    GIL), each piece's pages faulted in at once first (:func:`populate`)."""
    out: list[torch.Tensor] = []
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for lo, hi, _ in regions(snap.desc):
        buf = torch.empty(hi - lo, dtype=torch.uint8)
        out.append(buf)
        dst = buf.numpy()
        for start in range(0, hi - lo, tuning.CHUNK_BYTES):
            n = min(tuning.CHUNK_BYTES, hi - lo - start)
            src = np.frombuffer(snap.view, dtype=np.uint8, count=n, offset=lo + start)
            pieces.append((dst[start : start + n], src))
    try:
        with ThreadPoolExecutor(restore_workers(), thread_name_prefix="ckpt-shm-copy") as pool:
            list(pool.map(_copy_piece, pieces))
    finally:
        pieces.clear()  # no view of the slot may outlive the reader's mapping
    return out


def _copy_piece(piece: tuple[np.ndarray, np.ndarray]) -> None:
    dst, src = piece
    populate(dst.data)
    np.copyto(dst, src)


def _manifest(engine: Engine, desc: Descriptor) -> RankManifest:
    """A rank manifest describing a snapshot (no blobs: the bytes are in memory)."""
    prev = desc.meta.get("prev_hash")
    meta = CheckpointMeta(
        run_id=engine.run_id,
        step=desc.step,
        tier=desc.tier,
        world_size=desc.world_size,
        lightweight=bool(desc.meta.get("lightweight")),
        sections=tuple(desc.tree),
        prev_hash=str(prev) if prev else None,
    )
    return RankManifest(
        meta=meta,
        rank=desc.rank,
        state=desc.tree,
        tensors={
            n: TensorEntry(dtype=t.dtype, shape=t.shape, nbytes=t.nbytes)
            for n, t in desc.tensors.items()
        },
        blobs={},
    )


def _loaded(engine: Engine, copy: ShmCopy) -> LoadedState:
    return LoadedState(manifest=_manifest(engine, copy.desc), arrays=copy.arrays, files=copy.files)


def resume_from_memory(
    engine: Engine, restorer: Restorer, group: RankGroup | None, target: FlashTarget
) -> ResumePoint | None:
    """Before a resume with shared memory: let a persister handle the snapshots a dead
    trainer left (:meth:`FlashTarget.flush_previous`); a rank whose area is empty (its pod
    recreated on another node) asks its sidecar for a peer's replica
    (:meth:`FlashTarget.rehydrate`); then restore every rank from memory when the module
    doc's rules allow; None on every rank: resume from storage as usual (collective with
    several ranks)."""
    target.flush_previous()  # a dead trainer's last snapshot goes first
    if not engine.config.resume_from:  # a named checkpoint is never read from memory
        answer = target.rehydrate()  # the rank's node was lost: a peer's replica
        if answer is not None:
            engine.event(
                "rehydrate", found=answer.found, step=answer.step, source=answer.source,
                why=answer.why,
            )  # fmt: skip
            log.info("rank %d's replica: %s", engine.ranks.rank, clean(answer.why))
    rank = engine.ranks.rank
    areas = {rank: target.reader}
    for other in range(engine.ranks.live_world_size):
        reader = target.reader_of(other)
        if other != rank and reader.dir.is_dir():  # on this node: its shared state is read here
            areas[other] = reader
    return InPlaceRestore(engine, restorer, group, areas).run()


class InPlaceRestore:
    """The in-place restart protocol of one rank (see the module doc; collective)."""

    def __init__(
        self,
        engine: Engine,
        restorer: Restorer,
        group: RankGroup | None,
        areas: dict[int, ShmReader],
    ) -> None:
        """``areas``: this node's readers by rank (this rank's own; the others' on this node)."""
        self.engine = engine
        self.restorer = restorer
        self.group = group
        self.areas = areas
        self.rank = engine.ranks.rank

    def _gather(self, value: Json) -> list[Json]:
        return self.group.gather(value) if self.group is not None else [value]

    def _event(self, outcome: str, reason: str, step: int | None = None) -> None:
        self.engine.event("inplace_restore", outcome=outcome, step=step, reason=reason)
        log.info("in-place restart from shared memory: %s (%s)", outcome, clean(reason))

    # ------------------------------------------------------------------ round 1: offers

    def _coordinator_view(self) -> dict[str, Json]:
        """Rank 0: storage's newest usable step, and whether memory may be used at all."""
        e = self.engine
        if e.config.resume_from:
            return {"allowed": False, "why_not": "CKPT_RESUME_FROM names the checkpoint"}
        records = e.catalog.rebuild_from_storage(e.storage, e.run_id)
        bad = (CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED)
        newest = max((r.step for r in records if r.has_weights and r.status not in bad), default=-1)
        if self.restorer.recover_request() is not None:
            return {"allowed": False, "why_not": "a manual recovery request (RECOVER.json)"}
        return {"allowed": True, "storage_step": newest}

    def _local_view(self) -> dict[str, Json]:
        """What this rank brings to round 1 (an error here: no offer, never a hang)."""
        try:
            own = self.areas[self.rank]
            info: dict[str, Json] = {"offers": [o.to_json() for o in shm_offers(own)]}
            mark = step_mark(own)
            if mark is not None:
                info["mark"] = StepMark(mark.heartbeat.step, mark.epoch).to_json()
            if self.engine.ranks.coordinator:
                info.update(self._coordinator_view())
        except Exception as err:
            log.warning("looking at the shared-memory snapshots failed", exc_info=True)
            return {"offers": [], "allowed": False, "why_not": f"{type(err).__name__}: {err}"}
        return info

    def choose(self) -> InplaceChoice:
        table = self._gather(self._local_view())
        head = table[0]
        assert isinstance(head, dict)
        offers, marks = [], []
        for row in table:
            assert isinstance(row, dict)
            raw = row.get("offers")
            offers.append([ShmOffer.from_json(o) for o in raw] if isinstance(raw, list) else [])
            marks.append(StepMark.from_json(row.get("mark")))
        step = head.get("storage_step")
        return choose_inplace(
            offers,
            storage_step=int(step) if isinstance(step, int) else -1,
            world_size=self.engine.ranks.live_world_size,
            allowed=bool(head.get("allowed")),
            why_not=str(head.get("why_not") or ""),
            marks=marks,
        )

    # ------------------------------------------------------------------ round 2: checks

    def _find(self, rank: int, seq: int, token: str) -> Descriptor | None:
        area = self.areas.get(rank)
        if area is None:
            return None
        for desc in area.complete():
            if desc.seq == seq and desc.meta.get("token") == token:
                return desc
        return None

    def _copy(self, rank: int, choice: InplaceChoice) -> tuple[ShmCopy | None, str]:
        assert choice.token is not None
        desc = self._find(rank, choice.seqs[rank], choice.token)
        if desc is None:
            return None, f"rank {rank}'s snapshot {choice.seqs[rank]} is not in this node's memory"
        return copy_snapshot(self.areas[rank], desc)

    def _own_mark(self, choice: InplaceChoice) -> tuple[StepHeartbeat | None, str]:
        """A rank restored from its step heartbeat (a JIT save it lacks): that record."""
        mark = step_mark(self.areas[self.rank])
        if mark is None or mark.heartbeat.step != choice.step:
            return None, f"rank {self.rank}'s step heartbeat of step {choice.step} is gone"
        return mark, ""

    def _checks(
        self, choice: InplaceChoice
    ) -> tuple[ShmCopy | None, StepHeartbeat | None, ShmCopy | None, str]:
        """This rank's copy (or step heartbeat) and the source rank's copy (the same on the
        source), or why this rank cannot."""
        try:
            own: ShmCopy | None = None
            mark: StepHeartbeat | None = None
            if self.rank in choice.from_heartbeat:
                mark, why = self._own_mark(choice)
            else:
                own, why = self._copy(self.rank, choice)
            if own is None and mark is None:
                return None, None, None, why
            shared: ShmCopy | None = own if self.rank == choice.source else None
            if shared is None and choice.source in self.areas:  # else the source broadcasts
                shared, _ = self._copy(choice.source, choice)
            if shared is not None:
                problems = self.restorer.compat(_manifest(self.engine, shared.desc))
                if problems:
                    why = "does not fit the live model: " + "; ".join(problems[:3])
                    return None, None, None, why
        except Exception as err:  # never leave the other ranks waiting in the next round
            log.warning("checking the shared-memory snapshot failed", exc_info=True)
            return None, None, None, f"{type(err).__name__}: {err}"
        return own, mark, shared, ""

    def _committed_hash(self, desc: Descriptor) -> str:
        """The source rank: the COMMIT hash of its snapshot when its persister committed it."""
        mark = self.areas[self.rank].persisted()
        ok = mark is not None and mark.seq == desc.seq and mark.committed and mark.manifest_hash
        return str(mark.manifest_hash) if ok and mark is not None else ""

    def _receive_shared(self, shared: ShmCopy | None, src: int) -> ShmCopy | None:
        """The source rank broadcasts its checked copy; ranks without its area check what
        they got."""
        assert self.group is not None
        head = None
        if self.rank == src:
            assert shared is not None
            h = shared.hashes
            head = {
                "desc": shared.desc.to_bytes().decode(),
                "sha256": h.sha256,
                "fast": h.fast,
                "files": {k: v.hex() for k, v in shared.files.items()},
            }
        msg = self.group.broadcast(head, src)
        assert isinstance(msg, dict)
        desc = Descriptor.from_bytes(str(msg["desc"]).encode(), f"rank {src}'s snapshot descriptor")
        buffers = (
            shared.buffers
            if self.rank == src and shared is not None
            else [torch.empty(hi - lo, dtype=torch.uint8) for lo, hi, _ in regions(desc)]
        )
        for buf in buffers:
            self.group.broadcast_tensor(buf, src)
        if shared is not None:
            return shared  # the source, or a rank that read the source's area itself
        fast = msg.get("fast")
        raw_sha, raw_files = msg.get("sha256"), msg.get("files")
        assert isinstance(raw_sha, dict) and isinstance(raw_files, dict)
        hashes = RecordedHashes(
            {str(k): [str(x) for x in v] for k, v in raw_sha.items() if isinstance(v, list)},
            {str(k): [str(x) for x in v] for k, v in fast.items() if isinstance(v, list)}
            if isinstance(fast, dict)
            else None,
        )
        files = {str(k): bytes.fromhex(str(v)) for k, v in raw_files.items()}
        got = ShmCopy(desc, hashes, buffers, _arrays(desc, buffers), files)
        problems = _check(got)
        return None if problems else got

    # ------------------------------------------------------------------ the protocol

    def run(self) -> ResumePoint | None:
        """Restore every rank from memory, or None on every rank (resume from storage)."""
        if self.engine.ranks.sharded or self.rank not in self.areas:
            return None  # sharded state is resharded from storage (every rank alike)
        choice = self.choose()
        if choice.token is None:
            self._event("storage", choice.reason)
            return None
        own, mark, shared, why = self._checks(choice)
        source = self.rank == choice.source
        committed = self._committed_hash(own.desc) if own is not None and source else ""
        reports = self._gather(
            {
                "ok": own is not None or mark is not None,
                "why": why,
                "shared": shared is not None,
                "hash": committed,
            }
        )
        ok, why_all = all_usable([r for r in reports if isinstance(r, dict)])
        if not ok:
            self._event("storage", f"step {choice.step} not usable everywhere: {why_all}")
            return None
        if not all(isinstance(r, dict) and r.get("shared") for r in reports):
            shared = self._receive_shared(shared, choice.source)
        head = reports[choice.source]
        assert isinstance(head, dict)
        point, why = self._apply(own, mark, shared, str(head.get("hash") or ""))
        results = self._gather({"ok": point is not None, "why": why})
        ok, why_all = all_usable([r for r in results if isinstance(r, dict)])
        if not ok:  # storage's restore overwrites whatever was applied here
            self._event("storage", f"step {choice.step} failed to apply: {why_all}")
            return None
        self._event("memory", choice.reason, choice.step)
        return point

    def _apply(
        self,
        own: ShmCopy | None,
        mark: StepHeartbeat | None,
        shared: ShmCopy | None,
        committed_hash: str,
    ) -> tuple[ResumePoint | None, str]:
        if shared is None:
            return None, "the replicated state did not arrive intact"
        desc = shared.desc
        try:
            rec = CheckpointRecord(
                id=desc.checkpoint_id,
                step=desc.step,
                tier=desc.tier,
                status=CheckpointStatus.VALID,
                manifest_hash=committed_hash,
                lightweight=bool(desc.meta.get("lightweight")),
                reason="shared-memory snapshot",
                lineage=lineage_from_json(desc.meta.get("lineage"), "snapshot lineage"),
            )
            cand = Candidate(
                record=rec,
                loaded=_loaded(self.engine, shared),
                manifest_hash=committed_hash,
                own=_loaded(self.engine, own) if own is not None else None,
                own_heartbeat=mark.heartbeat if mark is not None else None,
            )
            point = self.restorer.restore(cand, action="resume_shm", weights=None, rejected={})
        except CandidateRejectedError as err:
            log.warning("shared-memory snapshot of step %d rejected: %s", desc.step, clean(err))
            return None, err.reason
        except Exception as err:  # the other ranks wait for this rank's answer
            log.warning("applying the shared-memory snapshot failed", exc_info=True)
            return None, f"{type(err).__name__}: {err}"
        if not committed_hash:  # not committed (yet): the next save links where it did
            prev = desc.meta.get("prev_hash")
            point = replace(point, prev_hash=str(prev) if prev else None)
        reason = (
            f"in-place restart: {desc.checkpoint_id} from shared memory (every rank's copy "
            "checked against the persister's checksums)"
        )
        return replace(point, reason=reason), ""
