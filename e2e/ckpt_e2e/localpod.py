"""Run a pod's container as a local process: the harness plays the kubelet for kwok pods.

kwok pods run no containers. :class:`LocalPod` takes a Pod as the API server stored it
(after every mutating webhook) and runs one of its containers on this machine, then
reports the exit through the API like a kubelet would.

Contract
========
**Pod and container.** The Pod is read back from the API server. The container is
``container=`` or, by default, the one named ``pytorch`` (what the training-operator
watches), else the first one. Init and other containers are not run (start another
``LocalPod(container=...)`` for a sidecar). By default the runner waits until kwok has
marked the pod Running (``wait_running``).

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
ephemeral-storage with ``divisor``; unset limits fall back to this machine's size).
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

**Deletion.** While the process runs the pod carries the annotation
``e2e.ckpt.dev/local-process=<pid>``; kwok's delete stage skips such pods. When the pod
gets a ``deletionTimestamp`` (``kubectl delete``, eviction/drain, garbage collection) or
disappears, the main process gets SIGTERM (like a container runtime, which signals the
container's init process only) and, after ``terminationGracePeriodSeconds``, every
process of the container SIGKILL. Then the exit is reported and the annotation
removed, and kwok completes the deletion.

**Exit report.** Through the ``pods/status`` subresource, like a kubelet: the container's
``state.terminated`` (``exitCode``, ``reason`` Completed/Error, ``startedAt``,
``finishedAt``); a process killed by signal N reports ``128+N`` (SIGKILL → 137). Other
containers are reported terminated with exit 0. ``restartPolicy: Never`` (the
training-operator's choice for PyTorchJob pods): phase Succeeded for exit 0, else
Failed. ``OnFailure`` with exit 0 → Succeeded; ``OnFailure`` with a failure, or
``Always``: the pod stays Running with ``restartCount+1`` and ``lastState.terminated``,
as after a kubelet restart (run it again if the scenario needs it).

Threads: a daemon thread per LocalPod polls the pod (every ``poll_interval`` s) and
reports the exit; :meth:`LocalPod.wait` re-raises any error it hit.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from .procs import ManagedProcess, clean_env, wait_until

if TYPE_CHECKING:
    from .cluster import LocalCluster

LOCAL_PROCESS_ANNOTATION = "e2e.ckpt.dev/local-process"
#: Environment marker of every process a local container started (see "The container").
CONTAINER_ENV = "CKPT_E2E_CONTAINER"
PYTORCH_CONTAINER = "pytorch"
_PATH_CHARS = "A-Za-z0-9_.-"


class LocalPodError(RuntimeError):
    """The pod cannot be run locally, or its exit could not be reported."""


# ---------------------------------------------------------------------------- helpers
def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def _is_not_found(e: Exception) -> bool:
    return getattr(e, "status", None) == 404


def pvc_path(cluster: LocalCluster, namespace: str, claim: str) -> Path:
    """Local folder that stands in for PersistentVolumeClaim ``namespace/claim``."""
    p = cluster.pvc_dir / namespace / claim
    p.mkdir(parents=True, exist_ok=True)
    return p


def expand_vars(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined vars are substituted, ``$$`` → ``$``,
    undefined references are left as they are."""
    out: list[str] = []
    i, n = 0, len(value)
    while i < n:
        c = value[i]
        if c == "$" and i + 1 < n:
            nxt = value[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                j = value.find(")", i + 2)
                if j == -1:
                    out.append(value[i:])
                    break
                name = value[i + 2 : j]
                out.append(env[name] if name in env else value[i : j + 1])
                i = j + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


class PathTranslator:
    """Maps container paths (mount paths) to local paths, see the module docstring."""

    def __init__(self, mapping: Mapping[str, Path | str]) -> None:
        self.mapping = {m.rstrip("/") or "/": Path(p) for m, p in mapping.items() if m.rstrip("/")}
        ordered = sorted(self.mapping, key=len, reverse=True)
        self._re = (
            re.compile(
                "|".join(
                    f"(?<![{_PATH_CHARS}]){re.escape(m)}(?=$|[^{_PATH_CHARS}])" for m in ordered
                )
            )
            if ordered
            else None
        )

    def text(self, s: str) -> str:
        if self._re is None:
            return s
        return self._re.sub(lambda mo: str(self.mapping[mo.group(0)]), s)

    def path(self, container_path: str) -> Path:
        """Local path of ``container_path`` (must lie under one of the mounts)."""
        translated = self.text(container_path)
        if translated == container_path:
            raise KeyError(f"{container_path} is not under any volume mount: {list(self.mapping)}")
        return Path(translated)


def _quantity(q: str | int | float) -> Decimal:
    from kubernetes.utils import parse_quantity

    return Decimal(parse_quantity(q))  # type: ignore[no-untyped-call,unused-ignore]


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _resource_field(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    res = ref["resource"]  # e.g. limits.cpu, requests.memory
    kind, _, name = res.partition(".")
    resources = container.get("resources") or {}
    raw = (resources.get(kind) or {}).get(name)
    if raw is None and kind == "requests":
        raw = (resources.get("limits") or {}).get(name)
    if raw is None:  # unset limit: the node's allocatable, i.e. this machine
        raw = (os.cpu_count() or 1) if name == "cpu" else _machine_memory()
    value = _quantity(raw)
    divisor = _quantity(ref.get("divisor") or "1")
    return str(math.ceil(value / divisor))


def _field_ref(pod: Mapping[str, Any], path: str) -> str:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        return _format_map(meta.get(path.split(".")[1]) or {})
    simple: dict[str, Any] = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or []),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
    }
    if path not in simple:
        raise LocalPodError(f"unsupported fieldRef {path!r}")
    return "" if simple[path] is None else str(simple[path])


def _format_map(m: Mapping[str, str]) -> str:
    """The kubelet's downward-API format for labels/annotations: sorted ``k="v"`` lines."""
    return "\n".join(f"{k}={json.dumps(m[k], ensure_ascii=False)}" for k in sorted(m))


def _write_atomic(path: Path, data: bytes, mode: int | None) -> bool:
    """Write ``path`` via rename; returns True when the content changed."""
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    if mode is not None:
        tmp.chmod(mode)
    os.replace(tmp, path)
    return True


def container_pids(marker: str) -> list[int]:
    """Processes (other than this one) whose environment carries ``CONTAINER_ENV=marker``."""
    needle = f"{CONTAINER_ENV}={marker}".encode() + b"\0"
    out: list[int] = []
    me = os.getpid()
    with contextlib.suppress(OSError):
        entries = os.listdir("/proc")
        for entry in entries:
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if needle in env or env.endswith(needle[:-1]):
                out.append(int(entry))
    return out


# ---------------------------------------------------------------------------- exit report
def report_container_exit(
    cluster: LocalCluster,
    namespace: str,
    name: str,
    exit_code: int,
    *,
    container: str | None = None,
    reason: str | None = None,
    message: str | None = None,
    started_at: str | None = None,
) -> dict[str, Any]:
    """Report through ``pods/status`` that ``container`` exited with ``exit_code``.

    Semantics as in the module docstring ("Exit report"). Returns the updated pod status.
    Works for any kwok pod, whether or not a local process ran for it.
    """
    pod = cluster.request("GET", _pod_path(namespace, name))
    spec, status = pod["spec"], pod.get("status") or {}
    names = [c["name"] for c in spec["containers"]]
    target = container or (PYTORCH_CONTAINER if PYTORCH_CONTAINER in names else names[0])
    if target not in names:
        raise LocalPodError(f"pod {namespace}/{name} has no container {target!r}: {names}")
    now = _now()
    old = {s["name"]: s for s in status.get("containerStatuses") or []}
    restart_policy = spec.get("restartPolicy", "Always")
    restart = restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)
    terminated = {
        "exitCode": exit_code,
        "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        "startedAt": started_at
        or (old.get(target, {}).get("state", {}).get("running", {}).get("startedAt") or now),
        "finishedAt": now,
    }
    if message:
        terminated["message"] = message
    statuses = []
    for c in spec["containers"]:
        prev = old.get(c["name"], {})
        base = {
            "name": c["name"],
            "image": c.get("image", ""),
            "imageID": prev.get("imageID", ""),
            "containerID": prev.get("containerID", f"local://{namespace}/{name}/{c['name']}"),
            "restartCount": prev.get("restartCount", 0),
        }
        if c["name"] == target and restart:
            statuses.append(
                {
                    **base,
                    "restartCount": base["restartCount"] + 1,
                    "ready": True,
                    "started": True,
                    "lastState": {"terminated": terminated},
                    "state": {"running": {"startedAt": now}},
                }
            )
        elif c["name"] == target:
            statuses.append(
                {**base, "ready": False, "started": False, "state": {"terminated": terminated}}
            )
        elif restart:
            statuses.append(
                prev or {**base, "ready": True, "state": {"running": {"startedAt": now}}}
            )
        else:  # the pod is ending: its other containers end too
            run = prev.get("state", {}).get("running", {})
            statuses.append(
                {
                    **base,
                    "ready": False,
                    "started": False,
                    "state": {
                        "terminated": {
                            "exitCode": 0,
                            "reason": "Completed",
                            "startedAt": run.get("startedAt", now),
                            "finishedAt": now,
                        }
                    },
                }
            )
    if restart:
        patch: dict[str, Any] = {"status": {"containerStatuses": statuses}}
    else:
        phase = "Succeeded" if exit_code == 0 else "Failed"
        cond_reason = "PodCompleted" if exit_code == 0 else "PodFailed"
        conds = []
        for cond in status.get("conditions") or []:
            if cond["type"] in ("Ready", "ContainersReady"):
                conds.append(
                    {**cond, "status": "False", "reason": cond_reason, "lastTransitionTime": now}
                )
            else:
                conds.append(cond)
        patch = {"status": {"phase": phase, "containerStatuses": statuses, "conditions": conds}}
    updated = cluster.request(
        "PATCH",
        _pod_path(namespace, name) + "/status",
        patch,
        content_type="application/merge-patch+json",
    )
    result: dict[str, Any] = updated.get("status") or {}
    return result


# ---------------------------------------------------------------------------- runner
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
        self.exe_map = {"python": sys.executable, "python3": sys.executable, **(exe_map or {})}
        self.extra_env = dict(extra_env or {})
        self.rewrite_files = rewrite_files
        self.wait_running = wait_running
        self.timeout = timeout
        self.poll_interval = poll_interval

        self.pod: dict[str, Any] = {}
        self.container: dict[str, Any] = {}
        self.paths: dict[str, Path] = {}
        self.translator = PathTranslator({})
        self.env: dict[str, str] = {}
        self.argv: list[str] = []
        self.cwd: Path = self.workdir / "cwd"
        self.process: ManagedProcess | None = None
        self.exit_code: int | None = None
        self.reported_status: dict[str, Any] | None = None
        self.pod_deleted = False
        self.terminated_by_deletion = False
        self._started_at = ""
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._shm_dirs: list[Path] = []
        self._volume_writers: list[tuple[Callable[[dict[str, Any]], None], bool]] = []

    # -- public API ------------------------------------------------------------------
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

    def start(self) -> Self:
        """Read the pod, prepare volumes/env/argv, start the process and the monitor."""
        path = _pod_path(self.namespace, self.name)
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
        self._select_container()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._prepare_volumes()
        self._prepare_env()
        self._prepare_argv()
        self.cwd.mkdir(parents=True, exist_ok=True)
        self._started_at = _now()
        self.process = ManagedProcess(
            f"pod/{self.namespace}/{self.name}/{self.container['name']}",
            self.argv,
            self.log_path,
            env=self.env,
            cwd=self.cwd,
            grace=float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)),
        ).start()
        try:
            self.cluster.request(
                "PATCH",
                path,
                {"metadata": {"annotations": {LOCAL_PROCESS_ANNOTATION: str(self.process.pid)}}},
            )
        except Exception as e:
            if not _is_not_found(e):
                self.process.stop(grace=1)
                raise
        self._thread = threading.Thread(
            target=self._monitor, name=f"localpod-{self.name}", daemon=True
        )
        self._thread.start()
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
        if self.process is None or self._done.is_set():
            self._sweep()
            self._cleanup_shm()
            return
        self._terminate()
        if not self._done.wait(min(timeout, self.process.grace)):
            self.kill()
            self._done.wait(timeout)
        self._sweep()
        self._cleanup_shm()

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

    def _select_container(self) -> None:
        containers = self.pod["spec"]["containers"]
        names = [c["name"] for c in containers]
        want = self.container_name or (
            PYTORCH_CONTAINER if PYTORCH_CONTAINER in names else names[0]
        )
        for c in containers:
            if c["name"] == want:
                self.container = c
                return
        raise LocalPodError(f"pod {self.namespace}/{self.name} has no container {want!r}: {names}")

    def _get(self, kind: str, name: str, optional: bool) -> dict[str, str] | None:
        """Data of a ConfigMap or Secret (decoded), or None if optional and missing."""
        try:
            obj = self.cluster.request("GET", f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")
        except Exception as e:
            if _is_not_found(e) and optional:
                return None
            raise LocalPodError(f"{kind} {self.namespace}/{name}: {e}") from e
        if kind == "secrets":
            return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        data = dict(obj.get("data") or {})
        for k, v in (obj.get("binaryData") or {}).items():
            data[k] = base64.b64decode(v).decode(errors="replace")
        return data

    def _prepare_volumes(self) -> None:
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        vol_root = self.workdir / "volumes"
        local_of: dict[str, Path] = {}
        for mount in self.container.get("volumeMounts") or []:
            vname = mount["name"]
            if vname not in local_of:
                local_of[vname] = self._volume_dir(volumes.get(vname, {"name": vname}), vol_root)
            local = local_of[vname]
            if mount.get("subPath"):
                local = local / mount["subPath"]
            self.paths[mount["mountPath"]] = local
        self.paths.update(self.path_overrides)
        self.translator = PathTranslator(self.paths)
        self._refresh(self.pod, full=True)

    def _volume_dir(self, vol: Mapping[str, Any], vol_root: Path) -> Path:
        name: str = vol["name"]
        if "hostPath" in vol:
            p = Path(vol["hostPath"]["path"])
            p.mkdir(parents=True, exist_ok=True)
            return p
        if "persistentVolumeClaim" in vol:
            return self._claim_dir(vol["persistentVolumeClaim"]["claimName"])
        if (
            "emptyDir" in vol
            and (vol["emptyDir"] or {}).get("medium") == "Memory"
            and Path("/dev/shm").is_dir()
        ):
            p = Path("/dev/shm") / f"ckpt-e2e-{self.pod['metadata'].get('uid', self.name)}" / name
            p.mkdir(parents=True, exist_ok=True)
            self._shm_dirs.append(p.parent)
            return p
        d = vol_root / name
        d.mkdir(parents=True, exist_ok=True)
        for key in ("configMap", "secret", "downwardAPI", "projected"):
            if key in vol:
                self._volume_writers.append(self._writer(key, vol[key] or {}, d))
        return d

    def _claim_dir(self, claim: str) -> Path:
        """The bound PV's hostPath (see LocalCluster.create_pvc), else pvc_path()."""
        with contextlib.suppress(Exception):
            pvc = self.cluster.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{claim}"
            )
            pv_name = pvc["spec"].get("volumeName")
            if pv_name:
                pv = self.cluster.request("GET", f"/api/v1/persistentvolumes/{pv_name}")
                host = (pv["spec"].get("hostPath") or {}).get("path")
                if host:
                    p = Path(host)
                    p.mkdir(parents=True, exist_ok=True)
                    return p
        return pvc_path(self.cluster, self.namespace, claim)

    def _writer(
        self, kind: str, src: Mapping[str, Any], d: Path
    ) -> tuple[Callable[[dict[str, Any]], None], bool]:
        """A function that (re)materializes one volume from the current pod object, and
        whether it reads from the API (configMap/secret) rather than the pod alone."""
        default_mode = src.get("defaultMode")

        def files_of(
            sub_kind: str, sub: Mapping[str, Any], pod: dict[str, Any]
        ) -> dict[str, tuple[str, int | None]]:
            files: dict[str, tuple[str, int | None]] = {}
            if sub_kind in ("configMap", "secret"):
                ref = sub.get("name") or sub.get("secretName", "")
                data = self._get(
                    "configmaps" if sub_kind == "configMap" else "secrets",
                    ref,
                    bool(sub.get("optional")),
                )
                if data is None:
                    return files
                items = sub.get("items")
                if items:
                    for it in items:
                        if it["key"] in data:
                            files[it["path"]] = (data[it["key"]], it.get("mode"))
                else:
                    files = {k: (v, None) for k, v in data.items()}
            elif sub_kind == "downwardAPI":
                for it in sub.get("items") or []:
                    if "fieldRef" in it:
                        value = _field_ref(pod, it["fieldRef"]["fieldPath"])
                    else:
                        cname = (
                            it["resourceFieldRef"].get("containerName") or self.container["name"]
                        )
                        c = next(x for x in pod["spec"]["containers"] if x["name"] == cname)
                        value = _resource_field(c, it["resourceFieldRef"])
                    files[it["path"]] = (value, it.get("mode"))
            elif sub_kind == "serviceAccountToken":
                token = self._sa_token(sub)
                if token is not None:
                    files[sub["path"]] = (token, None)
            return files

        def write(pod: dict[str, Any]) -> None:
            files: dict[str, tuple[str, int | None]] = {}
            if kind == "projected":
                for source in src.get("sources") or []:
                    for sub_kind, sub in source.items():
                        files.update(files_of(sub_kind, sub or {}, pod))
            else:
                sub = dict(src)
                if kind == "secret":
                    sub["name"] = src.get("secretName", "")
                files = files_of(kind, sub, pod)
            for rel, (raw, mode) in files.items():
                text = self.translator.text(raw) if self.rewrite_files and kind != "secret" else raw
                _write_atomic(d / rel, text.encode(), mode if mode is not None else default_mode)

        uses_api = kind in ("configMap", "secret") or (
            kind == "projected"
            and any(("configMap" in s or "secret" in s) for s in src.get("sources") or [])
        )
        return write, uses_api

    def _sa_token(self, sub: Mapping[str, Any]) -> str | None:
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [sub["audience"]] if sub.get("audience") else [],
                "expirationSeconds": int(sub.get("expirationSeconds") or 3607),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": self.name,
                    "uid": self.pod["metadata"].get("uid"),
                },
            },
        }
        try:
            res = self.cluster.request(
                "POST", f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{sa}/token", body
            )
        except Exception:
            return None
        token = (res.get("status") or {}).get("token")
        return str(token) if token else None

    def _refresh(self, pod: dict[str, Any], full: bool) -> None:
        for write, uses_api in self._volume_writers:
            if full or not uses_api:
                write(pod)

    def _prepare_env(self) -> None:
        base = clean_env()
        base.pop("KUBECONFIG", None)
        pod_env: dict[str, str] = {}
        for src in self.container.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                ref = src["configMapRef"]
                data = self._get("configmaps", ref["name"], bool(ref.get("optional")))
            else:
                ref = src["secretRef"]
                data = self._get("secrets", ref["name"], bool(ref.get("optional")))
            for k, v in (data or {}).items():
                pod_env[prefix + k] = v
        for e in self.container.get("env") or []:
            pod_env[e["name"]] = self._env_value(e, pod_env)
        translated = {k: self.translator.text(v) for k, v in pod_env.items()}
        self.env = {
            **base,
            "HOSTNAME": self.name,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.cluster.ports.get("apiserver", "")),
            **translated,
            **self.extra_env,
            CONTAINER_ENV: self.marker,
            "CKPT_E2E_POD_NAME": self.name,
            "CKPT_E2E_POD_NAMESPACE": self.namespace,
            "CKPT_E2E_PATH_MAP": json.dumps({k: str(v) for k, v in self.paths.items()}),
        }

    def _env_value(self, e: Mapping[str, Any], defined: Mapping[str, str]) -> str:
        if "valueFrom" not in e:
            return expand_vars(str(e.get("value", "")), defined)
        vf = e["valueFrom"]
        if "fieldRef" in vf:
            return _field_ref(self.pod, vf["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in vf:
            cname = vf["resourceFieldRef"].get("containerName") or self.container["name"]
            c = next(x for x in self.pod["spec"]["containers"] if x["name"] == cname)
            return _resource_field(c, vf["resourceFieldRef"])
        for key, kind in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if key in vf:
                ref = vf[key]
                data = self._get(kind, ref["name"], bool(ref.get("optional")))
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        return ""
                    raise LocalPodError(f"{key} {ref['name']}/{ref['key']} not found")
                return data[ref["key"]]
        raise LocalPodError(f"unsupported valueFrom in env {e['name']}: {vf}")

    def _prepare_argv(self) -> None:
        command = self.container.get("command") or []
        if not command:
            raise LocalPodError(
                f"container {self.container['name']} of {self.namespace}/{self.name} has no "
                "command: a local run cannot use the image's entrypoint"
            )
        argv = [
            self.translator.text(expand_vars(str(a), self.env))
            for a in [*command, *(self.container.get("args") or [])]
        ]
        argv[0] = self.exe_map.get(argv[0], argv[0])
        self.argv = argv
        wd = self.container.get("workingDir")
        if wd:
            translated = self.translator.text(wd)
            # an untranslated absolute container path would point anywhere on the host
            self.cwd = (
                Path(translated) if translated != wd else self.workdir / "cwd" / wd.lstrip("/")
            )

    # -- monitor ---------------------------------------------------------------------
    def _monitor(self) -> None:
        assert self.process is not None
        path = _pod_path(self.namespace, self.name)
        term_deadline: float | None = None
        polls = 0
        try:
            while self.process.poll() is None:
                time.sleep(self.poll_interval)
                polls += 1
                try:
                    pod: dict[str, Any] | None = self.cluster.request("GET", path, timeout=10)
                except Exception as e:
                    if not _is_not_found(e):
                        continue  # transient: try again next round
                    pod = None
                if pod is None or (pod.get("metadata") or {}).get("uid") != self.pod[
                    "metadata"
                ].get("uid"):
                    self.pod_deleted = True
                if self.pod_deleted or (pod and pod["metadata"].get("deletionTimestamp")):
                    if term_deadline is None:
                        self.terminated_by_deletion = True
                        grace = self.process.grace
                        if pod and pod["metadata"].get("deletionGracePeriodSeconds") is not None:
                            grace = float(pod["metadata"]["deletionGracePeriodSeconds"])
                        self._terminate()
                        term_deadline = time.monotonic() + grace
                    elif time.monotonic() > term_deadline:
                        self.signal_container(signal.SIGKILL)
                if pod is not None and not self.pod_deleted:
                    with contextlib.suppress(Exception):
                        self._refresh(pod, full=polls % 5 == 0)
            rc = self.process.wait()
            self.exit_code = 128 - rc if rc < 0 else rc
            self.process.stop(grace=0)  # sweep what is left of the process group, close log
            self._sweep()  # ... and of the container (helpers in other sessions)
            if not self.pod_deleted:
                try:
                    self.reported_status = report_container_exit(
                        self.cluster,
                        self.namespace,
                        self.name,
                        self.exit_code,
                        container=self.container["name"],
                        started_at=self._started_at,
                    )
                except Exception as e:
                    if not _is_not_found(e):
                        raise
                    self.pod_deleted = True
                with contextlib.suppress(Exception):
                    self.cluster.request(
                        "PATCH",
                        path,
                        {"metadata": {"annotations": {LOCAL_PROCESS_ANNOTATION: None}}},
                    )
        except BaseException as e:
            self._error = e
        finally:
            self._done.set()

    def _cleanup_shm(self) -> None:
        for d in self._shm_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._shm_dirs.clear()


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
