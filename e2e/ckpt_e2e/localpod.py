"""Run a pod's container as a local process: the harness plays the kubelet for kwok pods.

kwok pods run no containers. :class:`LocalPod` takes a Pod as the API server stored it
(after every mutating webhook) and runs one of its containers on this machine, then
reports the exit through the API like a kubelet would.

Contract
========
**Pod and container.** The Pod is read back from the API server. The container is
``container=`` or, by default, the one named ``pytorch`` (what the training-operator
watches), else the first one. ``container=`` may also name a *native sidecar* (an init
container with ``restartPolicy: Always``, e.g. the webhook's ``ckpt-agent``); init
containers that run to completion are refused, and nothing is run that no LocalPod was
started for: one LocalPod runs one container, so run the sidecar with its own
``LocalPod(container="ckpt-agent")`` (:class:`~ckpt_e2e.kubelet.PodRunner` does, with
``sidecars=True``: each native sidecar first, then the main container, as the kubelet
starts them). By default the runner waits until kwok has marked the pod Running
(``wait_running``).

**One pod, several LocalPods.** LocalPods of the same pod (its uid) share the pod's local
folder ``<cluster workdir>/pods/<ns>/<name>`` and so every volume: an ``emptyDir`` is
``<pod dir>/volumes/<volume>``, a ``medium: Memory`` one
``/dev/shm/ckpt-e2e-<pod uid>/<volume>``, the same folder for the trainer, its sidecar and
a restarted trainer (a container restarted in place, the kubelet's ``OnFailure``: a new
LocalPod of the same pod and container). Like an emptyDir, it outlives any one container:
the memory folders are removed when the *last* LocalPod of the pod that was started is
stopped (:meth:`LocalPod.stop`), so start the restarted container's LocalPod before
stopping the old one unless another container of the pod (the sidecar) still runs.
Logs and termination-message files are per container (``<container>.log``; a restart
appends to the same log).

**Volumes → local folders.** Each volume the container mounts gets a local path:

* ``configMap``, ``secret``, ``downwardAPI``, ``projected`` (configMap / secret /
  downwardAPI / serviceAccountToken sources): files materialized under
  ``<pod dir>/volumes/<volume>/`` with the kubelet's layout (``items`` → paths, all keys
  otherwise, ``defaultMode``/``mode``; downward-API ``labels``/``annotations`` as sorted
  ``key="value"`` lines). They are refreshed while the process runs (downward API every
  poll, configMaps/secrets every few polls) and each file is replaced atomically
  (write + rename), so an agent that watches e.g. a ``ckpt.dev/save-now`` annotation file
  sees updates as it would in a real pod.
* ``emptyDir``: an empty folder (``medium: Memory`` under ``/dev/shm`` when it exists).
* ``hostPath``: that host path itself (this machine is the node).
* ``persistentVolumeClaim``: the ``hostPath`` of the PV bound to the claim (what
  :meth:`LocalCluster.create_pvc` makes: ``<cluster workdir>/pvc/<namespace>/<claim>/``),
  else that same folder (:func:`pvc_path`); shared by every pod that mounts the claim.
* anything else: an empty folder.

``subPath`` is honoured. ``path_overrides={mountPath: local_path}`` replaces any of it.

**Path translation.** Every mount path ``M`` maps to its local path ``L``. Occurrences of
``M`` that start a path — preceded by start-of-string or a character outside
``[A-Za-z0-9_.-]`` and followed by end-of-string or such a character — are replaced by
``L`` (longest ``M`` first, one pass) in: every environment value, every element of
``command``/``args``, ``workingDir``, and (``rewrite_files=True``, the default) the text of
the materialized configMap/downward-API files (not secrets). So ``/ckpt``,
``file:///ckpt/run-1`` and ``--out=/ckpt/x`` all translate, ``/ckpt-other`` does not. The
map is also exported as ``CKPT_E2E_PATH_MAP`` (JSON ``{mountPath: localPath}``) for code
that builds paths at run time; :meth:`LocalPod.local_path` does the same for tests.

**Environment.** The harness's own environment (``PATH``, ``PYTHONPATH``, virtualenv;
proxies and ``KUBECONFIG`` removed), then ``HOSTNAME=<pod name>`` and
``KUBERNETES_SERVICE_HOST/PORT`` (the local API server), then the container's ``envFrom``
(configMapRef / secretRef, ``prefix``, ``optional``), then ``env`` in order: ``value`` with
``$(VAR)`` expansion (``$$`` escapes) and ``valueFrom`` — ``fieldRef`` (metadata.name,
namespace, uid, labels/annotations and ``['key']`` forms, spec.nodeName,
spec.serviceAccountName, status.podIP/hostIP/podIPs), ``secretKeyRef``,
``configMapKeyRef``, ``resourceFieldRef`` (limits/requests of cpu, memory,
ephemeral-storage with ``divisor``; unset limits fall back to this machine's size). A pod
on a node with a loopback pod CIDR (``create_node(pod_cidr="127.…")``) is reachable at its
pod IP here: ``CKPT_METRICS_ADDR=<pod IP>`` and ``CKPT_REPLICA_LISTEN_HOST=<pod IP>``
(before the container's ``env``) make the agent and its sidecar listen there (metrics,
replica peers), as they would on their own network namespace's address in a cluster.
Such a pod also gets the cluster's DNS (``ckpt_e2e.names``): in the values of
``MASTER_ADDR`` and ``CKPT_REPLICA_PEERS`` (the training-operator's Service
``<job>-master-0``, the webhook's peers ``<pod>.<ns>.svc:<port>``) and in the text of
materialized configMap files (the operator's replica peer map), a name of a pod or a
Service (its selected Running pod) of the namespace that has a loopback pod IP is
replaced by that IP, the environment's once at the start (waiting up to 30 s for a named
pod to get its IP), the files' at every refresh (a pod recreated with a new IP is found).
Then ``extra_env``, and ``CKPT_E2E_CONTAINER``, ``CKPT_E2E_POD_NAME``,
``CKPT_E2E_POD_NAMESPACE``, ``CKPT_E2E_PATH_MAP``.

**Process.** argv is ``command + args`` after ``$(VAR)`` expansion and path translation (a
container without ``command`` is an error: there is no image entrypoint). ``argv[0]`` of
``python``/``python3`` becomes this interpreter (``sys.executable``); ``exe_map`` adds or
overrides such mappings. It runs in its own process group, in the translated
``workingDir`` or ``<pod dir>/cwd``, stdout+stderr to ``<pod dir>/<container>.log``.

**The container.** Every process the container starts carries ``CKPT_E2E_CONTAINER=
<pod uid>/<container>`` in its environment, so the harness finds all of them, also
those that left the process group (e.g. a helper started with ``start_new_session``).
As with a real container (one PID namespace / cgroup), when the main process exits,
whatever it left behind is SIGKILLed before the exit is reported; :meth:`LocalPod.kill`
and :meth:`LocalPod.signal_container` act on all of them (SIGSTOP/SIGCONT freeze and
thaw the container like the cgroup freezer).

**Deletion.** While a process of the pod runs here the pod carries the annotation
``e2e.ckpt.dev/local-process=<pid>``; kwok's delete stage skips such pods. When the pod
gets a ``deletionTimestamp`` (``kubectl delete``, eviction/drain, garbage collection) or
disappears, the main process gets SIGTERM (like a container runtime, which signals the
container's init process only) and, after ``terminationGracePeriodSeconds``, every
process of the container SIGKILL. Then the exit is reported and the annotation
removed (set to another running container's pid while one runs), and kwok completes
the deletion. Every LocalPod of the pod acts on the deletion by itself, so a sidecar
gets its SIGTERM at the same time as the main container (the kubelet would wait for the
main containers first; the agent's sidecar drains what is pending either way).

**Exit report.** Through the ``pods/status`` subresource, like a kubelet: the container's
``state.terminated`` (``exitCode``, ``reason`` Completed/Error, ``startedAt``,
``finishedAt``, and ``message``: the first 4096 bytes of the container's
``terminationMessagePath`` file — a fresh local ``<pod dir>/<container>.termination-log``
that the path translation maps that path to — or, with ``FallbackToLogsOnError`` and an
empty file after a failure, the log's tail); a process killed by signal N reports
``128+N`` (SIGKILL → 137). Other
containers are reported terminated with exit 0. ``restartPolicy: Never`` (the
training-operator's choice for PyTorchJob pods): phase Succeeded for exit 0, else
Failed. ``OnFailure`` with exit 0 → Succeeded; ``OnFailure`` with a failure, or
``Always``: the pod stays Running with ``restartCount+1`` and ``lastState.terminated``,
as after a kubelet restart (run it again if the scenario needs it).
:meth:`LocalPod.lose_node` kills the container, removes the pod's ``medium: Memory``
folders (the node's memory) and reports nothing: the node died with it.

**Native sidecars.** A sidecar's exit never changes the pod's phase and touches only its
entry in ``initContainerStatuses`` (the other entries kept as kwok wrote them): while the
pod runs, ``restartCount+1`` with ``lastState.terminated`` and ``state.running`` (the
kubelet restarts a sidecar whatever the pod's ``restartPolicy``; run it again if the
scenario needs it); once the pod is Succeeded/Failed, ``state.terminated``. When the pod
reaches Succeeded/Failed (its main container's exit, reported by its LocalPod) the
sidecar's LocalPod ends it like a deletion does (SIGTERM to its main process, SIGKILL to
all of it after the grace; ``terminated_with_pod``), as the kubelet ends sidecars after
the main containers. ``argv[0]`` ``ckpt`` (the agent image's entry point) is the ``ckpt``
console script beside this interpreter.

Threads: a daemon thread per LocalPod polls the pod (every ``poll_interval`` s) and
reports the exit; :meth:`LocalPod.wait` re-raises any error it hit.

Where each part lives: the pure spec translation (env, argv, volume files, paths) in
``ckpt_e2e.podspec``, the local folders of the volumes in ``ckpt_e2e.volumes``, the exit
report in ``ckpt_e2e.podstatus``, the processes in ``ckpt_e2e.procs``, the bookkeeping of a
pod's several LocalPods (the volumes' lifetime, the local-process annotation, when a native
sidecar ends) in ``ckpt_e2e.podgroup``; this module runs and watches them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from . import podgroup
from .cluster import LocalCluster
from .errors import LocalPodError
from .names import PodNames
from .podspec import (
    PathTranslator,
    build_argv,
    is_native_sidecar,
    process_env,
    select_container,
    working_dir,
)
from .podstatus import is_not_found, mark_local_process, now, pod_path, report_container_exit
from .procs import ManagedProcess, clean_env, container_pids, wait_until
from .volumes import PodVolumes, claim_folder

__all__ = ["LocalPod", "pvc_path", "run_pod_locally"]

#: The Kubernetes default ``terminationMessagePath``; the kubelet keeps 4096 bytes of it.
TERMINATION_LOG = "/dev/termination-log"
MESSAGE_BYTES = 4096

#: ``argv[0]`` of the agent image's entry point (the webhook's sidecar runs ``ckpt sidecar``)
#: → the console script of this interpreter's environment, when it has one.
_CKPT_EXE = Path(sys.executable).parent / "ckpt"


def pvc_path(cluster: LocalCluster, namespace: str, claim: str) -> Path:
    """Local folder that stands in for PersistentVolumeClaim ``namespace/claim``."""
    return claim_folder(cluster.pvc_dir, namespace, claim)


class LocalPod:
    """One pod container run as a local process. See the module docstring for the contract.

    Args:
        cluster: the running LocalCluster.
        namespace, name: the Pod.
        container: container name (default ``pytorch`` if present, else the first).
        workdir: the pod's local folder (default ``<cluster workdir>/pods/<ns>/<name>``).
        path_overrides: ``{mountPath: local path}`` instead of the default volume folders.
        exe_map: ``{argv0: replacement}``, on top of ``python``/``python3`` → sys.executable.
        extra_env: added last to the process environment.
        rewrite_files: translate container paths inside materialized config files.
        wait_running: wait until the pod is Running (kwok) before starting.
        timeout: bound for waiting for the pod to be Running.
        poll_interval: seconds between pod polls while the process runs.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        name: str,
        *,
        container: str | None = None,
        workdir: Path | None = None,
        path_overrides: Mapping[str, Path | str] | None = None,
        exe_map: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        rewrite_files: bool = True,
        wait_running: bool = True,
        timeout: float = 60.0,
        poll_interval: float = 0.5,
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.name = name
        self.container_name = container
        self.workdir = workdir or cluster.pods_dir / namespace / name
        self.path_overrides = {k: Path(v) for k, v in (path_overrides or {}).items()}
        default_exe = {"python": sys.executable, "python3": sys.executable}
        if _CKPT_EXE.exists():
            default_exe["ckpt"] = str(_CKPT_EXE)
        self.exe_map = {**default_exe, **(exe_map or {})}
        self.extra_env = dict(extra_env or {})
        self.rewrite_files = rewrite_files
        self.wait_running = wait_running
        self.timeout = timeout
        self.poll_interval = poll_interval

        self.pod: dict[str, Any] = {}
        self.container: dict[str, Any] = {}
        self.volumes: PodVolumes | None = None
        self.env: dict[str, str] = {}
        self.argv: list[str] = []
        self.cwd: Path = self.workdir / "cwd"
        self.process: ManagedProcess | None = None
        self.exit_code: int | None = None
        self.reported_status: dict[str, Any] | None = None
        self.pod_deleted = False
        self.terminated_by_deletion = False
        #: :meth:`lose_node` was called: the exit is never reported
        self.node_lost = False
        #: a native sidecar stopped because the pod ended (SIGTERM, then SIGKILL)
        self.terminated_with_pod = False
        self._registered = False
        self._done = threading.Event()
        self._error: BaseException | None = None

    # -- public API ------------------------------------------------------------------
    @property
    def paths(self) -> dict[str, Path]:
        """``{mountPath: local path}`` of the container's mounts (after start)."""
        return {} if self.volumes is None else self.volumes.paths

    @property
    def translator(self) -> PathTranslator:
        return PathTranslator({}) if self.volumes is None else self.volumes.translator

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.container.get('name', 'container')}.log"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def local_path(self, container_path: str) -> Path:
        """Local path of a path inside the container (under one of its mounts)."""
        return self.translator.path(container_path)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and not self._done.is_set()

    @property
    def pod_uid(self) -> str:
        meta = self.pod.get("metadata") or {}
        return str(meta.get("uid") or f"{self.namespace}/{self.name}")

    @property
    def is_sidecar(self) -> bool:
        """The container is a native sidecar (an init container, ``restartPolicy: Always``)."""
        return is_native_sidecar(self.container)

    def start(self) -> Self:
        """Read the pod, prepare volumes/env/argv, start the process and the monitor."""
        path = pod_path(self.namespace, self.name)
        if self.wait_running:
            self.pod = wait_until(
                lambda: self._running_pod(path),
                self.timeout,
                f"pod {self.namespace}/{self.name} Running",
                interval=0.25,
                on_poll=self.cluster.check_alive,
            )  # type: ignore[assignment]
        else:
            self.pod = self.cluster.request("GET", path)
        self.container = select_container(self.pod, self.container_name)
        podgroup.join(self)
        self._registered = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._prepare()
        self.cwd.mkdir(parents=True, exist_ok=True)
        started_at = now()
        self.process = ManagedProcess(
            f"pod/{self.namespace}/{self.name}/{self.container['name']}",
            self.argv,
            self.log_path,
            env=self.env,
            cwd=self.cwd,
            grace=float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)),
        ).start()
        try:
            mark_local_process(self.cluster, self.namespace, self.name, self.process.pid)
        except Exception as e:
            if not is_not_found(e):
                self.process.stop(grace=1)
                raise
        threading.Thread(
            target=self._monitor, args=(started_at,), name=f"localpod-{self.name}", daemon=True
        ).start()
        return self

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit and its exit to be reported; returns the exit code."""
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"pod {self.namespace}/{self.name}: process still running after {timeout}s\n"
                f"--- log tail ---\n{self.log_text()[-3000:]}"
            )
        if self._error is not None:
            raise LocalPodError(
                f"local pod {self.namespace}/{self.name} failed: {self._error!r}"
            ) from self._error
        assert self.exit_code is not None
        return self.exit_code

    @property
    def marker(self) -> str:
        return f"{self.pod.get('metadata', {}).get('uid', self.name)}/{self.container['name']}"

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group (e.g. SIGKILL to simulate a crash)."""
        if self.process is not None:
            self.process.signal_group(sig)

    def signal_container(self, sig: int) -> None:
        """Send ``sig`` to every process of the container (group and escaped helpers)."""
        if self.process is None:
            return
        self.process.signal_group(sig)
        for pid in container_pids(self.marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole container (a crash / OOM kill of the container)."""
        self.signal_container(signal.SIGKILL)

    def lose_node(self, *, kill: bool = True) -> None:
        """The node dies with the pod: SIGKILL every process of the container and report
        nothing (no kubelet is left to report the exit or finish a deletion).

        The node's memory goes with it: the pod's ``medium: Memory`` emptyDirs are removed
        (their folders are per pod, ``/dev/shm/ckpt-e2e-<pod uid>/``, so what the lost node
        held in memory is gone for every container of the pod; a pod recreated elsewhere is
        a new uid with new, empty folders). Call it for each container of the pod run here
        (e.g. the trainer and its sidecar): each is killed by its own LocalPod.

        ``kill=False``: the node is cut off instead (a partition): its processes keep
        running — a *zombie* — and nothing here acts on the pod's deletion or reports
        its exit; its memory stays."""
        self.node_lost = True
        if kill:
            self.kill()
            if self.volumes is not None:
                self.volumes.cleanup()

    def _terminate(self) -> None:
        """SIGTERM to the main process only (what a container runtime does)."""
        if self.process is not None and self.process.running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.process.pid, signal.SIGTERM)

    def _sweep(self, timeout: float = 5.0) -> None:
        """SIGKILL whatever the container left behind and wait until it is gone."""
        deadline = time.monotonic() + timeout
        while True:
            pids = container_pids(self.marker)
            if not pids or time.monotonic() > deadline:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> None:
        """Terminate the container (SIGTERM, then SIGKILL) and wait for the report."""
        if self.process is not None and not self._done.is_set():
            self._terminate()
            if not self._done.wait(min(timeout, self.process.grace)):
                self.kill()
                self._done.wait(timeout)
        self._sweep()
        last = podgroup.leave(self) if self._registered else True
        self._registered = False
        if self.volumes is not None and last:  # the pod's other containers still use them
            self.volumes.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- preparation -----------------------------------------------------------------
    def _running_pod(self, path: str) -> dict[str, Any] | None:
        pod = self.cluster.request("GET", path)
        return pod if (pod.get("status") or {}).get("phase") == "Running" else None

    @property
    def termination_log(self) -> Path:
        """Local file standing in for the container's ``terminationMessagePath``."""
        return self.workdir / f"{self.container.get('name', 'container')}.termination-log"

    def _prepare(self) -> None:
        """Volumes (folders and files), then the environment, then argv and workingDir."""
        # the kubelet's per-container termination-message file: fresh for each start
        self.termination_log.write_bytes(b"")
        message_path = self.container.get("terminationMessagePath") or TERMINATION_LOG
        hosts = self._pod_names()
        self.volumes = volumes = PodVolumes(
            self.cluster,
            self.pod,
            self.container,
            self.workdir / "volumes",
            self.cluster.pvc_dir,
            overrides={message_path: self.termination_log, **self.path_overrides},
            rewrite_files=self.rewrite_files,
            hosts=hosts,
        )
        base = clean_env()
        base.pop("KUBECONFIG", None)
        self.env = process_env(
            self.pod,
            self.container,
            volumes.lookup,
            volumes.paths,
            volumes.translator,
            base=base,
            api_port=str(self.cluster.ports.get("apiserver", "")),
            extra=self.extra_env,
            marker=self.marker,
        )
        if hosts is not None:  # cluster DNS names → pod IPs; extra_env still wins
            resolved = hosts.resolve_env(self.env, timeout=min(self.timeout, 30.0))
            self.env.update({k: v for k, v in resolved.items() if k not in self.extra_env})
        self.argv = build_argv(
            self.container,
            self.env,
            volumes.translator,
            self.exe_map,
            f"{self.namespace}/{self.name}",
        )
        self.cwd = working_dir(self.container, volumes.translator, self.workdir) or self.cwd

    def _pod_names(self) -> PodNames | None:
        """The namespace's names → loopback IPs, for a pod that has a loopback IP itself."""
        if not str((self.pod.get("status") or {}).get("podIP") or "").startswith("127."):
            return None
        base = f"/api/v1/namespaces/{self.namespace}"

        def items(kind: str) -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = self.cluster.request("GET", f"{base}/{kind}")["items"]
            return found

        return PodNames(self.namespace, items)

    # -- monitor ---------------------------------------------------------------------
    def _monitor(self, started_at: str) -> None:
        assert self.process is not None and self.volumes is not None
        path = pod_path(self.namespace, self.name)
        term_deadline: float | None = None
        polls = 0
        try:
            while self.process.poll() is None:
                time.sleep(self.poll_interval)
                polls += 1
                try:
                    pod: dict[str, Any] | None = self.cluster.request("GET", path, timeout=10)
                except Exception as e:
                    if not is_not_found(e):
                        continue  # transient: try again next round
                    pod = None
                if pod is None or (pod.get("metadata") or {}).get("uid") != self.pod[
                    "metadata"
                ].get("uid"):
                    self.pod_deleted = True
                deleting = self.pod_deleted or (pod and pod["metadata"].get("deletionTimestamp"))
                ending = podgroup.sidecar_ends(self.is_sidecar, pod)
                if (deleting or ending) and not self.node_lost:  # a lost node's kubelet: none
                    if term_deadline is None:
                        self.terminated_by_deletion = bool(deleting)
                        self.terminated_with_pod = not deleting
                        grace = self.process.grace
                        if pod and pod["metadata"].get("deletionGracePeriodSeconds") is not None:
                            grace = float(pod["metadata"]["deletionGracePeriodSeconds"])
                        self._terminate()
                        term_deadline = time.monotonic() + grace
                    elif time.monotonic() > term_deadline:
                        self.signal_container(signal.SIGKILL)
                if pod is not None and not self.pod_deleted:
                    with contextlib.suppress(Exception):
                        self.volumes.refresh(pod, full=polls % 5 == 0)
            rc = self.process.wait()
            self.exit_code = 128 - rc if rc < 0 else rc
            self.process.stop(grace=0)  # sweep what is left of the process group, close log
            self._sweep()  # ... and of the container (helpers in other sessions)
            if not self.pod_deleted and not self.node_lost:
                self._report(started_at)
        except BaseException as e:
            self._error = e
        finally:
            self._done.set()

    def _termination_message(self) -> str | None:
        """What the kubelet reports as ``terminated.message``: the file's first 4096 bytes;
        with ``FallbackToLogsOnError`` and an empty file after a failure, the log's tail."""
        try:
            with self.termination_log.open("rb") as f:
                text = f.read(MESSAGE_BYTES).decode(errors="replace")
        except OSError:
            text = ""
        fallback = self.container.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        if not text and fallback and self.exit_code:
            text = "\n".join(self.log_text().splitlines()[-80:])[-2048:]
        return text or None

    def _report(self, started_at: str) -> None:
        """Report the exit and drop the local-process annotation (unless the pod is gone)."""
        assert self.exit_code is not None
        try:
            self.reported_status = report_container_exit(
                self.cluster,
                self.namespace,
                self.name,
                self.exit_code,
                container=self.container["name"],
                message=self._termination_message(),
                started_at=started_at,
            )
        except Exception as e:
            if not is_not_found(e):
                raise
            self.pod_deleted = True
        # the annotation stays while another container of the pod runs here
        pid = podgroup.annotation_pid(self)
        with contextlib.suppress(Exception):
            mark_local_process(self.cluster, self.namespace, self.name, pid)


def run_pod_locally(
    cluster: LocalCluster,
    namespace: str,
    name: str,
    *,
    timeout: float = 300.0,
    **kwargs: Any,
) -> LocalPod:
    """Run the pod's container to completion (see :class:`LocalPod`); returns the finished
    LocalPod (``exit_code``, ``reported_status``, ``log_text()``)."""
    lp = LocalPod(cluster, namespace, name, **kwargs).start()
    try:
        lp.wait(timeout)
    finally:
        lp.stop()
    return lp
