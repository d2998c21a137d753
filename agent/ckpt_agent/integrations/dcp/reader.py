"""The DCP ``StorageReader`` from our format, and :func:`load_latest`: the newest *valid*
checkpoint, resharded as DCP does it."""

from __future__ import annotations

import io
import logging
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckpt_agent.decide.lineage import choose, pins_in_force
from ckpt_agent.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    one_line,
)
from ckpt_agent.format import jsontree
from ckpt_agent.format.layout import (
    parse_checkpoint_id,
)
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import RankManifest
from ckpt_agent.format.readers import read_commit, read_rank_manifest
from ckpt_agent.format.statecheck import check_state
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.integrations.dcp.common import (
    SECTION,
    CorruptedCheckpointError,
    ItemAt,
    as_size,
    config_or_env,
    index_key,
    metadata_from_json,
    step_of,
)
from ckpt_agent.integrations.dcp.writer import DcpWriter
from ckpt_agent.persist.builder import PersistBuilder
from ckpt_agent.persist.validate import load_check
from ckpt_agent.persist.verdicts import write_verdict
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Json, Lineage
from ckpt_agent.runtime.core.serialization import (
    load_entry,
    unflatten,
)
from ckpt_agent.storage.base import Storage
from ckpt_agent.text import clean

log = logging.getLogger(__name__)


class DcpReader(StorageReader):
    """A DCP ``StorageReader`` of the checkpoints :class:`DcpWriter` wrote.

    Args:
        config, storage: as for :class:`DcpWriter`.
        checkpoint_id: the checkpoint to load exactly (a step, ``step-200``, our id);
            None: the newest valid one (pending ones are verified here first, corrupted and
            expired ones skipped). ``dcp.load(..., checkpoint_id=...)`` sets it too.

    :attr:`loaded` names the checkpoint the last ``read_metadata`` chose.
    """

    def __init__(
        self,
        config: AgentConfig | None = None,
        *,
        storage: Storage | None = None,
        checkpoint_id: str | os.PathLike[str] | int | None = None,
    ) -> None:
        super().__init__()
        self.config = config_or_env(config)
        self.run_id = self.config.run_id
        builder = PersistBuilder(self.config, storage=storage)
        self.storage, self._owns_storage = builder.open_storage()
        self._requested: int | None = None if checkpoint_id is None else step_of(checkpoint_id)
        self.excluded: set[str] = set()
        """Checkpoints found corrupted by this reader (never chosen again)."""
        self.loaded: str | None = None
        self.resumed: CheckpointRecord | None = None
        """The record of the checkpoint chosen (its step, hash, lineage)."""
        self.lineage = Lineage()
        """The lineage the checkpoints of a run continuing from this load carry
        (:meth:`DcpWriter.resumed_from`)."""
        self._manifests: dict[int, RankManifest] = {}
        self._where: dict[tuple[str, tuple[int, ...] | None], ItemAt] = {}
        self.started = time.perf_counter()

    @property
    def checkpoint_id(self) -> str | None:
        return self.loaded

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._requested = None if checkpoint_id is None else step_of(checkpoint_id)

    def read_metadata(self) -> Metadata:
        self.started = time.perf_counter()
        ckpt_id = self._choose()
        committed = read_commit(self.storage, self.run_id, ckpt_id)
        if SECTION not in committed.commit.meta.sections:
            raise CheckpointFormatError(
                f"{ckpt_id} was not written by DcpWriter (sections "
                f"{list(committed.commit.meta.sections)}): restore it with Checkpointer.start()"
            )
        manifests = {
            r.rank: read_rank_manifest(self.storage, self.run_id, committed, r.rank)
            for r in committed.commit.ranks
        }
        where: dict[tuple[str, tuple[int, ...] | None], ItemAt] = {}
        for rank, m in manifests.items():
            check_state(m)
            for i, item in enumerate(_items(m)):
                offset = item.get("offset")
                key = (
                    str(item.get("fqn")),
                    None if offset is None else tuple(as_size(offset, ckpt_id)),
                )
                where.setdefault(key, ItemAt(rank, i))
        holders = [m for m in manifests.values() if "metadata" in _section(m)]
        if len(holders) != 1:
            raise CheckpointFormatError(
                f"{ckpt_id}: {len(holders)} rank manifests hold DCP's metadata (one must)"
            )
        md = metadata_from_json(_section(holders[0]).get("metadata"), f"{ckpt_id} DCP metadata")
        for fqn, v in md.state_dict_metadata.items():
            keys = (
                [(fqn, tuple(int(o) for o in c.offsets)) for c in v.chunks]
                if isinstance(v, TensorStorageMetadata)
                else [(fqn, None)]
            )
            for k in keys:
                if k not in where:
                    raise CheckpointFormatError(f"{ckpt_id}: no rank stored {k[0]!r} at {k[1]}")
        md.storage_data = {
            MetadataIndex(fqn, None if off is None else torch.Size(off)): at
            for (fqn, off), at in where.items()
        }
        self.loaded, self._manifests, self._where = ckpt_id, manifests, where
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        del metadata, is_coordinator, args, kwargs

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        ckpt_id = self.loaded
        assert ckpt_id is not None
        # Read and check every piece first: a corrupted one leaves the target untouched.
        sources: dict[tuple[int, int], torch.Tensor] = {}
        pieces: list[tuple[Any, torch.Tensor | io.BytesIO]] = []
        for ri in plan.items:
            at = self._where.get(index_key(ri.storage_index))
            if at is None:
                raise CheckpointFormatError(f"{ckpt_id}: nothing stored for {ri.storage_index}")
            m = self._manifests[at.rank]
            item = _items(m)[at.item]
            if ri.type == LoadItemType.BYTE_IO:
                pieces.append((ri, self._value_bytes(m, at)))
                continue
            src = sources.get((at.rank, at.item))
            if src is None:
                name = f"{SECTION}/items/{at.item}/tensor"
                ref = item.get("tensor")
                if ref != {jsontree.TENSOR: name} or name not in m.tensors:
                    raise CheckpointFormatError(f"{ckpt_id}: item {at.item} holds no tensor")
                try:
                    src = load_entry(self.storage, self.run_id, m, m.tensors[name], name)
                except IntegrityError as e:
                    self._corrupted(ckpt_id, one_line(e))
                    raise CorruptedCheckpointError(ckpt_id, one_line(e)) from None
                sources[(at.rank, at.item)] = src
            pieces.append((ri, narrow_tensor_by_index(src, ri.storage_offsets, ri.lengths)))
        for ri, piece in pieces:
            if isinstance(piece, io.BytesIO):
                planner.load_bytes(ri, piece)
                continue
            target = planner.resolve_tensor(ri).detach()
            if target.size() != piece.size():
                raise CheckpointFormatError(
                    f"{ckpt_id}: {ri.dest_index.fqn}: a saved piece of {list(piece.size())} "
                    f"does not fit the target's {list(target.size())}"
                )
            target.copy_(piece)
            planner.commit_tensor(ri, target)
        seconds = time.perf_counter() - self.started
        log.info(
            "DCP load restored %s (step %d, tier %s) from %s run %s in %.2f s",
            ckpt_id,
            parse_checkpoint_id(ckpt_id)[1],
            parse_checkpoint_id(ckpt_id)[0].value,
            self.storage.url,
            self.run_id,
            seconds,
        )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return DcpWriter.validate_checkpoint_id(checkpoint_id)

    def close(self) -> None:
        if self._owns_storage:
            self.storage.close()

    # ------------------------------------------------------------------ ours

    def _value_bytes(self, m: RankManifest, at: ItemAt) -> io.BytesIO:
        """A bytes item's value decoded from JSON, serialized for the planner's
        ``load_bytes`` (which ``torch.load``s it): only what our decoding built is
        pickled and unpickled, never bytes from storage."""
        item = _items(m)[at.item]
        names = {
            n: load_entry(self.storage, self.run_id, m, m.tensors[n], n)
            for n in jsontree.walk_refs(item.get("value"))
            if n in m.tensors
        }
        value = unflatten(item.get("value"), names)
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return buf

    def _choose(self) -> str:
        records = [
            r
            for r in list_checkpoints(self.storage, self.run_id, include_heartbeat=False)
            if r.has_weights
        ]
        by_id = {r.id: r for r in records}
        if self._requested is not None:
            want = [r for r in records if r.step == self._requested]
            if not want:
                raise CheckpointNotFoundError(
                    f"run {self.run_id!r} on {self.storage.url} has no checkpoint at step "
                    f"{self._requested}"
                )
            rec = want[-1]
            if rec.status in (CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED):
                raise CorruptedCheckpointError(rec.id, f"is {rec.status.value}")
            return self._resume(rec, None)
        cfg = self.config
        pins = pins_in_force(None, cfg.resume_from, cfg.resume_weights, cfg.resume_pin)
        choice = choose(records, pins)
        if choice.apply is not None:  # the operator's pin, not applied yet: exactly it
            pin = choice.apply
            rec_or_none = by_id.get(pin.checkpoint_id)
            if rec_or_none is None or pin.weights_from is not None:
                raise CheckpointNotFoundError(
                    f"{pin.key}: run {self.run_id!r} on {self.storage.url} has no DCP "
                    f"checkpoint {pin.checkpoint_id} to resume from"
                )
            if rec_or_none.status in (CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED):
                raise CorruptedCheckpointError(pin.checkpoint_id, f"is {rec_or_none.status.value}")
            return self._resume(rec_or_none, choice.lineage)
        for rec in sorted(records, key=lambda r: (r.lineage.epoch, r.step), reverse=True):
            if rec.id in self.excluded or rec.status not in (
                CheckpointStatus.VALID,
                CheckpointStatus.PENDING,
            ):
                continue
            if choice.candidates is not None and rec.id not in choice.candidates:
                continue
            if rec.status == CheckpointStatus.PENDING and not self._verify(rec):
                continue
            return self._resume(rec, None)
        raise CheckpointNotFoundError(
            f"run {self.run_id!r} on {self.storage.url} has no valid checkpoint "
            f"({len(records)} listed)"
        )

    def _resume(self, rec: CheckpointRecord, lineage: Lineage | None) -> str:
        """Remember what a writer continuing from this load needs: the checkpoint, and the
        lineage its next checkpoints carry (a pin's new one, else the checkpoint's own)."""
        base = lineage if lineage is not None else rec.lineage
        self.resumed = rec
        self.lineage = Lineage(epoch=base.epoch, pins=base.pins, parent=rec.id)
        return rec.id

    def _verify(self, rec: CheckpointRecord) -> bool:
        """A pending checkpoint (its validation did not finish): check every byte here."""
        for r in range(rec.world_size):
            report = load_check(self.storage, self.run_id, rec.id, r)
            if not report.ok:
                self._corrupted(rec.id, f"rank {r}: {report.error}")
                return False
        return True

    def _corrupted(self, ckpt_id: str, reason: str) -> None:
        """Record the verdict next to the COMMIT (every reader skips it from now on)."""
        self.excluded.add(ckpt_id)
        log.error("ALERT DCP checkpoint %s is CORRUPTED: %s", ckpt_id, clean(reason))
        try:
            committed = read_commit(self.storage, self.run_id, ckpt_id)
            rec = ValidationVerdict(
                checkpoint_id=ckpt_id,
                commit_sha256=committed.manifest_hash,
                status=CheckpointStatus.CORRUPTED,
                reason=reason,
                validated_at=time.time(),
                checks=("hashes (DCP load)",),
            )
            # read-before-write: a checkpoint retired or re-saved meanwhile keeps its verdict
            write_verdict(self.storage, self.run_id, rec, committed.manifest_hash)
        except Exception as e:  # the verdict is a courtesy; the load fails either way
            log.warning("could not record the verdict on %s: %s", ckpt_id, one_line(e))


def _section(m: RankManifest) -> Mapping[str, Json]:
    state = m.state if isinstance(m.state, dict) else {}
    sec = state.get(SECTION)
    if not isinstance(sec, dict):
        raise CheckpointFormatError(f"{m.checkpoint_id} rank {m.rank}: no {SECTION!r} section")
    return sec


def _items(m: RankManifest) -> list[dict[str, Json]]:
    items = _section(m).get("items")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise CheckpointFormatError(f"{m.checkpoint_id} rank {m.rank}: DCP items are not a list")
    return items


def load_latest(
    state_dict: dict[str, Any],
    reader: DcpReader | None = None,
    *,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    attempts: int = 3,
    writer: DcpWriter | None = None,
) -> str:
    """``dcp.load`` the newest valid checkpoint; when a piece of it fails its hash (on any
    rank), it is marked corrupted and the previous valid one is loaded instead. Returns the
    checkpoint id loaded. Collective, like ``dcp.load``. With ``writer``, the run continues
    from it (:meth:`DcpWriter.resumed_from`): pass the writer of the saves that follow.

    Without an explicit ``checkpoint_id`` the operator's resume pin (``CKPT_RESUME_FROM``)
    is applied once, exactly; after that (an in-place restart of the pinned job) the pin's
    lineage continues from its newest valid checkpoint (:mod:`ckpt_agent.decide.lineage`)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    reader = reader if reader is not None else DcpReader()
    single = not (dist.is_available() and dist.is_initialized())

    def load() -> str:
        with warnings.catch_warnings():
            if single:  # one process without torch.distributed: that is the intent
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp_load(
                state_dict,
                storage_reader=reader,
                planner=planner,
                process_group=process_group,
                no_dist=single,
            )
        assert reader.loaded is not None
        if writer is not None:
            writer.resumed_from(reader)
        return reader.loaded

    for _ in range(max(1, attempts) - 1):
        try:
            return load()
        except CheckpointException as e:
            bad = [
                exc for exc, _ in e.failures.values() if isinstance(exc, CorruptedCheckpointError)
            ]
            if not bad or reader._requested is not None or reader.loaded is None:
                raise
            reader.excluded.update({b.checkpoint_id for b in bad} | {reader.loaded})
            log.warning(
                "DCP checkpoint %s is corrupted (%s): loading the previous valid one",
                reader.loaded,
                clean(bad[0].reason),
            )
    return load()
