"""What differs between the job kinds the operator serves (:class:`JobKind`).

The restart protocol, the injection and the disruption watch are the same for every
kind; a kind says where its API lives, which label names the job on its pods, and how
its pod templates get ``ckpt.dev/inject`` (so that every pod of an opted-in job reaches
the fail-closed pod webhook). The kinds themselves: :mod:`ckpt_operator.kinds.pytorchjob`
(training-operator v1), :mod:`ckpt_operator.kinds.trainjob` (Kubeflow Trainer v2 on JobSet);
the registry: :mod:`ckpt_operator.kinds.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_operator.model.bodies import meta_of

__all__ = ["JobKind"]


@dataclass(frozen=True)
class JobKind:
    """One kind of training job (a custom resource whose pods the operator injects)."""

    kind: str
    group: str
    version: str
    plural: str
    pod_job_label: str
    """Label its controller puts on every pod of a job: the job's name."""
    unlabelled: Callable[[Mapping[str, Any]], list[str]]
    """The job's pod templates without ``ckpt.dev/inject: "true"`` (sorted names)."""
    label_patch: Callable[[Mapping[str, Any]], dict[str, Any] | None]
    """A merge patch labelling those templates (None: all labelled, or not patchable)."""
    label_in_place: Callable[[dict[str, Any]], bool]
    """Label the templates of a job body being created (True: changed)."""
    default_container: str | None = None
    """The training container when the policy's ``spec.agent.containerName`` is not in
    the pod (None: the policy's name only)."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def matches(self, obj: Mapping[str, Any]) -> bool:
        """``obj`` is a job of this kind (its ``kind`` and API group)."""
        api = str(obj.get("apiVersion") or "")
        return obj.get("kind") == self.kind and api.startswith(f"{self.group}/")

    def job_name_of_pod(self, pod: Mapping[str, Any]) -> str | None:
        """The job's name from the pod's :attr:`pod_job_label` (None: not such a pod)."""
        value = meta_of(pod).labels.get(self.pod_job_label)
        return value if isinstance(value, str) and value else None
