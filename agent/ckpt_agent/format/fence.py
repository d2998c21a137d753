"""One writer per run: generations claimed in storage, and the fence check.

Every process that writes or deletes in a run (the trainer's rank 0, or the flash
sidecar that commits for it) first claims a **generation**: the next number after the
highest ``<run>/writers/<generation:012d>.json``, created with
:meth:`~ckpt_agent.storage.base.Storage.create_exclusive`, so two claimants never get the
same number (the loser of a race claims the next one). The highest generation holds
the run; a writer is **fenced** as soon as a higher generation exists. A claim is
never deleted, so generations are dense and the cheap check is one ``stat`` of
``writers/<own + 1>.json``. The record (bounded, parsed with the format's bounded
JSON reader) names the claimant for the fenced writer's error and for ``ckpt``::

    {"generation": 3, "namespace": "team-a", "job": "llm", "pod": "llm-worker-0",
     "node": "gpu-17", "host": "llm-worker-0", "pid": 41, "time": 1764990000.0,
     "nonce": "9f3c...", "version": 1}

:class:`Fence` is the writer's side: :meth:`Fence.check` before a save's first write,
right before ``COMMIT`` and before every batch of deletes (retention, blob GC); once
fenced it stays fenced and raises :class:`~ckpt_agent.errors.FencedError` naming the
holder. Torch-free; the pure parts (keys, records, the message) do no I/O.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ckpt_agent.errors import CheckpointFormatError, FencedError, NotFoundError, StorageError
from ckpt_agent.format.layout import loads, run_prefix
from ckpt_agent.format.termination import FencedReport, TerminationLog
from ckpt_agent.policy.agent_config import (
    ENV_JOB_NAME,
    ENV_NAMESPACE,
    ENV_NODE_NAME,
    ENV_POD_NAME,
    ENV_POD_UID,
)
from ckpt_agent.storage.base import Storage
from ckpt_agent.text import clean

__all__ = [
    "ENV_NODE_NAME",
    "ENV_POD_NAME",
    "WRITERS",
    "Fence",
    "WriterRecord",
    "claim",
    "fenced_error",
    "fenced_from_text",
    "fenced_report",
    "generations",
    "lost_by_this_pod",
    "parse_writer_name",
    "read_writer",
    "writer_key",
    "writers_prefix",
]

log = logging.getLogger(__name__)

WRITERS = "writers"
RECORD_VERSION = 1
#: A writer record is a few hundred bytes; anything larger is not one.
RECORD_MAX_BYTES = 4096
#: Characters kept of each text field (a Kubernetes name is at most 253).
FIELD_MAX_CHARS = 253
#: Generations are written with this many digits (sorted listings are numeric order).
GENERATION_DIGITS = 12
GENERATION_MAX = 10**GENERATION_DIGITS - 1
#: Lost races retried by :func:`claim` before it gives up.
CLAIM_ATTEMPTS = 64


#: How many claims before the holder's a pod's retake check reads (one per restart).
RETAKE_LOOKBACK = 64


def writers_prefix(run_id: str) -> str:
    return f"{run_prefix(run_id)}{WRITERS}/"


def writer_key(run_id: str, generation: int) -> str:
    if not 1 <= generation <= GENERATION_MAX:
        raise ValueError(f"generation {generation} is outside 1..{GENERATION_MAX}")
    return f"{writers_prefix(run_id)}{generation:0{GENERATION_DIGITS}d}.json"


def parse_writer_name(name: str) -> int | None:
    """The generation of a ``writers/`` file name; None for anything else."""
    stem, dot, ext = name.partition(".")
    if ext != "json" or not dot or len(stem) != GENERATION_DIGITS or not stem.isdigit():
        return None
    gen = int(stem)
    return gen if gen >= 1 else None


def _clean(value: object) -> str:
    """A text field as a record keeps it: a string, through the one sanitizer, bounded."""
    return clean(value, FIELD_MAX_CHARS) if isinstance(value, str) else ""


@dataclass(frozen=True)
class WriterRecord:
    """Who claimed one generation of a run."""

    generation: int
    namespace: str = ""
    job: str = ""
    pod: str = ""
    node: str = ""
    host: str = ""
    pid: int = 0
    time: float = 0.0
    nonce: str = ""
    pod_uid: str = ""

    @classmethod
    def here(cls, generation: int, environ: Mapping[str, str] | None = None) -> WriterRecord:
        """This process, as the downward API and the webhook's env describe it."""
        env = os.environ if environ is None else environ
        host = socket.gethostname()
        return cls(
            generation=generation,
            namespace=_clean(env.get(ENV_NAMESPACE, "")),
            job=_clean(env.get(ENV_JOB_NAME, "")),
            pod=_clean(env.get(ENV_POD_NAME) or env.get("HOSTNAME") or host),
            node=_clean(env.get(ENV_NODE_NAME, "")),
            host=_clean(host),
            pid=os.getpid(),
            time=time.time(),
            nonce=secrets.token_hex(16),
            pod_uid=_clean(env.get(ENV_POD_UID, "")),
        )

    def at(self, generation: int) -> WriterRecord:
        """The same claimant, for another generation (a lost race's next try)."""
        return WriterRecord(**{**self.__dict__, "generation": generation})

    def to_bytes(self) -> bytes:
        doc = {**self.__dict__, "version": RECORD_VERSION}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, what: str) -> WriterRecord:
        """Parse a record; :class:`CheckpointFormatError` when it is not one."""
        doc = loads(data, what, RECORD_MAX_BYTES)
        gen = doc.get("generation")
        if not isinstance(gen, int) or isinstance(gen, bool) or not 1 <= gen <= GENERATION_MAX:
            raise CheckpointFormatError(f"{what}: no valid generation")
        pid, at = doc.get("pid", 0), doc.get("time", 0.0)
        return cls(
            generation=gen,
            namespace=_clean(doc.get("namespace")),
            job=_clean(doc.get("job")),
            pod=_clean(doc.get("pod")),
            node=_clean(doc.get("node")),
            host=_clean(doc.get("host")),
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else 0,
            time=float(at) if isinstance(at, int | float) and not isinstance(at, bool) else 0.0,
            nonce=_clean(doc.get("nonce")),
            pod_uid=_clean(doc.get("pod_uid")),
        )

    def describe(self) -> str:
        """One line for a person: generation, pod, node, namespace/job, since when."""
        where = f"pod {self.pod or '?'}"
        if self.node:
            where += f" on node {self.node}"
        elif self.host and self.host != self.pod:
            where += f" on host {self.host}"
        if self.namespace:
            where += f" in namespace {self.namespace}"
        if self.job:
            where += f" (job {self.job})"
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time)) if self.time else "?"
        return f"generation {self.generation}: {where}, pid {self.pid}, claimed {when}"


def generations(storage: Storage, run_id: str) -> list[int]:
    """The run's claimed generations, ascending (other names under ``writers/`` ignored)."""
    out = []
    prefix = writers_prefix(run_id)
    for info in storage.list(prefix, delimiter="/"):
        gen = parse_writer_name(info.key[len(prefix) :])
        if gen is not None:
            out.append(gen)
    return sorted(out)


def read_writer(storage: Storage, run_id: str, generation: int) -> WriterRecord:
    """One claim's record (:class:`NotFoundError`, :class:`CheckpointFormatError`)."""
    key = writer_key(run_id, generation)
    return WriterRecord.from_bytes(storage.read(key, 0, RECORD_MAX_BYTES + 1), key)


def fenced_error(run_id: str, own: WriterRecord, holder: WriterRecord | None) -> FencedError:
    """The fenced writer's error: who holds the run now and what to do."""
    newer = holder.describe() if holder is not None else f"generation {own.generation + 1}"
    return FencedError(
        f"run {run_id} was taken over by a newer writer ({newer}); this process holds "
        f"generation {own.generation} ({own.describe()}) and has stopped writing and "
        "deleting in the run. Stop this process: it is a leftover of an earlier attempt "
        "(a pod on a lost node) or another job that uses the same run id; if the newer "
        "writer is the wrong one, give each job its own run id (ckpt.dev/run-id, "
        "CKPT_RUN_ID)",
        generation=own.generation,
        holder=newer,
    )


_TEXT_PREFIX = "FencedError: "
_TEXT_OWN = re.compile(r"this process holds generation (\d+)")
_TEXT_HOLDER = re.compile(r"taken over by a newer writer \((.*?)\); this process holds")


def fenced_from_text(text: str) -> FencedError | None:
    """The :class:`FencedError` another process reported as text (``"FencedError: ..."``,
    e.g. the flash persister's result marks), so the trainer stops as a fenced writer
    does; None for any other error text."""
    if not text.startswith(_TEXT_PREFIX):
        return None
    message = text[len(_TEXT_PREFIX) :]
    own, holder = _TEXT_OWN.search(message), _TEXT_HOLDER.search(message)
    return FencedError(
        message,
        generation=int(own.group(1)) if own else 0,
        holder=holder.group(1) if holder else "a newer writer",
    )


class Fence:
    """A claimed generation and its check (thread-safe; fenced is sticky)."""

    def __init__(self, storage: Storage, run_id: str, record: WriterRecord) -> None:
        self.storage = storage
        self.run_id = run_id
        self.record = record
        self._lock = threading.Lock()
        self._fenced: FencedError | None = None
        #: Called once, with the holder's record (None: unreadable), when this writer is
        #: first found fenced (the agent's termination report says so for the operator).
        self.on_fenced: Callable[[WriterRecord | None], None] | None = None

    @property
    def generation(self) -> int:
        return self.record.generation

    @property
    def fenced(self) -> FencedError | None:
        """The error, once a newer generation was seen (None while this writer holds)."""
        return self._fenced

    def check(self) -> None:
        """Raise :class:`FencedError` when a newer generation exists (one ``stat``)."""
        if self._fenced is not None:
            raise self._fenced
        nxt = self.generation + 1
        if nxt > GENERATION_MAX or not self.storage.exists(writer_key(self.run_id, nxt)):
            return
        self._fence(nxt)

    def _fence(self, newer: int) -> None:
        holder: WriterRecord | None
        try:  # the newest claim names the holder; its absence still fences
            highest = max([newer, *generations(self.storage, self.run_id)])
            holder = read_writer(self.storage, self.run_id, highest)
        except (StorageError, CheckpointFormatError, ValueError):
            holder = None
        with self._lock:
            first = self._fenced is None
            if self._fenced is None:
                self._fenced = fenced_error(self.run_id, self.record, holder)
            err = self._fenced
        if first and self.on_fenced is not None:
            try:
                self.on_fenced(holder)
            except Exception:  # telling about it must not hide the error itself
                log.exception("run %s: reporting that this writer was fenced failed", self.run_id)
        raise err


def claim(
    storage: Storage,
    run_id: str,
    *,
    environ: Mapping[str, str] | None = None,
    attempts: int = CLAIM_ATTEMPTS,
) -> Fence:
    """Claim the next generation of ``run_id`` (the highest + 1; a lost race tries the
    next). :class:`StorageError` when the storage fails, ``RuntimeError`` when every
    attempt lost a race (dozens of writers starting at once on one run)."""
    base = WriterRecord.here(1, environ)
    gens = generations(storage, run_id)
    lost = lost_by_this_pod(storage, run_id, base, gens)
    if lost is not None:  # a container restarted in place after it was fenced
        fence = Fence(storage, run_id, lost[0])
        fence.on_fenced = _report_to(TerminationLog.from_env(environ), fence)
        fence._fence(lost[1].generation)  # raises FencedError (the report says so first)
    nxt = (gens[-1] if gens else 0) + 1
    for _ in range(attempts):
        record = base.at(nxt)
        if storage.create_exclusive(writer_key(run_id, nxt), record.to_bytes()):
            fence = Fence(storage, run_id, record)
            fence.on_fenced = _report_to(TerminationLog.from_env(environ), fence)
            return fence
        gens = generations(storage, run_id)
        nxt = max(nxt, gens[-1] if gens else 0) + 1
    raise RuntimeError(
        f"run {run_id}: lost {attempts} races for a writer generation in a row: more "
        "writers are starting on this run than can hold it; give each job its own run id"
    )


def lost_by_this_pod(
    storage: Storage, run_id: str, own: WriterRecord, gens: list[int]
) -> tuple[WriterRecord, WriterRecord] | None:
    """``(this pod's older claim, the holder)`` when this pod (``CKPT_POD_UID``) held an
    older generation and another pod holds the run now; else None.

    A container restarted in place (``restartPolicy: OnFailure``/``ExitCode``, a crash
    loop) keeps its pod: after it was fenced, claiming again would fence the writer that
    holds the run now, and two pods would take it from each other forever. The holder's
    own container restarting in place (the highest claim is its pod's) claims as usual,
    and so does every new pod (a restarted job). Without a pod uid (outside Kubernetes)
    there is no rule. Reads the highest claim and at most :data:`RETAKE_LOOKBACK` older
    ones; unreadable records are passed over.
    """
    if not own.pod_uid or not gens:
        return None
    try:
        holder = read_writer(storage, run_id, gens[-1])
    except (NotFoundError, CheckpointFormatError):
        return None
    if holder.pod_uid == own.pod_uid:
        return None
    for gen in reversed(gens[-1 - RETAKE_LOOKBACK : -1]):
        try:
            older = read_writer(storage, run_id, gen)
        except (NotFoundError, CheckpointFormatError):
            continue
        if older.pod_uid == own.pod_uid:
            return older, holder
    return None


def _report_to(
    report: TerminationLog | None, fence: Fence
) -> Callable[[WriterRecord | None], None] | None:
    """The default :attr:`Fence.on_fenced`: the container's termination report says this
    writer was fenced, naming the holder (a checkpointer hands its own report instead,
    :mod:`ckpt_agent.runtime.save.fencing`); None without a termination log."""
    if report is None:
        return None

    def tell(holder: WriterRecord | None) -> None:
        assert report is not None
        report.mark_fenced(fence.run_id, fenced_report(fence, holder))

    return tell


def fenced_report(fence: Fence, holder: WriterRecord | None) -> FencedReport:
    """What the termination report says of a fenced writer: its generation, the holder."""
    return FencedReport(
        generation=fence.generation,
        holder=holder.generation if holder is not None else 0,
        pod=holder.pod if holder is not None else "",
        node=holder.node if holder is not None else "",
        at=time.time(),
    )


def holder_of(storage: Storage, run_id: str) -> WriterRecord | None:
    """The writer holding the run (the highest generation's record); None when no writer
    ever claimed it or the record is unreadable."""
    gens = generations(storage, run_id)
    if not gens:
        return None
    try:
        return read_writer(storage, run_id, gens[-1])
    except (NotFoundError, CheckpointFormatError):
        return None
