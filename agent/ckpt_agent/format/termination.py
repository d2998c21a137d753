"""The checkpoint report a container leaves in its termination message (torch-free).

The operator cannot always read a policy's storage: a PersistentVolumeClaim lives in the
job's namespace and is mounted only into the job's pods. What it can always read is the
pod's status, and the kubelet copies the file named by the container's
``terminationMessagePath`` (default ``/dev/termination-log``) into
``status.containerStatuses[].state.terminated.message`` (and later ``lastState``) however
the container ends: exit, SIGKILL, OOM kill. So the agent keeps the run's newest
checkpoints and their verdicts in that file, rewritten when it starts, after every
validation verdict, and before a start fails on a checkpoint it cannot restore; the
operator reads them back (:func:`parse_report`) when it cannot list the storage itself.
The agent writes (:class:`TerminationLog`) and the operator parses with this one module.

Format, version 1: one line of JSON, then ``\\n``::

    {"format": "ckpt.dev/checkpoints", "v": 1, "run": "<run id>", "at": <unix time>,
     "cps": [{"s": <step>, "t": "<tier>", "st": "<status>", "at": <unix time>,
              "h": "<manifest hash, first 16 hex>", "p": "<previous link's hash, 16 hex>",
              "f": "<flags: l lightweight, a approximate, e emergency>",
              "vt": <unix time of a corrupted verdict>}, ...]}

A writer stopped because a newer writer holds its run (:class:`~ckpt_agent.errors.FencedError`,
:mod:`ckpt_agent.format.fence`) adds ``"fenced": {"g": <its generation>, "hg": <the
holder's generation>, "pod": "<holder's pod>", "node": "<holder's node>", "at": <unix
time>}`` (:class:`FencedReport`): the operator tells a fenced exit from a crash by it
(an Event naming the holder, and no restart: the holder is already running). Readers
that do not know the key ignore it.

``cps`` is newest first (step, then tier); ``p``, ``f`` and ``vt`` are left out when empty.
Statuses: ``valid``, and ``corrupted`` (failed validation, or found corrupted by a resume),
which carries ``vt``, the time it was known corrupted: ``at`` is the commit's time, the same
in every report of one checkpoint, so two reports of one commit are told apart by ``vt``
(:func:`merge_checkpoints`). The checkpoint id is ``<tier>_step_<step>``
(:func:`ckpt_agent.records.checkpoint_id`). A report is at most :data:`MAX_BYTES` (the
kubelet keeps 4096 bytes per container and 12 KiB per pod): the oldest checkpoints are
dropped to fit. Its entries are the writer's listing of the storage, from the oldest
entry's step up (:meth:`CheckpointReport.covers`).

:func:`parse_report` reads anything (a termination message is the application's to write,
and the operator's ``ckpt.dev/checkpoints`` annotation is editable): whatever is not a
report of this format, however deep, long or odd, is a :class:`TerminationReportError`.

Writing happens in place (the file is a bind mount: nothing can be renamed over it): one
``pwrite`` of the whole line at offset 0, then a truncate. A reader takes the first line
only, so a kill between the two leaves the new report followed by stale bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_agent.errors import TerminationReportError
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, checkpoint_id

__all__ = [
    "DEFAULT_PATH",
    "ENV_PATH",
    "FORMAT",
    "MAX_BYTES",
    "VERSION",
    "CheckpointReport",
    "FencedReport",
    "ReportedCheckpoint",
    "TerminationLog",
    "encode_report",
    "merge_checkpoints",
    "parse_report",
]

log = logging.getLogger(__name__)

FORMAT = "ckpt.dev/checkpoints"
VERSION = 1
#: Upper bound of an encoded report (bytes, newline included); well under the kubelet's 4 KiB.
MAX_BYTES = 2048
#: Hex digits of a manifest hash kept in the report (identity within a run; links the chain).
HASH_CHARS = 16
#: Environment variable naming the file (the webhook sets it to the container's
#: ``terminationMessagePath``); empty: do not write.
ENV_PATH = "CKPT_TERMINATION_LOG"
#: The Kubernetes default ``terminationMessagePath``.
DEFAULT_PATH = "/dev/termination-log"
#: Longest first line :func:`parse_report` reads (the kubelet keeps 4096 bytes; the
#: operator's annotation is written by :func:`encode_report`, within :data:`MAX_BYTES`).
MAX_PARSE_CHARS = 16384
#: Statuses a report carries: what a restart may use, and what it must not.
_REPORTED = (CheckpointStatus.VALID, CheckpointStatus.CORRUPTED)
_TIER_ORDER = {Tier.HEARTBEAT: 0, Tier.PULSE: 1, Tier.FULL: 2}
_FLAGS = (("l", "lightweight"), ("a", "approximate"), ("e", "emergency"))
#: Characters kept of a fenced report's pod and node names (Kubernetes names: 253).
_NAME_CHARS = 253


@dataclass(frozen=True)
class FencedReport:
    """This writer stopped because a newer writer holds the run (a fenced exit, not a crash)."""

    generation: int
    """The stopped writer's generation."""
    holder: int
    """The holder's generation (0: unknown)."""
    pod: str = ""
    node: str = ""
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "g": self.generation,
            "hg": self.holder,
            "pod": self.pod[:_NAME_CHARS],
            "node": self.node[:_NAME_CHARS],
            "at": round(self.at, 3),
        }

    @classmethod
    def from_json(cls, data: object) -> FencedReport:
        if not isinstance(data, Mapping):
            raise TerminationReportError(f"'fenced' is {type(data).__name__}, not a map")
        try:
            g, hg = data["g"], data.get("hg", 0)
            for n in (g, hg):
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"generation {n!r} is not a non-negative integer")
            pod, node = data.get("pod", ""), data.get("node", "")
            if not isinstance(pod, str) or not isinstance(node, str):
                raise ValueError("pod and node must be strings")
            return cls(g, hg, pod[:_NAME_CHARS], node[:_NAME_CHARS], _time(data.get("at", 0.0)))
        except (KeyError, ValueError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise TerminationReportError(f"bad 'fenced' entry: {_clip(what)}") from None

    def describe(self) -> str:
        """The holder, for a person: generation, pod, node."""
        who = f"generation {self.holder or '?'}"
        if self.pod:
            who += f", pod {self.pod}"
        if self.node:
            who += f" on node {self.node}"
        return who


@dataclass(frozen=True)
class ReportedCheckpoint:
    """One verified checkpoint as a report carries it."""

    step: int
    tier: Tier
    status: CheckpointStatus
    created_at: float
    manifest_hash: str = ""
    prev_hash: str | None = None
    lightweight: bool = False
    approximate: bool = False
    emergency: bool = False
    verdict_at: float = 0.0
    """When it was known corrupted (0 for a valid one)."""

    @property
    def id(self) -> str:
        return checkpoint_id(self.tier, self.step)

    @property
    def order(self) -> tuple[int, int, float]:
        """Newest is largest: step, then tier, then commit time."""
        return (self.step, _TIER_ORDER[self.tier], self.created_at)

    @property
    def merge_key(self) -> tuple[float, float]:
        """Of two entries with one id the larger wins: a later commit, then a later verdict."""
        return (self.created_at, self.verdict_at)

    @classmethod
    def from_record(cls, r: CheckpointRecord, verdict_at: float = 0.0) -> ReportedCheckpoint:
        """``verdict_at``: when a corrupted ``r`` was known corrupted (ignored when valid)."""
        corrupted = r.status == CheckpointStatus.CORRUPTED
        return cls(
            step=r.step,
            tier=r.tier,
            status=r.status,
            created_at=round(r.created_at, 3),
            manifest_hash=r.manifest_hash[:HASH_CHARS],
            prev_hash=r.prev_hash[:HASH_CHARS] if r.prev_hash else None,
            lightweight=r.lightweight,
            approximate=r.approximate,
            emergency=r.emergency,
            verdict_at=round(verdict_at, 3) if corrupted else 0.0,
        )

    def to_record(self) -> CheckpointRecord:
        """The record the recovery ladder and retention status take (hashes shortened)."""
        return CheckpointRecord(
            id=self.id,
            step=self.step,
            tier=self.tier,
            status=self.status,
            created_at=self.created_at,
            manifest_hash=self.manifest_hash,
            prev_hash=self.prev_hash,
            lightweight=self.lightweight,
            approximate=self.approximate,
            emergency=self.emergency,
            reason="reported by the pod (termination message)",
            extra={"status_reason": "a pod found it corrupted"} if self.verdict_at else {},
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "s": self.step,
            "t": self.tier.value,
            "st": self.status.value,
            "at": self.created_at,
            "h": self.manifest_hash,
        }
        if self.prev_hash:
            out["p"] = self.prev_hash
        flags = "".join(c for c, name in _FLAGS if getattr(self, name))
        if flags:
            out["f"] = flags
        if self.verdict_at:
            out["vt"] = self.verdict_at
        return out

    @classmethod
    def from_json(cls, data: object) -> ReportedCheckpoint:
        if not isinstance(data, Mapping):
            raise TerminationReportError(f"a checkpoint entry is {type(data).__name__}, not a map")
        try:
            step = data["s"]
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"step {step!r} is not a non-negative integer")
            at, vt = _time(data["at"]), _time(data.get("vt", 0.0))
            h, p, f = data.get("h", ""), data.get("p"), data.get("f", "")
            if not isinstance(h, str) or not (p is None or isinstance(p, str)):
                raise ValueError("hashes must be strings")
            if not isinstance(f, str):
                raise ValueError(f"flags {f!r} are not a string")
            return cls(
                step=step,
                tier=Tier(data["t"]),
                status=CheckpointStatus(data["st"]),
                created_at=float(at),
                manifest_hash=h,
                prev_hash=p or None,
                verdict_at=vt,
                **{name: c in f for c, name in _FLAGS},
            )
        except (KeyError, ValueError, TypeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise TerminationReportError(
                f"bad checkpoint entry {_clip(repr(dict(data)))}: {_clip(what)}"
            ) from None


def _time(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"time {_clip(repr(value))} is not a number")
    if not math.isfinite(value):
        raise ValueError(f"time {value!r} is not finite")
    return float(value)


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"


@dataclass(frozen=True)
class CheckpointReport:
    """A run's newest verified checkpoints, newest first."""

    run_id: str
    checkpoints: tuple[ReportedCheckpoint, ...] = ()
    written_at: float = 0.0
    fenced: FencedReport | None = None
    """Set when the writer stopped because a newer writer holds the run."""

    @classmethod
    def from_records(
        cls, run_id: str, records: Iterable[CheckpointRecord], written_at: float = 0.0
    ) -> CheckpointReport:
        """The reportable records (valid and corrupted ones; the newest heartbeat included),
        newest first; a corrupted one is known corrupted at ``written_at``."""
        kept = [
            ReportedCheckpoint.from_record(r, written_at) for r in records if r.status in _REPORTED
        ]
        return cls(run_id, merge_checkpoints(kept), written_at)

    def covers(self, step: int) -> bool:
        """Whether this report's listing reaches back past ``step`` (its entries are what the
        writer's storage held from its oldest entry's step up; older ones were left out to
        fit): a checkpoint at a later step that it does not name was gone when it was written."""
        return bool(self.checkpoints) and step > self.checkpoints[-1].step

    def records(self) -> list[CheckpointRecord]:
        """As records, oldest first (like :func:`ckpt_agent.format.listing.list_checkpoints`)."""
        return [c.to_record() for c in reversed(self.checkpoints)]


def merge_checkpoints(*groups: Iterable[ReportedCheckpoint]) -> tuple[ReportedCheckpoint, ...]:
    """Union by id, newest first; of two entries with one id the later commit wins, and of
    one commit the later verdict (a corrupted verdict over the valid one it replaces)."""
    by_id: dict[str, ReportedCheckpoint] = {}
    for group in groups:
        for cp in group:
            old = by_id.get(cp.id)
            if old is None or cp.merge_key >= old.merge_key:
                by_id[cp.id] = cp
    return tuple(sorted(by_id.values(), key=lambda c: c.order, reverse=True))


def _line(report: CheckpointReport, entries: Sequence[ReportedCheckpoint]) -> bytes:
    doc = {
        "format": FORMAT,
        "v": VERSION,
        "run": report.run_id,
        "at": round(report.written_at, 3),
        "cps": [e.to_json() for e in entries],
    }
    if report.fenced is not None:
        doc["fenced"] = report.fenced.to_json()
    return (json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n").encode()


def encode_report(report: CheckpointReport, max_bytes: int = MAX_BYTES) -> bytes:
    """One line of JSON of at most ``max_bytes``: the newest checkpoints that fit."""
    size = len(_line(report, []))
    if size > max_bytes:
        raise TerminationReportError(
            f"a report of run {report.run_id!r} does not fit {max_bytes} bytes even without "
            "checkpoints: use a shorter run id"
        )
    entries: list[ReportedCheckpoint] = []
    for cp in report.checkpoints:  # newest first
        size += len(json.dumps(cp.to_json(), separators=(",", ":"))) + (1 if entries else 0)
        if size > max_bytes:
            break
        entries.append(cp)
    return _line(report, entries)


def parse_report(text: str | bytes) -> CheckpointReport:
    """The report in a termination message (its first line); :class:`TerminationReportError`
    saying what is wrong when it is not one (e.g. the application wrote its own message) —
    never any other exception, whatever ``text`` holds."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise TerminationReportError(f"the termination message is {type(text).__name__}, not text")
    first = text.split("\n", 1)[0].strip()
    if not first:
        raise TerminationReportError("the termination message is empty: no checkpoint report")
    if len(first) > MAX_PARSE_CHARS:
        raise TerminationReportError(
            f"the termination message is not a checkpoint report ({len(first)} characters; a "
            f"report has at most {MAX_PARSE_CHARS}): {first[:80]!r}"
        )
    try:
        doc = json.loads(first, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        what = "nested too deep" if isinstance(e, RecursionError) else "not JSON"
        raise TerminationReportError(
            f"the termination message is not a checkpoint report ({what}): {first[:80]!r}"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TerminationReportError(
            f"the termination message is not a checkpoint report (no format {FORMAT!r}): "
            f"{first[:80]!r}"
        )
    if doc.get("v") != VERSION:
        raise TerminationReportError(
            f"checkpoint report version {doc.get('v')!r} is not supported (this reader knows "
            f"{VERSION}): upgrade the operator to the agent's version"
        )
    run, cps = doc.get("run"), doc.get("cps")
    if not isinstance(run, str) or not run:
        raise TerminationReportError("checkpoint report without a run id")
    if not isinstance(cps, list):
        raise TerminationReportError(f"checkpoint report of run {run!r}: 'cps' is not a list")
    try:
        at = _time(doc.get("at", 0.0))
    except ValueError as e:
        raise TerminationReportError(f"checkpoint report of run {run!r}: {e}") from None
    entries = merge_checkpoints(ReportedCheckpoint.from_json(e) for e in cps)
    fenced = doc.get("fenced")
    return CheckpointReport(
        run, entries, at, None if fenced is None else FencedReport.from_json(fenced)
    )


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number a report holds")


class TerminationLog:
    """The agent's writer of its container's termination message (see the module doc)."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = MAX_BYTES) -> None:
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.failed = False
        #: Set by :meth:`mark_fenced`: every later report says so.
        self.fenced: FencedReport | None = None
        self._last: tuple[str, tuple[CheckpointRecord, ...]] | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TerminationLog | None:
        """``$CKPT_TERMINATION_LOG`` (empty: none), else the Kubernetes default when that
        file exists (the kubelet creates it; never created here), else None."""
        env = os.environ if environ is None else environ
        path = env.get(ENV_PATH)
        if path is not None:
            return cls(path) if path else None
        return cls(DEFAULT_PATH) if os.path.isfile(DEFAULT_PATH) else None

    def write(self, run_id: str, records: Iterable[CheckpointRecord]) -> CheckpointReport:
        """Rewrite the file with the run's verified ``records``; a failure is logged once."""
        kept = tuple(records)
        self._last = (run_id, kept)
        report = dataclasses.replace(
            CheckpointReport.from_records(run_id, kept, time.time()), fenced=self.fenced
        )
        try:
            data = encode_report(report, self.max_bytes)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
        except (OSError, TerminationReportError) as e:
            if not self.failed:
                log.warning(
                    "cannot write the checkpoint report to %s (%s): the operator will not see "
                    "this pod's checkpoints if it cannot read the storage itself",
                    self.path,
                    e,
                )
            self.failed = True
        return report

    def mark_fenced(self, run_id: str, fenced: FencedReport) -> CheckpointReport:
        """Rewrite the report saying this writer was fenced (its last checkpoints kept)."""
        self.fenced = fenced
        if self._last is None:  # another process's log of this file: keep what it reported
            self._last = (run_id, self._reported(run_id))
        last_run, records = self._last
        return self.write(run_id, records if last_run == run_id else ())

    def _reported(self, run_id: str) -> tuple[CheckpointRecord, ...]:
        """The checkpoints the file reports now for ``run_id`` (none when unreadable)."""
        try:
            with open(self.path, "rb") as f:
                report = parse_report(f.read(MAX_PARSE_CHARS))
        except (OSError, TerminationReportError):
            return ()
        return tuple(report.records()) if report.run_id == run_id else ()
