"""The container runtime for kwok pods: every training pod that becomes Running is run.

kwok marks pods Running but runs nothing. :class:`PodRunner` watches one namespace for
pods created by the training-operator (label ``training.kubeflow.org/job-name``; another
``job_label``, e.g. JobSet's ``jobset.sigs.k8s.io/jobset-name`` for TrainJobs) and,
like a kubelet would, starts the ``pytorch`` container of each new Running pod as a
local process (:class:`ckpt_e2e.localpod.LocalPod`: the env, volumes and config the
webhook injected, read back from the API server; the exit reported as the pod status).

``sidecars=True``: each native sidecar of the pod (an init container with ``restartPolicy:
Always``, e.g. the webhook's ``ckpt-agent``) is started first, each as its own LocalPod
of the same pod (``PodRun.sidecars``; they share the pod's volumes), then the main
container; a sidecar ends when the pod does (the ``ckpt_e2e.localpod`` contract).

A ``decide(pod)`` callback can make a pod ``crash`` (started, then SIGKILLed after
``crash_after`` seconds: an OOM kill or a node dying right after the start) or be
``ignore``\\ d (left Running with no process, e.g. to end it by hand).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from .cluster import LocalCluster
from .localpod import LocalPod
from .podspec import native_sidecars
from .procs import wait_until

JOB_NAME_LABEL = "training.kubeflow.org/job-name"

Decision = Literal["run", "crash", "ignore"]


@dataclass
class PodRun:
    """One pod the runner saw Running (and what it did with it)."""

    name: str
    uid: str
    job: str
    decision: Decision
    pod: dict[str, Any]
    local: LocalPod | None = None
    sidecars: list[LocalPod] = field(default_factory=list)
    """The pod's native sidecars run here (``PodRunner(sidecars=True)``), in start order."""
    started_at: float = field(default_factory=time.time)
    """Wall-clock time the process was started (or the pod was seen, for ``ignore``)."""

    @property
    def running(self) -> bool:
        return self.local is not None and self.local.running

    @property
    def exit_code(self) -> int | None:
        return None if self.local is None else self.local.exit_code

    def wait(self, timeout: float) -> int:
        assert self.local is not None, f"pod {self.name} was not run ({self.decision})"
        return self.local.wait(timeout)


class PodRunner:
    """Runs the training pods of ``namespace`` as local processes (see the module docstring).

    ``localpod_kwargs`` go to every :class:`LocalPod` (``extra_env``, ``exe_map``, ...).
    ``job_label``: the pod label that names the pod's job (the runner runs only pods that
    carry it); e.g. ``jobset.sigs.k8s.io/jobset-name`` for TrainJob pods (``ckpt_e2e.trainjob``).
    """

    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        *,
        decide: Callable[[dict[str, Any]], Decision] | None = None,
        crash_after: float = 0.3,
        poll_interval: float = 0.3,
        job_label: str = JOB_NAME_LABEL,
        sidecars: bool = False,
        **localpod_kwargs: Any,
    ) -> None:
        self.cluster = cluster
        self.sidecars = sidecars
        self.job_label = job_label
        self.namespace = namespace
        self.decide = decide or (lambda pod: "run")
        self.crash_after = crash_after
        self.poll_interval = poll_interval
        self.localpod_kwargs = localpod_kwargs
        self._runs: list[PodRun] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Self:
        self._thread = threading.Thread(
            target=self._loop, name=f"pod-runner-{self.namespace}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 20.0) -> None:
        """Stop watching; SIGKILL every process still running and wait for its report."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for run in self.runs:
            if run.local is not None and run.local.running:
                run.local.signal(signal.SIGKILL)
                with contextlib.suppress(Exception):
                    run.local.wait(timeout)
            if run.local is not None:
                with contextlib.suppress(Exception):
                    run.local.stop(timeout=1)
            for sc in run.sidecars:
                with contextlib.suppress(Exception):
                    sc.stop(timeout=timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ observation
    @property
    def runs(self) -> list[PodRun]:
        with self._lock:
            return list(self._runs)

    def check(self) -> None:
        """Re-raise an error the runner thread hit (a pod it could not start)."""
        with self._lock:
            if self._errors:
                raise self._errors[0]

    def runs_of(self, job: str) -> list[PodRun]:
        return [r for r in self.runs if r.job == job]

    def wait_run(self, job: str, timeout: float = 120.0, index: int = 0) -> PodRun:
        """The ``index``-th pod run of PyTorchJob ``job`` (waits until it was started)."""

        def found() -> PodRun | None:
            runs = self.runs_of(job)
            return runs[index] if len(runs) > index else None

        run = wait_until(
            found,
            timeout,
            f"a Running pod of job {self.namespace}/{job} ({self.job_label}) started locally",
            interval=0.2,
            on_poll=self._poll_checks,
        )
        assert isinstance(run, PodRun)
        return run

    def _poll_checks(self) -> None:
        self.check()
        self.cluster.check_alive()

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods?labelSelector=" + self.job_label.replace(
            "/", "%2F"
        )
        while not self._stop.is_set():
            try:
                pods = self.cluster.request("GET", path, timeout=10).get("items") or []
            except Exception:
                pods = []
            for pod in pods:
                if self._stop.is_set():
                    break
                self._consider(pod)
            self._stop.wait(self.poll_interval)

    def _consider(self, pod: Mapping[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if (
            uid in self._seen
            or meta.get("deletionTimestamp")
            or (pod.get("status") or {}).get("phase") != "Running"
        ):
            return
        self._seen.add(uid)
        job = str((meta.get("labels") or {}).get(self.job_label, ""))
        decision = self.decide(dict(pod))
        run = PodRun(str(meta.get("name")), uid, job, decision, dict(pod))
        try:
            if decision != "ignore" and self.sidecars:
                for name in native_sidecars(pod):
                    sc = LocalPod(
                        self.cluster,
                        self.namespace,
                        run.name,
                        **{**self.localpod_kwargs, "container": name},
                    )
                    run.sidecars.append(sc.start())
            if decision != "ignore":
                run.local = LocalPod(
                    self.cluster, self.namespace, run.name, **self.localpod_kwargs
                ).start()
                run.started_at = time.time()
                if decision == "crash":
                    time.sleep(self.crash_after)
                    run.local.kill()
        except Exception as e:
            with self._lock:
                self._errors.append(e)
        with self._lock:
            self._runs.append(run)
