"""Pods that stopped because a newer writer holds their run (fenced); pure.

A writer of a run that finds a newer writer generation stops with
:class:`~ckpt_agent.errors.FencedError` and says so in its termination report
(:class:`~ckpt_agent.format.termination.FencedReport`, naming the holder's generation,
pod and node). That exit is not a crash: the run is held by a newer writer that is
already running (a zombie pod on a lost node after its job was restarted, or a second
job with the same run id). :func:`fenced_pods` finds those pods; the operator posts a
``WriterFenced`` Event naming the holder and does not restart the job from it
(:mod:`ckpt_operator.behaviours.recovery`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_agent.errors import TerminationReportError
from ckpt_agent.format.termination import FencedReport, parse_report
from ckpt_operator.model.bodies import Body, meta_of

__all__ = ["FencedPod", "fenced_message", "fenced_pods"]


@dataclass(frozen=True)
class FencedPod:
    """A pod whose container stopped fenced, and who holds its run."""

    pod: str
    container: str
    run_id: str
    fenced: FencedReport


def fenced_pods(pods: Iterable[Mapping[str, Any]]) -> list[FencedPod]:
    """The pods among ``pods`` with a container that stopped fenced (one entry a pod)."""
    out: list[FencedPod] = []
    for pod in pods:
        found = _fenced(pod)
        if found is not None:
            out.append(found)
    return out


def _fenced(pod: Mapping[str, Any]) -> FencedPod | None:
    status = Body(pod).status
    for key in ("containerStatuses", "initContainerStatuses"):
        for cs in status.get(key) or ():
            for state in ("state", "lastState"):
                message = ((cs.get(state) or {}).get("terminated") or {}).get("message")
                if not isinstance(message, str) or '"fenced"' not in message:
                    continue
                try:
                    report = parse_report(message)
                except TerminationReportError:  # not a report: the pod reports say why
                    continue
                if report.fenced is not None:
                    name = str(meta_of(pod).name)
                    return FencedPod(name, str(cs.get("name")), report.run_id, report.fenced)
    return None


def fenced_message(job: str, found: FencedPod) -> str:
    """The ``WriterFenced`` Event's message: which pod stopped, who holds the run, what
    the operator does and what a person may do."""
    f = found.fenced
    return (
        f"pod {found.pod} of {job} stopped writing run {found.run_id}: it was fenced by a "
        f"newer writer (holder: {f.describe()}; this pod held generation {f.generation}). "
        "It is not a crash and is not restarted: the holder is already running. If the "
        "holder is another job using the same run id by mistake, give each job its own "
        "run id (ckpt.dev/run-id)"
    )
