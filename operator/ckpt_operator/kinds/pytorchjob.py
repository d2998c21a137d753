"""The PyTorchJob kind (Kubeflow training-operator v1, ``kubeflow.org/v1``).

Its pods carry ``training.kubeflow.org/job-name``; its pod templates are
``spec.pytorchReplicaSpecs.<type>.template`` (:mod:`ckpt_operator.model.jobs`). A restart is a new
job ``J-r<k>`` (:mod:`ckpt_operator.planners.restart`).
"""

from __future__ import annotations

from typing import Final

from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.model import constants as c
from ckpt_operator.model.jobs import (
    inject_label_patch,
    label_templates_in_place,
    unlabelled_replicas,
)

__all__ = ["PYTORCHJOB"]

PYTORCHJOB: Final = JobKind(
    kind=c.PYTORCHJOB_KIND,
    group=c.PYTORCHJOB_GROUP,
    version=c.PYTORCHJOB_VERSION,
    plural=c.PYTORCHJOB_PLURAL,
    pod_job_label=c.LABEL_TO_JOB_NAME,
    unlabelled=unlabelled_replicas,
    label_patch=inject_label_patch,
    label_in_place=label_templates_in_place,
)
