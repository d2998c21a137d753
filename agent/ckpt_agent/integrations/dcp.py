"""``torch.distributed.checkpoint`` (DCP) into our storage: :class:`DcpWriter`, :class:`DcpReader`.

.. code-block:: python

    import torch.distributed.checkpoint as dcp
    from ckpt_agent.integrations.dcp import DcpReader, DcpWriter, load_latest

    writer = DcpWriter()                      # CKPT_STORAGE_URL / CKPT_RUN_ID / CKPT_CONFIG
    dcp.save(state, storage_writer=writer, checkpoint_id=f"step-{step}")   # or async_save
    load_latest(state, DcpReader())           # the newest *valid* checkpoint, resharded
    writer.close()                            # waits for validation and retention

What a save becomes (docs/format.md; the call order of DCP's ``StorageWriter``):

1. ``reset(checkpoint_id)`` (every rank): the step is the id's trailing number
   (``step-200``, ``.../step_200``, ``full_step_000000000200`` or ``200``).
2. ``prepare_global_plan`` (coordinator): refuses a step that is not after the newest
   checkpoint of the run still in storage (:class:`~ckpt_agent.errors.StepOrderError`),
   then hands every rank the checkpoint's identity in its plan's ``storage_data``.
3. ``write_data`` (every rank): each write item's bytes — a tensor (a DTensor or
   ShardedTensor shard, a whole plain tensor) or a non-tensor value — go through
   :class:`~ckpt_agent.persist.writer.CheckpointWriter` (16 MiB chunks, SHA-256,
   de-duplication, zstd where it pays); the rank's manifest lists the items in a
   ``dcp`` section. Non-tensor values (DCP pickles them) are stored as tagged JSON;
   anything JSON cannot hold exactly is refused at save time, naming it.
4. ``finish`` (coordinator): DCP's global ``Metadata`` goes into rank 0's manifest as
   JSON, every other rank's manifest is checked against the hash it announced, and the
   ``COMMIT`` is published last. Then (in the background) the same pipeline as the
   agent's own checkpoints: validation in a separate process, verdict, catalog,
   retention classes (``retention.routineKeep`` keeps the newest *k*), blob GC.

A load never unpickles anything from storage: :meth:`DcpReader.read_metadata` rebuilds
``Metadata`` from the JSON; ``read_data`` reads and hash-checks every piece this rank
needs before it copies any, so a corrupted blob is detected and the target is left
alone; :func:`load_latest` then marks the checkpoint corrupted and loads the previous
valid one. Resharding is DCP's: its load planner maps the saved chunks onto the target
state at any world size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckpt_agent.decide.lineage import choose, pins_in_force, superseded
from ckpt_agent.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    JsonTreeError,
    StepOrderError,
    one_line,
)
from ckpt_agent.format import jsontree
from ckpt_agent.format.layout import (
    parse_checkpoint_id,
    rank_manifest_key,
    sha256_hex,
    validation_key,
)
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta, RankManifest, RankRef
from ckpt_agent.format.readers import read_commit, read_rank_manifest
from ckpt_agent.format.statecheck import check_state
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.metrics import Metrics
from ckpt_agent.persist.builder import PersistBuilder, PersistParts
from ckpt_agent.persist.finalize import FinalizeJob
from ckpt_agent.persist.validate import load_check
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource, WrittenRank
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, Json, Lineage, checkpoint_id
from ckpt_agent.runtime.core.serialization import (
    LiveArray,
    dtype_name,
    flatten,
    library_versions,
    load_entry,
    raw_bytes,
    torch_dtype,
    unflatten,
)
from ckpt_agent.storage.base import Storage

__all__ = [
    "SECTION",
    "CorruptedCheckpointError",
    "DcpReader",
    "DcpWriter",
    "load_latest",
    "metadata_from_json",
    "metadata_to_json",
    "step_of",
]

log = logging.getLogger(__name__)

SECTION: Final = "dcp"
"""The rank manifests' section holding DCP's write items (and, on rank 0, its metadata)."""

_TRAILING_NUMBER = re.compile(r"(\d+)$")
_RANK_PART = "__ckpt_rank_part__"
"""The fqn of each rank's extra :class:`WriteResult` announcing its manifest's hash."""


class CorruptedCheckpointError(IntegrityError):
    """A piece of the checkpoint being loaded failed its hash: it is marked corrupted;
    loading again (:func:`load_latest` does) takes the previous valid checkpoint."""

    def __init__(self, checkpoint_id: str, reason: str) -> None:
        super().__init__(f"{checkpoint_id}: {reason}")
        self.checkpoint_id = checkpoint_id
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers rank failures by pickling them
        return (type(self), (self.checkpoint_id, self.reason))


def step_of(checkpoint_id: str | os.PathLike[str] | int) -> int:
    """The step a DCP ``checkpoint_id`` names: ``step-200``, ``/ckpt/step_200``, our own
    ``full_step_000000000200`` or ``200``."""
    if isinstance(checkpoint_id, int):
        return checkpoint_id
    name = os.path.basename(os.fspath(checkpoint_id).rstrip("/"))
    with contextlib.suppress(ValueError):
        return parse_checkpoint_id(name)[1]
    m = _TRAILING_NUMBER.search(name)
    if m is None:
        raise ValueError(
            f"checkpoint_id {os.fspath(checkpoint_id)!r} names no step: end it with the step "
            "number (torchtitan's 'step-200' does)"
        )
    return int(m.group(1))


# --------------------------------------------------------------------------- metadata as JSON


def metadata_to_json(md: Metadata) -> Json:
    """DCP's ``Metadata`` as tagged JSON (never pickled); :func:`metadata_from_json` inverts it."""
    entries: dict[str, object] = {}
    for fqn, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            p = v.properties
            if p.layout != torch.strided:
                raise CheckpointFormatError(f"{fqn}: only dense (strided) tensors are supported")
            entries[fqn] = {
                "kind": "tensor",
                "dtype": dtype_name(p.dtype),
                "requires_grad": bool(p.requires_grad),
                "size": [int(s) for s in v.size],
                "chunks": [
                    {"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]}
                    for c in v.chunks
                ],
            }
        elif isinstance(v, BytesStorageMetadata):
            entries[fqn] = {"kind": "bytes"}
        else:  # pragma: no cover - DCP knows these two kinds only
            raise CheckpointFormatError(f"{fqn}: unknown DCP storage metadata {type(v).__name__}")
    sm = md.storage_meta
    storage_meta = (
        None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        }
    )
    try:
        return jsontree.encode(
            {
                "state_dict_metadata": entries,
                "planner_data": md.planner_data,
                "storage_meta": storage_meta,
                "version": md.version,
            }
        )
    except JsonTreeError as e:
        raise CheckpointFormatError(
            f"DCP metadata cannot be stored as JSON ({e}): a custom planner's planner_data "
            "must be plain values"
        ) from None


def _ints(v: object, what: str) -> torch.Size:
    if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
        raise CheckpointFormatError(f"{what}: must be a list of non-negative integers")
    return torch.Size(v)


def metadata_from_json(tree: Json, what: str = "DCP metadata") -> Metadata:
    """Rebuild DCP's ``Metadata`` from :func:`metadata_to_json` (checked, nothing unpickled)."""
    d = jsontree.decode(tree)
    if not isinstance(d, dict) or not isinstance(d.get("state_dict_metadata"), dict):
        raise CheckpointFormatError(f"{what}: not DCP metadata")
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, e in d["state_dict_metadata"].items():
        if not isinstance(e, dict):
            raise CheckpointFormatError(f"{what}: {fqn!r} is not an object")
        if e.get("kind") == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        if e.get("kind") != "tensor":
            raise CheckpointFormatError(f"{what}: {fqn!r} has unknown kind {e.get('kind')!r}")
        chunks = e.get("chunks")
        if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
            raise CheckpointFormatError(f"{what}: {fqn!r} chunks must be a list of objects")
        size = _ints(e.get("size"), f"{what}: {fqn!r} size")
        parsed = []
        for c in chunks:
            offsets = _ints(c.get("offsets"), f"{what}: {fqn!r} offsets")
            sizes = _ints(c.get("sizes"), f"{what}: {fqn!r} sizes")
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True))
            ):
                raise CheckpointFormatError(f"{what}: a chunk of {fqn!r} lies outside its tensor")
            parsed.append(ChunkStorageMetadata(offsets, sizes))
        props = TensorProperties(
            dtype=torch_dtype(str(e.get("dtype"))), requires_grad=bool(e.get("requires_grad"))
        )
        sdm[fqn] = TensorStorageMetadata(props, size, parsed)
    sm = d.get("storage_meta")
    storage_meta = None
    if isinstance(sm, dict):
        modules = sm.get("modules") or []
        storage_meta = StorageMeta(
            checkpoint_id=_opt_str(sm.get("checkpoint_id")),
            save_id=_opt_str(sm.get("save_id")),
            load_id=_opt_str(sm.get("load_id")),
            modules=[str(m) for m in modules] if isinstance(modules, list) else [],
        )
    return Metadata(
        state_dict_metadata=dict(sdm),
        planner_data=d.get("planner_data"),
        storage_meta=storage_meta,
        version=_opt_str(d.get("version")),
    )


def _opt_str(v: object) -> str | None:
    return None if v is None else str(v)


# --------------------------------------------------------------------------- shared set-up


def _config(config: AgentConfig | None) -> AgentConfig:
    return config if config is not None else AgentConfig.from_env()


@dataclass(frozen=True)
class _PlanData:
    """What the coordinator tells every rank about the checkpoint (the plans' storage_data)."""

    step: int
    world_size: int
    rank: int
    created_at: float
    prev_hash: str | None


@dataclass(frozen=True)
class _ItemAt:
    """Where one write item went: its rank's manifest, item number."""

    rank: int
    item: int


@dataclass(frozen=True)
class _RankPart:
    """A rank's manifest as it announced it to the coordinator."""

    rank: int
    sha256: str
    size: int


def _key(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    return (index.fqn, None if index.offset is None else tuple(int(o) for o in index.offset))


# --------------------------------------------------------------------------- writer


class DcpWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes this product's checkpoints (see the module doc).

    Args:
        config: the agent config (default: the environment, as :class:`Checkpointer`
            reads it: ``CKPT_STORAGE_URL``, ``CKPT_RUN_ID``, ``CKPT_CONFIG``); its
            compression, validation and retention sections apply.
        storage: an open storage (default: opened from the config; closed by :meth:`close`).
        tier: the tier the checkpoints are recorded under (a DCP checkpoint holds whatever
            state it was given: ``full`` by default).
        validate: validate (and then apply retention) after each commit, in a background
            thread of the coordinator; :meth:`wait` waits for it.

    One writer serves one save at a time; the same object may be passed to every
    ``dcp.save`` / ``dcp.async_save`` of a run (the blob index de-duplicates across them).
    Call :meth:`close` at the end (every rank).
    """

    def __init__(
        self,
        config: AgentConfig | None = None,
        *,
        storage: Storage | None = None,
        tier: Tier = Tier.FULL,
        validate: bool = True,
    ) -> None:
        super().__init__()
        self.config = _config(config)
        self.run_id = self.config.run_id
        self.tier = Tier(tier)
        self.validate = validate
        self._builder = PersistBuilder(self.config, storage=storage)
        self.storage, self._owns_storage = self._builder.open_storage()
        self._writer: CheckpointWriter = self._builder.writer(self.storage)
        self._step: int | None = None
        self._coordinator = False
        self._plan: _PlanData | None = None
        self._written: WrittenRank | None = None
        self._prev_hash: str | None = None
        self._lineage = Lineage()
        self._newest: int | None = None
        """Newest step of the run in storage (coordinator; listed on its first save)."""
        self._parts: PersistParts | None = None
        self._work_dir: Path | None = None
        self._finalizer: ThreadPoolExecutor | None = None
        self._pending: list[ThreadFuture[None]] = []
        self._lock = threading.Lock()
        self.committed: list[str] = []
        """Checkpoint ids this writer committed (coordinator)."""

    # ------------------------------------------------------------------ DCP's calls

    @property
    def checkpoint_id(self) -> str | None:
        """The checkpoint being written (DCP logs it)."""
        return None if self._step is None else checkpoint_id(self.tier, self._step)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._step = None if checkpoint_id is None else step_of(checkpoint_id)
        self._plan = None
        self._written = None

    def set_step(self, step: int) -> None:
        """The step of the next save (instead of naming it in ``checkpoint_id``)."""
        self._step = int(step)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise ValueError(
                "DcpWriter needs DCP's collectives (use_collectives=True): the coordinator "
                "commits every rank's part at once"
            )
        if self._step is None:
            raise ValueError(
                "DcpWriter: name the step in checkpoint_id (dcp.save(..., "
                "checkpoint_id=f'step-{step}')) or call writer.set_step(step) first"
            )
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self._step is not None
        self._check_step(self._step)
        now = time.time()
        return [
            dataclasses.replace(
                p,
                storage_data=_PlanData(self._step, len(plans), rank, now, self._prev_hash),
            )
            for rank, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        pd = plan.storage_data
        if not isinstance(pd, _PlanData):
            raise ValueError("DcpWriter: the plan did not come through its prepare_global_plan")
        self._plan = pd
        items: list[dict[str, object]] = []
        for item in plan.items:
            entry: dict[str, object] = {
                "fqn": item.index.fqn,
                "offset": None
                if item.index.offset is None
                else [int(o) for o in item.index.offset],
            }
            if item.type == WriteItemType.BYTE_IO:
                entry["value"] = _object_of(item, planner)
            else:
                entry["tensor"] = _cpu_tensor(planner.resolve_data(item))
            items.append(entry)
        live: dict[str, LiveArray] = {}
        try:
            tree = flatten({"items": items}, SECTION, live)
        except JsonTreeError as e:
            raise CheckpointFormatError(
                f"{e} (a DCP checkpoint here stores non-tensor values as JSON, never pickled)"
            ) from None
        sources = [
            TensorSource(a.name, a.dtype, a.shape, raw_bytes(a.value)) for a in live.values()
        ]
        written = self._writer.write_rank(self._meta(pd), pd.rank, {SECTION: tree}, sources)
        self._written = written
        results = [
            WriteResult(
                index=item.index,
                size_in_bytes=_nbytes(entry),
                storage_data=_ItemAt(pd.rank, i),
            )
            for i, (item, entry) in enumerate(zip(plan.items, items, strict=True))
        ]
        results.append(
            WriteResult(
                index=MetadataIndex(f"{_RANK_PART}{pd.rank}"),
                size_in_bytes=written.ref.size,
                storage_data=_RankPart(pd.rank, written.ref.sha256, written.ref.size),
            )
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pd, own = self._plan, self._written
        if pd is None or own is None:
            raise ValueError("DcpWriter.finish before write_data")
        ckpt_id = checkpoint_id(self.tier, pd.step)
        parts = {
            wr.storage_data.rank: wr.storage_data
            for rank_results in results
            for wr in rank_results
            if isinstance(wr.storage_data, _RankPart)
        }
        missing = sorted(set(range(pd.world_size)) - set(parts))
        if missing:
            raise ValueError(f"{ckpt_id}: ranks {missing} announced no manifest")
        # DCP's metadata (known only now) joins rank 0's manifest, which is published again
        state = dict(own.manifest.state) if isinstance(own.manifest.state, dict) else {}
        section = dict(state[SECTION]) if isinstance(state.get(SECTION), dict) else {}
        section["metadata"] = metadata_to_json(metadata)
        state[SECTION] = section
        manifest = dataclasses.replace(own.manifest, state=state)
        data = manifest.to_bytes()
        self.storage.commit(rank_manifest_key(self.run_id, ckpt_id, own.manifest.rank), data)
        own.bytes_new += len(data) - own.ref.size
        own.manifest = manifest
        own.ref = dataclasses.replace(own.ref, sha256=sha256_hex(data), size=len(data))
        ranks = [own] + [
            self._announced(ckpt_id, parts[r])
            for r in range(pd.world_size)
            if r != own.manifest.rank
        ]
        done = self._writer.commit(self._meta(pd), ranks)
        self._prev_hash = done.manifest_hash
        self._newest = pd.step
        self.committed.append(ckpt_id)
        log.info(
            "DCP checkpoint %s committed to %s run %s (%d ranks, %d bytes new)",
            ckpt_id,
            self.storage.url,
            self.run_id,
            pd.world_size,
            done.size_bytes,
        )
        if self.validate:
            job = FinalizeJob(ckpt_id, self.tier, pd.step, done.manifest_hash, pd.world_size)
            self._submit(job)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            step_of(checkpoint_id)
        except ValueError:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    # ------------------------------------------------------------------ ours

    def resumed_from(self, reader: DcpReader) -> None:
        """The run continues from what ``reader`` loaded (every rank, after the load):
        its next checkpoints carry the load's lineage and hash chain, and the checkpoints
        past the loaded step — an abandoned branch, after the operator's pin rewound the
        run — are marked expired (by rank 0), so they are neither resumed nor in the way
        of the steps that follow."""
        rec = reader.resumed
        if rec is None:
            raise ValueError("resumed_from: the reader has loaded nothing yet")
        self._lineage = reader.lineage
        self._prev_hash = rec.manifest_hash
        self._newest = None  # listed again at the next save
        if _rank() != 0:
            return
        listed = list_checkpoints(self.storage, self.run_id, include_heartbeat=False)
        for r in superseded(listed, rec.step):
            reason = f"superseded: the run resumed from {rec.id} (step {rec.step})"
            verdict = ValidationVerdict(
                checkpoint_id=r.id,
                commit_sha256=r.manifest_hash,
                status=CheckpointStatus.EXPIRED,
                reason=reason,
                validated_at=time.time(),
            )
            self.storage.commit(validation_key(self.run_id, r.id), verdict.to_bytes())
            log.info("DCP checkpoint %s %s", r.id, reason)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the validations (and retention) of every committed checkpoint; raises
        the first failure."""
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.result(timeout)

    def close(self) -> None:
        """Wait for the background work, stop it, close what was opened here (every rank)."""
        try:
            self.wait()
        finally:
            if self._finalizer is not None:
                self._finalizer.shutdown(wait=True)
                self._finalizer = None
            self._writer.close()
            if self._parts is not None:
                self._parts.close()
                self._parts = None
            if self._owns_storage:
                self.storage.close()
            if self._work_dir is not None:
                shutil.rmtree(self._work_dir, ignore_errors=True)
                self._work_dir = None

    def __enter__(self) -> DcpWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _meta(self, pd: _PlanData) -> CheckpointMeta:
        return CheckpointMeta(
            run_id=self.run_id,
            step=pd.step,
            tier=self.tier,
            world_size=pd.world_size,
            created_at=pd.created_at,
            reason="torch.distributed.checkpoint save",
            prev_hash=pd.prev_hash,
            sections=(SECTION,),
            versions=library_versions(),
            lineage=self._lineage,
        )

    def _check_step(self, step: int) -> None:
        """Refuse a step that is not after the newest checkpoint of the run in storage
        (corrupted and expired ones do not count: they are not history any more)."""
        if self._newest is None:
            gone = (CheckpointStatus.CORRUPTED, CheckpointStatus.EXPIRED)
            records = list_checkpoints(self.storage, self.run_id, include_heartbeat=False)
            self._newest = max((r.step for r in records if r.status not in gone), default=-1)
        if step <= self._newest:
            raise StepOrderError(
                f"step {step} is not after step {self._newest}, already saved in run "
                f"{self.run_id!r} on {self.storage.url}: load it first (load_latest) and "
                "continue from the step after it, or give this experiment its own run id "
                "(CKPT_RUN_ID)"
            )

    def _announced(self, ckpt_id: str, part: _RankPart) -> WrittenRank:
        """Another rank's manifest, read back and checked against what it announced."""
        key = rank_manifest_key(self.run_id, ckpt_id, part.rank)
        data = self.storage.read(key, 0, part.size + 1)
        if len(data) != part.size or sha256_hex(data) != part.sha256:
            raise IntegrityError(
                f"{ckpt_id}: rank {part.rank}'s manifest in storage is not the one it wrote"
            )
        m = RankManifest.from_bytes(data, f"{ckpt_id} rank {part.rank}")
        ref = RankRef(rank=part.rank, key=key.rsplit("/", 1)[1], sha256=part.sha256, size=part.size)
        return WrittenRank(
            manifest=m,
            ref=ref,
            bytes_new=m.stats.get("bytes_new", 0) + part.size,
            raw_bytes=m.stats.get("raw_bytes", 0),
        )

    def _submit(self, job: FinalizeJob) -> None:
        if self._parts is None:
            self._work_dir = Path(
                self.config.work_dir or tempfile.mkdtemp(prefix=f"ckpt-dcp-{self.run_id}-")
            )
            self._parts = self._builder.build(
                self._work_dir / "catalog.sqlite",
                metrics=Metrics(),
                tolerate_retention_errors=True,
            )
            self._finalizer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-dcp-validate")
        parts = self._parts
        assert self._finalizer is not None

        def run() -> None:
            result = parts.finalizer.finalize(job)
            if not result.outcome.valid:
                log.error(
                    "DCP checkpoint %s is %s: %s",
                    job.checkpoint_id,
                    result.outcome.status.value,
                    result.outcome.reason,
                )

        with self._lock:
            self._pending.append(self._finalizer.submit(run))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _cpu_tensor(data: object) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise CheckpointFormatError(f"DCP resolved a {type(data).__name__} for a tensor item")
    t = data.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _object_of(item: WriteItem, planner: SavePlanner) -> object:
    """The value behind a bytes item: from the planner's state dict (the default planner
    keeps it), else the planner's own serialization of it read back with ``weights_only``
    (plain values only; in memory, just made by the planner)."""
    from torch.distributed.checkpoint.utils import find_state_dict_object

    sd = getattr(planner, "state_dict", None)
    if isinstance(sd, dict):
        with contextlib.suppress(KeyError, ValueError):
            return find_state_dict_object(sd, item.index)
    data = planner.resolve_data(item)
    if isinstance(data, io.BytesIO):
        data.seek(0)
        return torch.load(data, weights_only=True)
    return data


def _nbytes(entry: Mapping[str, object]) -> int:
    t = entry.get("tensor")
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# --------------------------------------------------------------------------- reader


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
        self.config = _config(config)
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
        self._where: dict[tuple[str, tuple[int, ...] | None], _ItemAt] = {}
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
        where: dict[tuple[str, tuple[int, ...] | None], _ItemAt] = {}
        for rank, m in manifests.items():
            check_state(m)
            for i, item in enumerate(_items(m)):
                offset = item.get("offset")
                key = (
                    str(item.get("fqn")),
                    None if offset is None else tuple(_ints(offset, ckpt_id)),
                )
                where.setdefault(key, _ItemAt(rank, i))
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
            at = self._where.get(_key(ri.storage_index))
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

    def _value_bytes(self, m: RankManifest, at: _ItemAt) -> io.BytesIO:
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
        log.error("ALERT DCP checkpoint %s is CORRUPTED: %s", ckpt_id, reason)
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
            self.storage.commit(validation_key(self.run_id, ckpt_id), rec.to_bytes())
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
                bad[0].reason,
            )
    return load()
