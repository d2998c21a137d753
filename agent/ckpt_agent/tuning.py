"""Engine constants with one home each (torch-free, no I/O).

Values that are part of the on-storage format live in
:mod:`ckpt_agent.format.layout`; these are operating choices. Where a policy or
constructor argument can override one, the argument's docstring names it.
"""

from __future__ import annotations

from typing import Final

#: Raw bytes per chunk of a tensor payload (hashed, compressed and stored as one blob).
#: ``docs/format.md`` documents it as the chunk size readers may assume at most.
CHUNK_BYTES: Final = 16 * 1024 * 1024

#: Alignment of the host buffers and shared-memory tensors at least ``DIRECT_IO_MIN_BYTES``
#: long (address and, for chunks, file offset), so that the filesystem backend can write
#: them with ``O_DIRECT`` (the page size: what every Linux filesystem accepts).
DIRECT_IO_ALIGN: Final = 4096
#: Buffers shorter than this are written through the page cache (one syscall either way).
DIRECT_IO_MIN_BYTES: Final = 1024 * 1024

#: Unreferenced blobs younger than this are kept by blob GC: another writer (a rank,
#: the sidecar, an in-flight save) may be about to reference them.
GC_GRACE_S: Final = 3600.0

#: Committed checkpoints waiting for validation before new saves wait for the validator.
VALIDATION_BACKLOG: Final = 4

#: Largest sample written to measure storage latency for the system signal layer.
LATENCY_SAMPLE_MAX_BYTES: Final = 1024 * 1024

#: Seconds a write-latency sample stays evidence for the system layer: writes come in
#: bursts (saves), and a sample held past its burst would make one slow write read as
#: latency sustained for as long as no other write came.
LATENCY_SAMPLE_MAX_AGE_S: Final = 2.0

#: Write throughput (bytes/s) a local/shared filesystem is assumed to take before the
#: writer measured it (codec ``auto``: "fast", compression rarely pays).
ASSUMED_WRITE_BPS_LOCAL: Final = 1024.0 * 1024 * 1024
#: The same for object stores and unknown backends ("slow": compression often pays).
ASSUMED_WRITE_BPS_REMOTE: Final = 32.0 * 1024 * 1024

#: Pending checkpoints (committed, no verdict yet: the process died between commit and
#: validation) newer than the newest valid one that a restore validates itself and promotes
#: before it chooses, newest first (``decide.lineage.pending_to_verify``); older ones wait
#: for the persister's own validation.
MAX_PENDING_PROMOTIONS: Final = 3


def gc_grace_for(world_size: int) -> float:
    """Blob GC grace: none for a single writer, :data:`GC_GRACE_S` when others may write."""
    return 0.0 if world_size == 1 else GC_GRACE_S


#: ``on_persist_error="auto"``: how long retryable storage failures may keep every save
#: from committing before the training thread raises (the job fails visibly instead of
#: training on without a checkpoint). A 30 s outage is ridden out; ten minutes is not.
PERSIST_OUTAGE_TOLERANCE_S: Final = 600.0

#: Reads of one candidate checkpoint at start that fail with a retryable storage error
#: (an EIO, a reset connection) before the start fails (nothing is marked corrupted).
RESTORE_READ_ATTEMPTS: Final = 3
#: Pause before the first re-read (doubled each time).
RESTORE_READ_BACKOFF_S: Final = 0.5

#: Reads of one chunk that fail with a retryable storage error before the read fails
#: (the restorer then retries the whole candidate, see RESTORE_READ_ATTEMPTS).
CHUNK_READ_ATTEMPTS: Final = 3
#: Pause before a chunk's first re-read (doubled each time).
CHUNK_READ_BACKOFF_S: Final = 0.2

#: Timeout of the agent's own gloo process groups (the per-step agreement and the two-phase
#: commit): a rank that died or hung fails the collective, and the save, after this long.
#: ``Checkpointer(dist_timeout_s=...)`` overrides it.
DIST_TIMEOUT_S: Final = 600.0

#: Flash checkpoints: how long a local persister process may take to start (it imports no
#: torch: about a second).
SHM_PERSISTER_START_TIMEOUT_S: Final = 30.0
#: Before resuming: how long the trainer waits for a persister to handle the complete
#: snapshots a dead trainer left in shared memory.
SHM_FLUSH_TIMEOUT_S: Final = 120.0
#: A rank restarted on another node asks its sidecar for its snapshot from a peer's replica
#: (``FlashTarget.rehydrate``): how long it waits for a sidecar to take its area (none: no
#: sidecar runs), and for the answer (the replica is fetched over the network meanwhile).
REHYDRATE_CLAIM_S: Final = 2.0
REHYDRATE_TIMEOUT_S: Final = 300.0
#: The sidecar asks each peer which replicas it holds with this timeout (a peer not up yet
#: must not hold a fresh start back for long).
REHYDRATE_LIST_TIMEOUT_S: Final = 2.0
#: A peer that refuses the connection (its sidecar is starting: every pod of a job starts
#: at once, or the peer's sidecar restarted) is asked again for this long.
REHYDRATE_REFUSED_RETRY_S: Final = 3.0
#: ``close()`` without a timeout: how long the shared-memory persister waits for its local
#: persister process to finish.
SHM_CLOSE_TIMEOUT_S: Final = 300.0

#: The most candidate checkpoints one resume verifies (loads and checks) on the recovery
#: ladder (``decide.recovery.plan_recovery``), newest first: forged or foreign checkpoints
#: cannot make ``start()`` load without end (2,000 forged ones once took it 37 s). The
#: default ladder of a healthy run holds far fewer (the newest, its chain of
#: ``maxChainLinks`` links, the newest full, the heartbeat rebuilds). A start that reaches
#: the bound without a usable one fails and says so (it never goes back past candidates
#: it did not try): name the checkpoint with ``ckpt recover --manual --step N --force``.
MAX_RESUME_CANDIDATES: Final = 32


#: How long a just-in-time save waits for a free shared-memory slot before it gives up
#: (the process is on its way out; the persister frees a slot once it handled the previous
#: snapshot).
JIT_SLOT_WAIT_S: Final = 10.0
