"""The persisting agent: turns shared-memory snapshots into committed, validated checkpoints.

Runs as the pod's native sidecar container (``ckpt sidecar``, injected by the
operator with the same ``CKPT_*`` environment and mounts as the trainer) or,
for a local run, as a subprocess the :class:`~ckpt_agent.runtime.checkpointer.Checkpointer`
starts (``python -m ckpt_agent.cli sidecar --exit-with-trainer``). Torch-free: it
starts in a fraction of a second and never unpickles anything.

What it does, in a loop (every ``--poll-s``):

* for every rank area under ``$CKPT_SHM_DIR/<run>/`` (:mod:`ckpt_agent.flash.protocol`):
  takes the newest complete snapshot not handled yet (never a half-written
  one), writes it as that rank's part — chunk, de-duplicate, compress, hash,
  write — records its chunk hashes next to it (for in-place restarts), and
  releases the slot;
* the coordinator (the sidecar serving rank 0) waits until every rank's part
  of that checkpoint is in storage with the same save token, verifies each
  one against its hash, publishes ``COMMIT``, validates every rank (load
  check, shapes), records the verdict, updates the catalog, applies
  retention and collects unreferenced blobs;
* tells the trainer what happened (``persisted.json``: the commit hash or the
  error), so its scheduler and its ``wait``/``save_now`` see the result;
* watches each trainer's liveness (a lock the trainer holds for its life):
  when a trainer dies, its newest complete snapshot is persisted (it was
  already being handled; death never loses it);
* probes storage write latency and reads GPU error counts through NVML (when
  ``pynvml`` and a GPU are there; otherwise healthy), publishes them for the
  trainer's scheduler (``health.json``) and as Prometheus metrics, and serves
  ``/metrics``, ``/healthz`` and ``/readyz`` on ``CKPT_METRICS_PORT``.

SIGTERM (eviction, drain) starts an *emergency drain*: every complete
snapshot not yet persisted is persisted now, newest first, waiting for a
still-running trainer's final snapshot, and the process exits before the
grace period (``--grace-s``, default 25 s) ends. The operator's save-now
signal file, when it changes, makes the sidecar log the request and flush
whatever complete snapshot is pending (the trainer takes the new snapshot).

Modules, one job each: :mod:`.loop` (:class:`Sidecar`, the loop), :mod:`.discovery`
(areas, trainer liveness), :mod:`.persisting` (a snapshot → its rank's part),
:mod:`.commit` (the coordinator's commit and the finalize pipeline), :mod:`.health`
(storage probe, GPU errors), :mod:`.drain` (SIGTERM drain, save-now signal),
:mod:`.options` (flags and config), :mod:`.metrics`. The command line is
``ckpt sidecar`` (:mod:`ckpt_agent.cli.sidecar`).
"""

from ckpt_agent.flash.sidecar.health import GpuHealth, HealthMonitor, StorageProbe
from ckpt_agent.flash.sidecar.loop import Sidecar, run_sidecar
from ckpt_agent.flash.sidecar.metrics import SidecarMetrics
from ckpt_agent.flash.sidecar.options import SidecarOptions, load_config

__all__ = [
    "GpuHealth",
    "HealthMonitor",
    "Sidecar",
    "SidecarMetrics",
    "SidecarOptions",
    "StorageProbe",
    "load_config",
    "run_sidecar",
]
