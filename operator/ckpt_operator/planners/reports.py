"""What the pods reported about their checkpoints (termination messages); pure.

When the operator cannot read a policy's storage (local storage on a PVC or a node path:
mounted in the job's pods only), the pods tell it: the agent keeps the run's newest
verified checkpoints in its container's termination message
(:mod:`ckpt_agent.format.termination`), which the kubelet reports in the pod status
however the container ended. :func:`pod_reports` reads them back, :func:`known_checkpoints`
merges them with what the job already carries (``ckpt.dev/checkpoints``, written by the
operator and copied onto each restart), and :func:`last_verified` says which one a
restart would start from. A message that is not a report (however malformed: it is the
application's file, and the annotation is editable) is skipped with a reason, never an
error.

A report is its writer's listing of the storage (valid and corrupted checkpoints, the
newest heartbeat): the newest pod report, when it is at least as new as what the job
carries, also says which carried checkpoints are gone (deleted by retention in the pod, or
lost) — those in its range that it does not name are dropped. A checkpoint a pod found
corrupted keeps that verdict over an older report that called it valid
(:func:`~ckpt_agent.format.termination.merge_checkpoints`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_agent.errors import TerminationReportError
from ckpt_agent.format.termination import (
    CheckpointReport,
    ReportedCheckpoint,
    encode_report,
    merge_checkpoints,
    parse_report,
)
from ckpt_agent.records import CheckpointStatus
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jobs import format_time

__all__ = [
    "KnownCheckpoints",
    "PodReport",
    "known_checkpoints",
    "last_verified",
    "last_verified_json",
    "newest_entry",
    "pod_reports",
    "reported_status",
]


@dataclass(frozen=True)
class PodReport:
    """One container's report, with where it came from."""

    pod: str
    container: str
    report: CheckpointReport


@dataclass(frozen=True)
class KnownCheckpoints:
    """A run's checkpoints as reported (merged), and what could not be read."""

    report: CheckpointReport
    problems: tuple[str, ...] = ()

    @property
    def annotation(self) -> str:
        """The ``ckpt.dev/checkpoints`` value (bounded like a termination message)."""
        return encode_report(self.report).decode().strip()


def _messages(pod: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    status = Body(pod).status
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in status.get(key) or ():
            for state in ("state", "lastState"):
                terminated = (cs.get(state) or {}).get("terminated") or {}
                message = terminated.get("message")
                if isinstance(message, str) and message:
                    yield str(cs.get("name")), message


def pod_reports(pods: Iterable[Mapping[str, Any]]) -> tuple[list[PodReport], list[str]]:
    """Every checkpoint report in the pods' container statuses, and the unreadable ones."""
    reports: list[PodReport] = []
    problems: list[str] = []
    for pod in pods:
        name = str(meta_of(pod).name)
        for container, message in _messages(pod):
            try:
                reports.append(PodReport(name, container, parse_report(message)))
            except TerminationReportError as e:
                problems.append(f"pod {name} container {container}: {e}")
    return reports, problems


def known_checkpoints(
    run_id: str, carried: Iterable[str | None], reports: Sequence[PodReport]
) -> KnownCheckpoints:
    """``run_id``'s checkpoints from jobs' ``ckpt.dev/checkpoints`` (``carried``) and the
    pods' reports (other runs' reports are left out)."""
    groups: list[tuple[ReportedCheckpoint, ...]] = []
    problems: list[str] = []
    written = 0.0
    newest: CheckpointReport | None = None
    for text in carried:
        if not text:
            continue
        try:
            old = parse_report(text)
        except TerminationReportError as e:
            problems.append(f"annotation {c.ANN_CHECKPOINTS}: {e}")
            continue
        if old.run_id == run_id:
            groups.append(old.checkpoints)
            written = max(written, old.written_at)
    for pr in reports:
        if pr.report.run_id != run_id:
            problems.append(
                f"pod {pr.pod} container {pr.container} reports run {pr.report.run_id!r}, "
                f"not {run_id!r}: ignored"
            )
            continue
        groups.append(pr.report.checkpoints)
        if newest is None or pr.report.written_at > newest.written_at:
            newest = pr.report
    merged = merge_checkpoints(*groups)
    if newest is not None and newest.written_at >= written:  # newer than what was carried
        listed = {cp.id for cp in newest.checkpoints}
        merged = tuple(cp for cp in merged if cp.id in listed or not newest.covers(cp.step))
        written = newest.written_at
    return KnownCheckpoints(CheckpointReport(run_id, merged, written), tuple(problems))


def last_verified(report: CheckpointReport, source: str = "pods") -> dict[str, Any] | None:
    """``{checkpointId, step, tier, time, source}`` of the newest verified weights checkpoint
    (what a restart resumes from first), None when there is none."""
    for cp in report.checkpoints:  # newest first
        if cp.status == CheckpointStatus.VALID and cp.to_record().has_weights:
            out: dict[str, Any] = {
                "checkpointId": cp.id,
                "step": cp.step,
                "tier": cp.tier.value,
                "source": source,
            }
            if cp.created_at > 0:
                out["time"] = format_time(cp.created_at)
            return out
    return None


def last_verified_json(report: CheckpointReport, source: str = "pods") -> str | None:
    """:func:`last_verified` as the ``ckpt.dev/last-verified-checkpoint`` annotation value."""
    entry = last_verified(report, source)
    return json.dumps(entry, sort_keys=True) if entry is not None else None


def reported_status(
    runs: Mapping[str, CheckpointReport],
    *,
    previous: Mapping[str, Any] | None,
    jobs: int,
    now: float,
) -> dict[str, Any]:
    """Policy status fields (camelCase) from the pods' reports, for storage the operator
    cannot read: counts of the reported checkpoints, the newest verified one per run
    (``lastValid``) and overall (``lastVerifiedCheckpoint``). Byte and retention counters
    are the pods' business and keep their previous values."""
    prev = previous or {}
    last_valid: dict[str, dict[str, Any]] = {}
    reported = valid = 0
    for run_id, report in sorted(runs.items()):
        reported += len(report.checkpoints)
        valid += sum(1 for cp in report.checkpoints if cp.status == CheckpointStatus.VALID)
        entry = last_verified(report)
        if entry is not None:
            last_valid[run_id] = entry
    status: dict[str, Any] = {
        "jobs": jobs,
        "runs": len(runs),
        "checkpoints": reported,
        "validCheckpoints": valid,
        "bytesStored": int(prev.get("bytesStored") or 0),
        "deletedByRetention": int(prev.get("deletedByRetention") or 0),
        "lastValid": last_valid,
        "lastRetentionTime": format_time(now),
    }
    newest = newest_entry(last_valid)
    if newest is not None:
        status["lastVerifiedCheckpoint"] = newest
    return status


def newest_entry(last_valid: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest of ``lastValid``'s entries (by time, then step), with its ``runId``."""
    best: tuple[str, int, str] | None = None
    for run_id, entry in last_valid.items():
        key = (str(entry.get("time") or ""), int(entry.get("step") or 0), run_id)
        if best is None or key > best:
            best = key
    if best is None:
        return None
    return {**last_valid[best[2]], "runId": best[2]}
