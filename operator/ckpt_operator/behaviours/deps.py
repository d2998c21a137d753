"""What every behaviour needs (:class:`Deps`) and the job status write they share."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_operator import constants as c
from ckpt_operator.config import OperatorConfig
from ckpt_operator.events import EventSink
from ckpt_operator.jobs import JobStatusAnnotation, format_time, job_facts
from ckpt_operator.kube import KubeApi
from ckpt_operator.metrics import Metrics
from ckpt_operator.sources import SourceFactory

__all__ = ["Deps", "Obj", "set_job_status"]

Obj = dict[str, Any]


@dataclass
class Deps:
    """Everything the operator's functions need (kopf passes it around in ``memo``)."""

    api: KubeApi
    events: EventSink
    metrics: Metrics
    sources: SourceFactory
    config: OperatorConfig = field(default_factory=OperatorConfig)
    clock: Callable[[], float] = time.time
    node_signals: dict[str, str] = field(default_factory=dict)
    """node name → last disruption request id signalled (avoids re-listing pods)."""


async def set_job_status(
    deps: Deps,
    job: Mapping[str, Any],
    state: str,
    reason: str,
    message: str,
    extra: Mapping[str, str | None] | None = None,
) -> None:
    """Write the job's status annotation (``state``, ``reason``, ``message``) and ``extra``."""
    facts = job_facts(job)
    status = JobStatusAnnotation(state, reason, message, format_time(deps.clock()))
    annotations: dict[str, str | None] = {c.ANN_STATUS: status.to_json()}
    annotations.update(extra or {})
    await deps.api.patch_job_annotations(facts.namespace, facts.name, annotations)
