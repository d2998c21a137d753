"""What the scenarios train, and how they look at it: policies, PyTorchJobs, storage, Events.

The training is ``examples/train_mnist_like.py``, a small but state-sensitive PyTorch
run (dropout, AdamW, LR schedule, GradScaler, reshuffled data) that checkpoints only
through ``ckpt_agent.runtime.checkpointer.Checkpointer`` and the environment the webhook injects.
Its "image" is this checkout: the examples folder is a ``hostPath`` volume mounted at
``/opt/ckpt-examples`` and results go to a ``hostPath`` at ``/results`` (the harness
translates container paths to local ones).

A *reference* run of the same script and seed without checkpointing
(``--no-checkpoint``, a plain local process) gives the loss and final parameters an
uninterrupted run ends with; a resumed run must end with exactly the same.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus
from ckpt_agent.storage import StorageOptions, open_storage

from .cluster import LocalCluster
from .errors import ApiError
from .procs import clean_env
from .tools import REPO_ROOT

EXAMPLES_DIR = REPO_ROOT / "examples"
TRAIN_SCRIPT = EXAMPLES_DIR / "train_mnist_like.py"
CODE_MOUNT = "/opt/ckpt-examples"
RESULTS_MOUNT = "/results"
IMAGE = "ckpt-e2e.invalid/trainer:dev"  # never pulled: kwok runs nothing, the harness runs it

POLICY_ANNOTATION = "ckpt.dev/policy"
AUTO_RESUME_ANNOTATION = "ckpt.dev/auto-resume"


# --------------------------------------------------------------------------- training args
@dataclass(frozen=True)
class Training:
    """Arguments of one training run (everything that changes the numbers, plus pacing)."""

    steps: int = 80
    seed: int = 7
    step_sleep: float = 0.05
    """Seconds per step added by the script (paces the run; does not change the numbers)."""
    batch_size: int = 32
    hidden: int = 64
    samples: int = 1024
    checkpoint: bool = True
    """False: the script runs without the agent (``--no-checkpoint``; the agent-missing case)."""

    def numeric_args(self) -> list[str]:
        return [
            "--steps",
            str(self.steps),
            "--seed",
            str(self.seed),
            "--batch-size",
            str(self.batch_size),
            "--hidden",
            str(self.hidden),
            "--samples",
            str(self.samples),
        ]

    def container_args(self) -> list[str]:
        """Args inside the pod: outputs under /results, named after the pod (and its uid)."""
        return [
            *self.numeric_args(),
            "--step-sleep",
            str(self.step_sleep),
            "--out",
            f"{RESULTS_MOUNT}/$(POD_NAME).$(POD_UID).json",
            "--loss-log",
            f"{RESULTS_MOUNT}/$(POD_NAME).$(POD_UID).losses.jsonl",
        ] + ([] if self.checkpoint else ["--no-checkpoint"])


_references: dict[tuple[str, ...], dict[str, Any]] = {}


def reference_run(training: Training, workdir: Path, timeout: float = 300.0) -> dict[str, Any]:
    """The uninterrupted run: same script and numbers, no checkpointing (cached)."""
    key = tuple(training.numeric_args())
    if key in _references:
        return _references[key]
    digest = hashlib.sha256(" ".join(key).encode()).hexdigest()[:12]
    out = workdir / f"reference-{digest}.json"
    if not out.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [sys.executable, str(TRAIN_SCRIPT), *key, "--no-checkpoint", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=clean_env(),
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"reference run failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    _references[key] = result
    return result


def final_loss(result: Mapping[str, Any]) -> float:
    """The loss of the run's last step (from a ``--out`` JSON)."""
    return float.fromhex(result["losses"][str(int(result["steps"]) - 1)])


# --------------------------------------------------------------------------- manifests
def local_storage(path: Path | str, pvc: str | None = None) -> dict[str, Any]:
    local: dict[str, Any] = {"path": str(path)}
    if pvc:
        local["pvcName"] = pvc
    return {"type": "local", "local": local}


def s3_storage(
    bucket: str, endpoint: str, secret: str, prefix: str = "", region: str = "us-east-1"
) -> dict[str, Any]:
    return {
        "type": "s3",
        "s3": {
            "bucket": bucket,
            "prefix": prefix,
            "endpoint": endpoint,
            "region": region,
            "pathStyle": True,
            "credentialsSecret": {"name": secret},
        },
    }


def policy_manifest(
    name: str,
    storage: Mapping[str, Any],
    *,
    pulse_every: int = 10,
    full_every: int = 40,
    metrics_port: int | None = None,
    retention: Mapping[str, Any] | None = None,
    recovery: Mapping[str, Any] | None = None,
    scheduler: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A CheckpointPolicy with short intervals (steps, not hours) for a test-sized run.

    ``metrics_port``: every "pod" here shares this machine's network, so each policy
    gets its own agent metrics port (a real pod has its own network namespace).
    """
    spec: dict[str, Any] = {
        "tiers": {
            "heartbeat": {"everySteps": 1},
            "pulse": {
                "baseInterval": pulse_every,
                "minInterval": pulse_every,
                "maxInterval": pulse_every,
            },
            "full": {"everySteps": full_every},
        },
        "storage": dict(storage),
        "retention": {"importantKeep": 5, "routineKeep": 5, "reconcileIntervalSeconds": 10}
        | dict(retention or {}),
        "recovery": {"autoResume": True, "maxRestarts": 3, "backoffSeconds": 1}
        | dict(recovery or {}),
    }
    if metrics_port is not None:
        spec["agent"] = {"metricsPort": metrics_port}
    if scheduler is not None:
        spec["scheduler"] = dict(scheduler)
    spec.update(extra or {})
    return {
        "apiVersion": "ckpt.dev/v1alpha1",
        "kind": "CheckpointPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def opt_in_annotations(
    policy: str | None, auto_resume: bool = True, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """A job's annotations: ``extra``, plus the opt-in (``ckpt.dev/policy`` and
    ``ckpt.dev/auto-resume``) when ``policy``."""
    ann = dict(extra or {})
    if policy is not None:
        ann[POLICY_ANNOTATION] = policy
        if auto_resume:
            ann[AUTO_RESUME_ANNOTATION] = "true"
    return ann


TRAIN_COMMAND = ("python", f"{CODE_MOUNT}/{TRAIN_SCRIPT.name}")


def trainer_env() -> list[dict[str, Any]]:
    """The env the trainer's container needs (its outputs are named after the pod)."""
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]


def trainer_volumes(results_dir: Path) -> list[dict[str, Any]]:
    """The code (this checkout's examples) and results ``hostPath`` volumes of a trainer pod."""
    return [
        {"name": "code", "hostPath": {"path": str(EXAMPLES_DIR), "type": "Directory"}},
        {"name": "results", "hostPath": {"path": str(results_dir), "type": "DirectoryOrCreate"}},
    ]


def trainer_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "code", "mountPath": CODE_MOUNT, "readOnly": True},
        {"name": "results", "mountPath": RESULTS_MOUNT},
    ]


def pytorchjob_manifest(
    name: str,
    training: Training,
    results_dir: Path,
    *,
    policy: str | None = None,
    auto_resume: bool = True,
    annotations: Mapping[str, str] | None = None,
    node_selector: Mapping[str, str] | None = None,
    termination_grace_seconds: int = 30,
) -> dict[str, Any]:
    """A one-master PyTorchJob running the example script (opted in when ``policy``)."""
    ann = opt_in_annotations(policy, auto_resume, annotations)
    results_dir.mkdir(parents=True, exist_ok=True)
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": termination_grace_seconds,
        "containers": [
            {
                "name": "pytorch",
                "image": IMAGE,
                "command": list(TRAIN_COMMAND),
                "args": training.container_args(),
                "env": trainer_env(),
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                "volumeMounts": trainer_mounts(),
            }
        ],
        "volumes": trainer_volumes(results_dir),
    }
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "annotations": ann},
        "spec": {
            # No runPolicy.backoffLimit and restartPolicy Never: a failed pod stays and the
            # job becomes Failed (see docs/testing.md, pitfalls); recovery is the operator's.
            "pytorchReplicaSpecs": {
                "Master": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": {"spec": pod_spec},
                }
            }
        },
    }


def result_path(results_dir: Path, pod: Mapping[str, Any]) -> Path:
    meta = pod["metadata"]
    return results_dir / f"{meta['name']}.{meta['uid']}.json"


def loss_log_path(results_dir: Path, pod: Mapping[str, Any]) -> Path:
    meta = pod["metadata"]
    return results_dir / f"{meta['name']}.{meta['uid']}.losses.jsonl"


def last_logged_step(results_dir: Path, pod: Mapping[str, Any]) -> int:
    """The last step the pod's process logged (-1 before the first)."""
    try:
        lines = loss_log_path(results_dir, pod).read_text().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return -1


# --------------------------------------------------------------------------- storage
@dataclass
class StorageView:
    """Read-only look at a policy's checkpoint storage (the same manifests the operator reads)."""

    url: str
    options: StorageOptions | None = None
    _storage: Any = field(default=None, repr=False)

    @property
    def storage(self) -> Any:
        if self._storage is None:
            self._storage = open_storage(self.url, self.options)
        return self._storage

    def checkpoints(self, run_id: str, *, heartbeat: bool = False) -> list[CheckpointRecord]:
        return list_checkpoints(self.storage, run_id, include_heartbeat=heartbeat)

    def valid(self, run_id: str) -> list[CheckpointRecord]:
        """Valid weights checkpoints (pulse/full), oldest first."""
        return sorted(
            (
                r
                for r in self.checkpoints(run_id)
                if r.status == CheckpointStatus.VALID and r.tier in (Tier.PULSE, Tier.FULL)
            ),
            key=lambda r: (r.step, r.tier.value),
        )

    def newest_valid(self, run_id: str) -> CheckpointRecord | None:
        valid = self.valid(run_id)
        return valid[-1] if valid else None

    def since(self, run_id: str, after: float) -> list[CheckpointRecord]:
        """Committed checkpoints (any status, no heartbeats) created at or after ``after``."""
        return sorted(
            (r for r in self.checkpoints(run_id) if r.created_at >= after),
            key=lambda r: (r.step, r.created_at),
        )

    def close(self) -> None:
        if self._storage is not None:
            self._storage.close()
            self._storage = None


# --------------------------------------------------------------------------- jobs and events
def get_job(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return cluster.request(
            "GET", f"/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs/{name}"
        )
    except ApiError as e:
        if e.status == 404:
            return None
        raise


def list_jobs(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    items = cluster.request("GET", f"/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs")
    return list(items.get("items") or [])


def condition(obj: Mapping[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype and c.get("status") == "True":
            return dict(c)
    return None


def annotations_of(obj: Mapping[str, Any] | None) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("annotations") or {})


def operator_status(job: Mapping[str, Any] | None) -> dict[str, Any]:
    """The operator's ``ckpt.dev/status`` annotation, parsed ({} when absent)."""
    raw = annotations_of(job).get("ckpt.dev/status")
    if not raw:
        return {}
    data: dict[str, Any] = json.loads(raw)
    return data


def events(
    cluster: LocalCluster,
    namespace: str,
    *,
    name: str | None = None,
    kind: str | None = None,
    reason: str | None = None,
    wait: float = 0.0,
) -> list[dict[str, Any]]:
    """core/v1 Events of ``namespace`` (about object ``name`` / with ``reason``), oldest first.

    ``wait``: up to that many seconds for at least one (the operator posts its Events in
    the background, after the writes a test waits for; failing fast if a component died);
    then whatever there is, maybe none.
    """
    if wait <= 0:
        return _events(cluster, namespace, name, kind, reason)
    try:
        found = cluster.wait_for(
            lambda: _events(cluster, namespace, name, kind, reason),
            timeout=wait,
            what=f"Event {reason or '(any)'} in {namespace}" + (f" about {name}" if name else ""),
            interval=0.25,
        )
    except TimeoutError:
        return _events(cluster, namespace, name, kind, reason)
    assert isinstance(found, list)
    return found


def _events(
    cluster: LocalCluster,
    namespace: str,
    name: str | None,
    kind: str | None,
    reason: str | None,
) -> list[dict[str, Any]]:
    items = cluster.request("GET", f"/api/v1/namespaces/{namespace}/events").get("items") or []
    out = []
    for e in items:
        obj = e.get("involvedObject") or {}
        if name is not None and obj.get("name") != name:
            continue
        if kind is not None and obj.get("kind") != kind:
            continue
        if reason is not None and e.get("reason") != reason:
            continue
        out.append(e)
    # creation order: timestamps have one-second resolution, resourceVersions increase
    out.sort(
        key=lambda e: (
            e.get("firstTimestamp") or e.get("eventTime") or "",
            int(e["metadata"].get("resourceVersion") or 0),
        )
    )

    return out


def wait_event(
    cluster: LocalCluster,
    namespace: str,
    reason: str,
    *,
    name: str | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """The first Event ``reason`` (about ``name``), waiting up to ``timeout`` for it."""
    found = events(cluster, namespace, name=name, reason=reason, wait=timeout)
    assert found, f"no Event {reason} in {namespace}" + (f" about {name}" if name else "")
    return found[0]


def event_lines(cluster: LocalCluster, namespace: str) -> str:
    """The namespace's Events as text (for reports)."""
    return "\n".join(
        f"{e.get('type', ''):7} {e.get('reason', ''):18} "
        f"{(e.get('involvedObject') or {}).get('kind', '')}/"
        f"{(e.get('involvedObject') or {}).get('name', '')}: {e.get('message', '')}"
        for e in events(cluster, namespace)
    )
