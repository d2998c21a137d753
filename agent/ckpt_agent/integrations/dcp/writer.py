"""The DCP ``StorageWriter`` into our format: :class:`DcpWriter` (the call order: the
package's docs)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckpt_agent.decide.lineage import superseded
from ckpt_agent.errors import (
    CheckpointFormatError,
    IntegrityError,
    JsonTreeError,
    StepOrderError,
)
from ckpt_agent.format.fence import Fence, WriterRecord, claim, holder_of
from ckpt_agent.format.layout import (
    rank_manifest_key,
    sha256_hex,
    validation_key,
)
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta, RankManifest, RankRef
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.integrations.dcp.common import (
    RANK_PART,
    SECTION,
    ItemAt,
    Loaded,
    PlanData,
    RankPart,
    config_or_env,
    cpu_tensor,
    current_rank,
    entry_nbytes,
    metadata_to_json,
    object_of,
    step_of,
)
from ckpt_agent.metrics import Metrics
from ckpt_agent.persist.builder import PersistBuilder, PersistParts
from ckpt_agent.persist.fencing import republish_manifest
from ckpt_agent.persist.finalize import FinalizeJob
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource, WrittenRank
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, Lineage, checkpoint_id
from ckpt_agent.runtime.core.serialization import (
    LiveArray,
    flatten,
    library_versions,
    raw_bytes,
)
from ckpt_agent.runtime.save.fencing import hold
from ckpt_agent.storage.base import Storage

log = logging.getLogger(__name__)


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
        self.config = config_or_env(config)
        self.run_id = self.config.run_id
        self.tier = Tier(tier)
        self.validate = validate
        self._builder = PersistBuilder(self.config, storage=storage)
        self.storage, self._owns_storage = self._builder.open_storage()
        self._writer: CheckpointWriter = self._builder.writer(self.storage)
        self._step: int | None = None
        self._coordinator = False
        self._plan: PlanData | None = None
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
        self.fence: Fence | None = None
        """This writer's generation of the run: claimed by the coordinator (rank 0) at its
        first save or resume, read by the other ranks at their first save (the run's
        highest); a newer writer of the run fences it (:class:`FencedError` at the next
        save, nothing deleted)."""

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
        if is_coordinator:
            # The previous save's validation and retention end first: holding the run,
            # they delete debris and unreferenced blobs without a grace (single writer),
            # which this save's writes must not meet.
            self.wait()
            self._claim()  # before the plan's collective: the other ranks follow it
            assert self.fence is not None
            self.fence.check()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        assert self._step is not None
        self._check_step(self._step)
        now = time.time()
        return [
            dataclasses.replace(
                p,
                storage_data=PlanData(self._step, len(plans), rank, now, self._prev_hash),
            )
            for rank, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        pd = plan.storage_data
        if not isinstance(pd, PlanData):
            raise ValueError("DcpWriter: the plan did not come through its prepare_global_plan")
        self._plan = pd
        self._follow()
        items: list[dict[str, object]] = []
        for item in plan.items:
            entry: dict[str, object] = {
                "fqn": item.index.fqn,
                "offset": None
                if item.index.offset is None
                else [int(o) for o in item.index.offset],
            }
            if item.type == WriteItemType.BYTE_IO:
                entry["value"] = object_of(item, planner)
            else:
                entry["tensor"] = cpu_tensor(planner.resolve_data(item))
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
                size_in_bytes=entry_nbytes(entry),
                storage_data=ItemAt(pd.rank, i),
            )
            for i, (item, entry) in enumerate(zip(plan.items, items, strict=True))
        ]
        results.append(
            WriteResult(
                index=MetadataIndex(f"{RANK_PART}{pd.rank}"),
                size_in_bytes=written.ref.size,
                storage_data=RankPart(pd.rank, written.ref.sha256, written.ref.size),
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
            if isinstance(wr.storage_data, RankPart)
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
        key = rank_manifest_key(self.run_id, ckpt_id, own.manifest.rank)
        republish_manifest(self.storage, key, data, self.fence, (own.ref.sha256, own.ref.size))
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

    def resumed_from(self, reader: Loaded) -> None:
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
        if current_rank() != 0:
            return
        self._claim()  # a resume starts this writer: it holds the run from now
        listed = list_checkpoints(self.storage, self.run_id, include_heartbeat=False)
        for r in superseded(listed, rec.step):
            assert self.fence is not None
            self.fence.check()  # a fenced writer marks nothing
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

    def _claim(self) -> None:
        """The coordinator: claim the run's next writer generation, once."""
        if self.fence is None:
            self._hold(claim(self.storage, self.run_id))
            log.info("DCP writer holds run %s (generation %d)", self.run_id, self.generation)

    def _follow(self) -> None:
        """Another rank, at its first save (the coordinator claimed before the plan's
        collective): check the run's highest generation from now on."""
        if self.fence is not None or self._coordinator:
            return
        holder = holder_of(self.storage, self.run_id)
        if holder is not None:
            self._hold(Fence(self.storage, self.run_id, WriterRecord.here(holder.generation)))

    def _hold(self, fence: Fence) -> None:
        self.fence = fence
        self._writer.fence = fence
        if self._parts is not None:
            hold(self._parts, fence)

    @property
    def generation(self) -> int | None:
        """This writer's generation (None before its first save or resume)."""
        return None if self.fence is None else self.fence.generation

    def _meta(self, pd: PlanData) -> CheckpointMeta:
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

    def _announced(self, ckpt_id: str, part: RankPart) -> WrittenRank:
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
            if self.fence is not None:  # validation, verdicts and retention: fenced too
                hold(self._parts, self.fence)
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
