"""The composition root of the persisting side: an :class:`AgentConfig` → working parts.

Storage (with :meth:`StorageOptions.for_config
<ckpt_agent.storage.options.StorageOptions.for_config>`), the writer (codec policy
from the compression section), the validator (its loader process gets the same
storage options), the local catalog and the
:class:`~ckpt_agent.persist.finalize.FinalizePipeline` are built here, once, the
same way for the trainer (:class:`~ckpt_agent.runtime.checkpointer.Checkpointer`)
and the sidecar (:mod:`ckpt_agent.flash.sidecar`); the CLI opens its storage with the
same options (:meth:`StorageOptions.for_config`, in :func:`ckpt_agent.cli.common.open_store`).

.. code-block:: python

    parts = PersistBuilder(config).build(work_dir / "catalog.sqlite", metrics=m, emit=log)
    parts.writer.write_rank(...); parts.finalizer.finalize(job)
    parts.close()
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ckpt_agent.format.shuffle import NUMPY_SHUFFLER
from ckpt_agent.format.termination import TerminationLog
from ckpt_agent.metrics import Metrics
from ckpt_agent.persist.catalog import Catalog
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.finalize import AnomalySource, EventSink, FinalizePipeline
from ckpt_agent.persist.validate import Validator
from ckpt_agent.persist.writer import BlobIndex, CheckpointWriter
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.storage import StorageOptions, open_storage
from ckpt_agent.storage.base import Storage

__all__ = ["PersistBuilder", "PersistParts"]


@dataclass
class PersistParts:
    """What :meth:`PersistBuilder.build` made (close them with :meth:`close`)."""

    storage: Storage
    index: BlobIndex
    writer: CheckpointWriter
    validator: Validator
    catalog: Catalog
    finalizer: FinalizePipeline
    owns_storage: bool = True
    """The storage was opened here (closed by :meth:`close`)."""

    def close(self) -> None:
        """Stop the validator's loader, the writer's pool, the catalog; the storage if owned."""
        self.validator.close()
        self.writer.close()
        self.catalog.close()
        if self.owns_storage:
            self.storage.close()


class PersistBuilder:
    """Builds the persisting parts of one run from its :class:`AgentConfig`.

    Args:
        config: the agent config (storage URL, S3 section, compression, validation,
            retention).
        storage: an already open storage (not closed by the parts); default: opened
            from ``config.storage_url`` with :meth:`storage_options`.
        environ: environment for the ``CKPT_S3_*`` defaults and ``CKPT_TERMINATION_LOG``
            (the pipeline's report file) (default ``os.environ``).
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        storage: Storage | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.run_id = config.run_id
        self._storage = storage
        self._environ = environ

    def storage_options(self) -> StorageOptions:
        """The environment's options with the policy's S3 section applied."""
        return StorageOptions.for_config(self.config, self._environ)

    def open_storage(self) -> tuple[Storage, bool]:
        """``(storage, opened_here)``: the given storage, or one opened from the config."""
        if self._storage is not None:
            return self._storage, False
        return open_storage(self.config.storage_url, self.storage_options()), True

    def writer(self, storage: Storage, index: BlobIndex | None = None) -> CheckpointWriter:
        """The checkpoint writer (codec policy from the compression section)."""
        return CheckpointWriter(
            storage,
            self.run_id,
            codec=CodecPolicy.from_spec(self.config.compression),
            index=index if index is not None else BlobIndex(),
            shuffler=NUMPY_SHUFFLER,
        )

    def validator(self, storage: Storage) -> Validator:
        """The validator; its loader process opens ``storage.url`` with :meth:`storage_options`
        (passed as ``CKPT_S3_*`` variables: the policy's S3 section reaches the child too)."""
        env = self.storage_options().to_env()
        return Validator(storage, self.run_id, self.config.validation, env=env)

    def build(
        self,
        catalog_path: str | Path,
        *,
        metrics: Metrics,
        emit: EventSink | None = None,
        anomalies: AnomalySource | None = None,
        gc_grace_s: float | None = None,
        store_lock: threading.Lock | None = None,
        tolerate_retention_errors: bool = False,
    ) -> PersistParts:
        """Storage, blob index, writer, validator, catalog and finalize pipeline.

        The keyword arguments after ``metrics`` go to :class:`FinalizePipeline`.
        """
        storage, owned = self.open_storage()
        index = BlobIndex()
        writer = self.writer(storage, index)
        validator = self.validator(storage)
        catalog = Catalog(catalog_path)
        finalizer = FinalizePipeline(
            storage,
            self.run_id,
            validator=validator,
            catalog=catalog,
            index=index,
            retention=self.config.retention,
            metrics=metrics,
            emit=emit,
            anomalies=anomalies,
            gc_grace_s=gc_grace_s,
            store_lock=store_lock,
            tolerate_retention_errors=tolerate_retention_errors,
            report=TerminationLog.from_env(self._environ),
        )
        return PersistParts(
            storage=storage,
            index=index,
            writer=writer,
            validator=validator,
            catalog=catalog,
            finalizer=finalizer,
            owns_storage=owned,
        )
