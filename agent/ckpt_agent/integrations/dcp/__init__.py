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

from ckpt_agent.integrations.dcp.common import (
    SECTION,
    CorruptedCheckpointError,
    metadata_from_json,
    metadata_to_json,
    step_of,
)
from ckpt_agent.integrations.dcp.reader import DcpReader, load_latest
from ckpt_agent.integrations.dcp.writer import DcpWriter

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
