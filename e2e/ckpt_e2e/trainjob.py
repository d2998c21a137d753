"""TrainJobs (Kubeflow Trainer v2) in a :class:`~ckpt_e2e.scenario.Scenario`'s namespace.

What a user writes: a ``TrainJob`` of the torch ``ClusterTrainingRuntime`` that
``ckpt_e2e.trainer_v2`` installs, running the same example trainer as the PyTorchJob
scenarios (``ckpt_e2e.training``), opted in with the ``ckpt.dev/policy`` /
``ckpt.dev/auto-resume`` annotations. The code and results ``hostPath`` volumes come in
through the TrainJob's ``runtimePatches`` (the runtime is shared by every namespace).

The chain the real controllers build: TrainJob ``T`` → JobSet ``T`` → Job ``T-node-0`` →
pod ``T-node-0-0-<x>``. A JobSet restart attempt recreates every Job (same names) and so
every pod; the pods carry ``jobset.sigs.k8s.io/jobset-name=T`` and
``jobset.sigs.k8s.io/restart-attempt=<n>`` (:data:`RESTART_ATTEMPT_LABEL`).
:class:`TrainJobs` runs those pods through a :class:`~ckpt_e2e.kubelet.PodRunner` keyed by
the JobSet name, so ``runner.wait_run(T, index=n)`` is the pod of restart attempt ``n``
(one node).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cluster import LocalCluster
from .errors import ApiError
from .kubelet import Decision, PodRun, PodRunner
from .scenario import RUN_ID, Scenario
from .trainer_v2 import NODE, RUNTIME_NAME
from .training import (
    TRAIN_COMMAND,
    Training,
    annotations_of,
    condition,
    operator_status,
    opt_in_annotations,
    trainer_env,
    trainer_mounts,
    trainer_volumes,
)

TRAINER_API = "/apis/trainer.kubeflow.org/v1alpha1"
JOBSET_API = "/apis/jobset.x-k8s.io/v1alpha2"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
#: ``runtimePatches[].manager`` of the harness's patch (volumes for this checkout)
PATCH_MANAGER = "e2e.ckpt.dev/harness"
#: the operator's ``runtimePatches`` entry (labels the trainer pods ``ckpt.dev/inject``)
OPERATOR_PATCH_MANAGER = "ckpt.dev/operator"


def trainjob_manifest(
    name: str,
    training: Training,
    results_dir: Path,
    *,
    policy: str | None = None,
    auto_resume: bool = True,
    annotations: Mapping[str, str] | None = None,
    runtime: str = RUNTIME_NAME,
    node_selector: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A one-node TrainJob of ``runtime`` running the example script (opted in when ``policy``)."""
    ann = opt_in_annotations(policy, auto_resume, annotations)
    results_dir.mkdir(parents=True, exist_ok=True)
    pod_patch: dict[str, Any] = {
        "volumes": trainer_volumes(results_dir),
        "containers": [{"name": NODE, "volumeMounts": trainer_mounts()}],
    }
    if node_selector:
        pod_patch["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "annotations": ann},
        "spec": {
            "runtimeRef": {"name": runtime},
            "trainer": {
                "numNodes": 1,
                "command": list(TRAIN_COMMAND),
                "args": training.container_args(),
                "env": trainer_env(),
                "resourcesPerNode": {"requests": {"cpu": "1", "memory": "1Gi"}},
            },
            "runtimePatches": [
                {
                    "manager": PATCH_MANAGER,
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "name": NODE,
                                        "template": {"spec": {"template": {"spec": pod_patch}}},
                                    }
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def _get(cluster: LocalCluster, path: str) -> dict[str, Any] | None:
    try:
        return cluster.request("GET", path)
    except ApiError as e:
        if e.status == 404:
            return None
        raise


def restart_attempt(obj: Mapping[str, Any]) -> int:
    """JobSet's restart attempt a Job or pod belongs to (its label)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return int(labels.get(RESTART_ATTEMPT_LABEL, "0"))


@dataclass
class TrainJobs:
    """TrainJob helpers for one :class:`Scenario` (its namespace, storage and results)."""

    scenario: Scenario

    @property
    def cluster(self) -> LocalCluster:
        return self.scenario.cluster

    @property
    def namespace(self) -> str:
        return self.scenario.namespace

    def runner(
        self, decide: Callable[[dict[str, Any]], Decision] | None = None, **kw: Any
    ) -> PodRunner:
        """Runs the namespace's TrainJob pods (container ``node``), keyed by JobSet name."""
        kw.setdefault("container", NODE)
        return self.scenario.runner(decide, job_label=JOBSET_NAME_LABEL, **kw)

    def submit(self, name: str, training: Training, **kw: Any) -> dict[str, Any]:
        """``kubectl apply`` a TrainJob (see :func:`trainjob_manifest`); returns it."""
        kw.setdefault("policy", "e2e")
        manifest = trainjob_manifest(name, training, self.scenario.results, **kw)
        if kw["policy"] is not None:
            self.wait_operator_admits(manifest)
        self.cluster.apply(manifest, namespace=self.namespace)
        job = self.trainjob(name)
        assert job is not None
        return job

    def wait_operator_admits(self, manifest: Mapping[str, Any], timeout: float = 60.0) -> None:
        """Wait until a server-side dry run of ``manifest`` comes back with the operator's
        runtime patch: the operator serves its TrainJob webhook only once it has discovered
        the TrainJob CRD, which (in a full session) is installed after the operator started."""

        def admitted() -> bool:
            out = self.cluster.kubectl(
                "create",
                "--dry-run=server",
                "-o",
                "json",
                "-n",
                self.namespace,
                "-f",
                "-",
                input=json.dumps(manifest),
            )
            patches = (json.loads(out.stdout).get("spec") or {}).get("runtimePatches") or []
            return any(p.get("manager") == OPERATOR_PATCH_MANAGER for p in patches)

        self.cluster.wait_for(
            admitted, timeout=timeout, what="the operator's TrainJob webhook", interval=1.0
        )

    # ------------------------------------------------------------------ observation
    def trainjob(self, name: str) -> dict[str, Any] | None:
        return _get(self.cluster, f"{TRAINER_API}/namespaces/{self.namespace}/trainjobs/{name}")

    def jobset(self, name: str) -> dict[str, Any] | None:
        return _get(self.cluster, f"{JOBSET_API}/namespaces/{self.namespace}/jobsets/{name}")

    def jobset_restarts(self, name: str) -> int:
        """``status.restarts`` of JobSet ``name`` (0 before the first restart)."""
        return int(((self.jobset(name) or {}).get("status") or {}).get("restarts") or 0)

    def wait_restarts(self, name: str, restarts: int, timeout: float = 90.0) -> dict[str, Any]:
        """Wait until JobSet ``name`` made ``restarts`` restart attempts; returns it."""
        js = self.cluster.wait_for(
            lambda: (
                (js := self.jobset(name))
                and int((js.get("status") or {}).get("restarts") or 0) >= restarts
                and js
            ),
            timeout=timeout,
            what=f"JobSet {self.namespace}/{name} restart attempt {restarts}",
        )
        assert isinstance(js, dict)
        return js

    def wait_attempt(
        self, runner: PodRunner, name: str, attempt: int, timeout: float = 120.0
    ) -> PodRun:
        """The pod run of restart attempt ``attempt`` of TrainJob ``name`` (one node)."""
        run = runner.wait_run(name, timeout=timeout, index=attempt)
        assert restart_attempt(run.pod) == attempt, (run.name, run.pod["metadata"]["labels"])
        return run

    def wait_condition(self, name: str, ctype: str, timeout: float = 120.0) -> dict[str, Any]:
        """Wait until the TrainJob has condition ``ctype`` (e.g. Complete, Failed) True."""
        job = self.cluster.wait_for(
            lambda: (job := self.trainjob(name)) and condition(job, ctype) and job,
            timeout=timeout,
            what=f"TrainJob {self.namespace}/{name} {ctype}",
        )
        assert isinstance(job, dict)
        return job

    def annotations(self, name: str) -> dict[str, str]:
        return annotations_of(self.trainjob(name))

    def run_id(self, name: str, timeout: float = 30.0) -> str:
        """The run id the operator recorded on the TrainJob."""
        rid = self.cluster.wait_for(
            lambda: self.annotations(name).get(RUN_ID),
            timeout=timeout,
            what=f"run id on TrainJob {name}",
        )
        return str(rid)

    def wait_operator_state(self, name: str, state: str, timeout: float = 90.0) -> dict[str, Any]:
        """Wait until the operator's ``ckpt.dev/status`` of the TrainJob has ``state``."""

        def reached() -> dict[str, Any] | None:
            status = operator_status(self.trainjob(name))
            return status if status.get("state") == state else None

        status = self.cluster.wait_for(reached, timeout=timeout, what=f"{state} on TrainJob {name}")
        assert isinstance(status, dict)
        return status
