"""The job kinds the operator serves, and which one an object or a pod belongs to."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.kinds.pytorchjob import PYTORCHJOB
from ckpt_operator.kinds.trainjob import TRAINJOB
from ckpt_operator.model.jobs import owner_job_name

__all__ = ["KINDS", "kind_of", "owner_of"]

KINDS: Final = (PYTORCHJOB, TRAINJOB)


def kind_of(job: Mapping[str, Any]) -> JobKind:
    """The kind of a job body (a body without ``kind``/``apiVersion`` is a PyTorchJob)."""
    return next((k for k in KINDS if k.matches(job)), PYTORCHJOB)


def owner_of(pod: Mapping[str, Any]) -> tuple[JobKind, str] | None:
    """The job a pod belongs to: a PyTorchJob (owner reference, else its label), else the
    TrainJob of its JobSet (``jobset.sigs.k8s.io/jobset-name``); None: neither."""
    name = owner_job_name(pod)
    if name is not None:
        return PYTORCHJOB, name
    name = TRAINJOB.job_name_of_pod(pod)
    return (TRAINJOB, name) if name is not None else None
