"""One namespace set up the way a user would: storage, a CheckpointPolicy, training jobs.

:class:`Scenario` bundles what the end-to-end scenarios and the demo do over and over:
a PersistentVolumeClaim for checkpoints (bound to a hostPath PV on a local folder), used
either as a shared volume (:meth:`Scenario.local_storage`: mounted at *the same path* so
the policy's ``storage.local.path`` means the same folder to every process, the operator
included, as with an NFS volume mounted on every node and in the operator) or as a
pod-only volume (:meth:`Scenario.pvc_storage`: mounted at a container path that exists
only in the pods' mount translation, so the operator, which runs as a host process with
only what the chart's Deployment gives it, cannot read it, as with a PVC in a real
cluster), a policy applied with ``kubectl`` and reconciled by
the operator, PyTorchJobs whose pods a :class:`~ckpt_e2e.kubelet.PodRunner` runs, and
the waits that follow the operator's restart protocol.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api import free_port
from .cluster import LocalCluster
from .kubelet import Decision, PodRun, PodRunner
from .stack import OperatorProcess
from .training import (
    StorageView,
    Training,
    annotations_of,
    condition,
    get_job,
    last_logged_step,
    local_storage,
    operator_status,
    policy_manifest,
    pytorchjob_manifest,
)

RUN_ID = "ckpt.dev/run-id"
#: Root of the container paths :meth:`Scenario.pvc_storage` mounts the claim at.
POD_ONLY_ROOT = "/ckpt-e2e-pod-only"
RESTARTED_AS = "ckpt.dev/restarted-as"


@dataclass
class Scenario:
    """Helpers for one namespace (see the module docstring)."""

    cluster: LocalCluster
    namespace: str
    operator: OperatorProcess
    claim: str = "checkpoints"
    store: Path = field(init=False)
    results: Path = field(init=False)
    runners: list[PodRunner] = field(default_factory=list)
    views: list[StorageView] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store = self.cluster.create_pvc(self.namespace, self.claim)
        self.results = self.cluster.workdir / "results" / self.namespace
        self.results.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ setup
    def local_storage(self) -> dict[str, Any]:
        """The PVC mounted at its own folder's path: a shared (NFS-like) volume that the
        operator reads too."""
        return local_storage(self.store, self.claim)

    @property
    def pod_only_path(self) -> str:
        """A container path that exists only in the pods' mount translation (never on
        this machine): the operator, a host process, cannot open it."""
        return f"{POD_ONLY_ROOT}/{self.namespace}"

    def pvc_storage(self) -> dict[str, Any]:
        """The PVC mounted in the pods only, as in a real cluster: the operator cannot read
        it and learns about checkpoints from the pods' termination messages."""
        return local_storage(self.pod_only_path, self.claim)

    def view(self, url: str | None = None, **kw: Any) -> StorageView:
        v = StorageView(url or f"file://{self.store}", **kw)
        self.views.append(v)
        return v

    def apply_policy(
        self, name: str = "e2e", storage: Mapping[str, Any] | None = None, **kw: Any
    ) -> dict[str, Any]:
        """``kubectl apply`` a policy and wait until the operator says it is Ready."""
        kw.setdefault("metrics_port", free_port())
        manifest = policy_manifest(name, storage or self.local_storage(), **kw)
        self.cluster.apply(manifest, namespace=self.namespace)
        return self.wait_policy_ready(name)

    def wait_policy_ready(self, name: str, timeout: float = 60.0) -> dict[str, Any]:
        path = f"/apis/ckpt.dev/v1alpha1/namespaces/{self.namespace}/checkpointpolicies/{name}"

        last: dict[str, Any] = {}

        def ready() -> dict[str, Any] | None:
            pol = self.cluster.request("GET", path)
            last["status"] = pol.get("status")
            gen = pol["metadata"].get("generation")
            for c in (pol.get("status") or {}).get("conditions") or []:
                if (
                    c.get("type") == "Ready"
                    and c.get("status") == "True"
                    and c.get("observedGeneration") == gen
                ):
                    return pol
            return None

        try:
            pol = self.cluster.wait_for(
                ready, timeout=timeout, what=f"CheckpointPolicy {name} Ready"
            )
        except TimeoutError as e:
            raise TimeoutError(f"{e}; last status: {last.get('status')}") from None
        assert isinstance(pol, dict)
        return pol

    def runner(
        self, decide: Callable[[dict[str, Any]], Decision] | None = None, **kw: Any
    ) -> PodRunner:
        r = PodRunner(self.cluster, self.namespace, decide=decide, **kw).start()
        self.runners.append(r)
        return r

    def submit(
        self,
        name: str,
        training: Training,
        *,
        policy: str | None = "e2e",
        **kw: Any,
    ) -> dict[str, Any]:
        """``kubectl apply`` a PyTorchJob running the example script."""
        manifest = pytorchjob_manifest(name, training, self.results, policy=policy, **kw)
        self.cluster.apply(manifest, namespace=self.namespace)
        job = get_job(self.cluster, self.namespace, name)
        assert job is not None
        return job

    # ------------------------------------------------------------------ observation
    def job(self, name: str) -> dict[str, Any] | None:
        return get_job(self.cluster, self.namespace, name)

    def run_id(self, job_name: str, timeout: float = 30.0) -> str:
        """The run id the operator recorded on the job."""
        rid = self.cluster.wait_for(
            lambda: annotations_of(self.job(job_name)).get(RUN_ID),
            timeout=timeout,
            what=f"run id on PyTorchJob {job_name}",
        )
        return str(rid)

    def wait_restart(self, job_name: str, timeout: float = 90.0) -> dict[str, Any]:
        """Wait until the operator restarted ``job_name``; returns the new job.

        Done means the new job exists *and* the operator finished the restart: the failed
        job's status left ``Restarting`` (the intent it writes before creating the job), so
        its ``Restarted`` status and the restart's Events are written too."""

        def restarted() -> dict[str, Any] | None:
            failed = self.job(job_name)
            new = annotations_of(failed).get(RESTARTED_AS)
            if not new or operator_status(failed).get("state") == "Restarting":
                return None
            return self.job(new)

        job = self.cluster.wait_for(
            restarted, timeout=timeout, what=f"the operator restarting PyTorchJob {job_name}"
        )
        assert isinstance(job, dict)
        return job

    def wait_operator_state(
        self, job_name: str, state: str, timeout: float = 60.0
    ) -> dict[str, Any]:
        """Wait until the operator's ``ckpt.dev/status`` of the job has ``state``; returns it."""

        def reached() -> dict[str, Any] | None:
            status = operator_status(self.job(job_name))
            return status if status.get("state") == state else None

        status = self.cluster.wait_for(
            reached, timeout=timeout, what=f"{state} on PyTorchJob {job_name}"
        )
        assert isinstance(status, dict)
        return status

    def wait_finished(self, job_name: str, timeout: float = 180.0) -> dict[str, Any]:
        """Wait until the job Succeeded or Failed; returns it."""

        def finished() -> dict[str, Any] | None:
            job = self.job(job_name)
            return job if condition(job, "Succeeded") or condition(job, "Failed") else None

        job = self.cluster.wait_for(
            finished, timeout=timeout, what=f"PyTorchJob {job_name} finished"
        )
        assert isinstance(job, dict)
        return job

    def wait_step(self, run: PodRun, step: int, timeout: float = 120.0) -> None:
        """Wait until the pod's training process logged ``step``."""

        def reached() -> bool:
            if not run.running:
                raise AssertionError(
                    f"pod {run.name} exited ({run.exit_code}) before step {step}:\n"
                    + (run.local.log_text()[-3000:] if run.local else "")
                )
            return last_logged_step(self.results, run.pod) >= step

        self.cluster.wait_for(reached, timeout=timeout, what=f"pod {run.name} at step {step}")

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        for r in self.runners:
            with contextlib.suppress(Exception):
                r.stop()
        for v in self.views:
            with contextlib.suppress(Exception):
                v.close()
