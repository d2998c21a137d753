"""The mutating webhook's builder: what an opted-in training pod gets.

:func:`build_pod_patch` turns a pod (as admitted), the job's policy and the
job's annotations into a JSON Patch. It is pure: the handler fetches the job
and the policy, calls this, and hands the ops to kopf.

What the training container (``spec.agent.containerName``, default
``pytorch``) receives:

* env: ``CKPT_CONFIG``, ``CKPT_RUN_ID``, ``CKPT_STORAGE_URL``,
  ``CKPT_RESUME_FROM`` (restarts only; ``CKPT_RESUME_WEIGHTS`` for a heartbeat
  rebuild, ``CKPT_RESUME_PIN`` for a manual one), ``CKPT_RUN_STARTED_AT``,
  ``CKPT_MTBF_SECONDS`` (:mod:`ckpt_operator.planners.runfacts`), ``CKPT_SHM_DIR``,
  ``CKPT_SIGNAL_FILE``, ``CKPT_METRICS_PORT``, ``CKPT_WORK_DIR``,
  ``CKPT_NAMESPACE`` (downward API), ``CKPT_JOB_NAME``, ``CKPT_JOB_UID`` (the owner
  the agent claims the run for, :mod:`ckpt_agent.format.owner`), ``CKPT_POD_NAME``
  and ``CKPT_NODE_NAME`` (downward API: the writer generation's record names them,
  so a fenced writer's error and ``ckpt ls`` say which pod on which node holds the
  run, :mod:`ckpt_agent.format.fence`), ``CKPT_POD_UID`` (a pod that lost the run
  never claims it back when its container restarts in place),
  ``CKPT_TERMINATION_LOG`` (the container's ``terminationMessagePath``, set to the
  Kubernetes default with policy ``File`` when absent: the agent keeps its checkpoint
  report there, :mod:`ckpt_agent.format.termination`, for the operator); for S3 the
  connection settings (``CKPT_S3_ENDPOINT_URL`` …) and the credentials as
  ``secretKeyRef`` (never values);
* volumes: the policy's ConfigMap (the agent config JSON, read-only), a
  memory-backed ``emptyDir`` for snapshots (``sizeLimit`` from the policy), a
  downward-API file carrying the pod's ``ckpt.dev/save-now`` annotation (the
  save-now signal), a work ``emptyDir``, and the storage PVC for local storage
  on a PVC;
* a ``ckpt-metrics`` container port;
* ``terminationGracePeriodSeconds`` raised to cover the expected save (with
  ``spec.preemption.saveOnEviction``, at most ``maxGraceSeconds``, never lowered:
  :func:`ckpt_operator.planners.preemption.termination_grace`), so the emergency
  checkpoint SIGTERM starts (an eviction, a drain) can commit before SIGKILL;
* when ``spec.agent.sidecar``: a native sidecar (an init container with
  ``restartPolicy: Always``) running the persisting agent with the same env
  and mounts (with ``spec.agent.replicas``: :mod:`.replica_injection`).

Rules: a value the user already set (an env var, a port) is kept and noted;
a pod the builder cannot handle safely (no training container, a volume or
mount path already taken) gets **no** ops and a reason; an already injected
pod gets no ops (idempotent re-admission).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckpt_agent.format.termination import DEFAULT_PATH as TERMINATION_LOG_PATH
from ckpt_agent.format.termination import ENV_PATH as ENV_TERMINATION_LOG
from ckpt_agent.policy import AgentConfig, CheckpointPolicySpec, StorageType
from ckpt_agent.policy.agent_config import (
    ENV_CONFIG,
    ENV_JOB_NAME,
    ENV_JOB_UID,
    ENV_METRICS_PORT,
    ENV_NAMESPACE,
    ENV_NODE_NAME,
    ENV_POD_NAME,
    ENV_POD_UID,
    ENV_RESUME_FROM,
    ENV_RUN_ID,
    ENV_SHM_DIR,
    ENV_SIGNAL_FILE,
    ENV_STORAGE_URL,
    ENV_WORK_DIR,
)
from ckpt_agent.storage.options import s3_env
from ckpt_operator.model import constants as c
from ckpt_operator.model.bodies import Body, meta_of
from ckpt_operator.model.jsonpatch import JSONPatchOp, add, pointer
from ckpt_operator.model.names import derived_name
from ckpt_operator.planners.preemption import termination_grace
from ckpt_operator.planners.replica_injection import add_replication

__all__ = [
    "InjectionContext",
    "InjectionResult",
    "build_config_map",
    "build_pod_patch",
    "config_map_name",
    "is_injected",
    "is_unprotected",
]


def config_map_name(policy_name: str) -> str:
    """Name of the ConfigMap holding the agent config of ``policy_name`` (deterministic)."""
    return derived_name("ckpt-", policy_name)


def build_config_map(
    policy_name: str, namespace: str, spec: CheckpointPolicySpec, policy_uid: str | None = None
) -> dict[str, Any]:
    """The ConfigMap the webhook mounts at ``/etc/ckpt`` (owned by the policy).

    It holds the policy-level agent config; the per-pod values (run id, resume
    point, paths) are injected as ``CKPT_*`` env vars, which win over the file.
    """
    config = AgentConfig.from_policy(
        spec,
        run_id=policy_name,
        shm_dir=c.SHM_DIR,
        signal_file=c.SIGNAL_FILE,
        work_dir=c.WORK_DIR,
    )
    meta: dict[str, Any] = {
        "name": config_map_name(policy_name),
        "namespace": namespace,
        "labels": {
            "app.kubernetes.io/managed-by": "ckpt-operator",
            f"{c.PREFIX}/policy": policy_name,
        },
    }
    if policy_uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": "ckpt.dev/v1alpha1",
                "kind": "CheckpointPolicy",
                "name": policy_name,
                "uid": policy_uid,
                "controller": True,
                "blockOwnerDeletion": False,
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {c.CONFIG_KEY: config.to_json()},
    }


@dataclass(frozen=True)
class InjectionContext:
    """Per-pod facts and operator settings the builder needs besides the policy."""

    policy_name: str
    """The job's ``ckpt.dev/policy``."""
    run_id: str
    """The job's run id (:func:`ckpt_operator.model.jobs.run_id_of`)."""
    resume_from: str | None = None
    """Checkpoint id to resume from (the job's ``ckpt.dev/resume-from``)."""
    agent_image: str = ""
    """Sidecar image when the policy names none (the operator's ``--agent-image``)."""
    sidecar_command: tuple[str, ...] = ("ckpt", "sidecar")
    """Sidecar entry point."""
    sidecar_resources: Mapping[str, Any] = field(
        default_factory=lambda: {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "2Gi"},
        }
    )
    """Sidecar container resources."""
    job_name: str = ""
    """The PyTorchJob's name (the run's owner record)."""
    job_uid: str = ""
    """The PyTorchJob's uid (the run's owner record)."""
    run_env: Mapping[str, str] = field(default_factory=dict)
    """The run's facts from the job (:func:`ckpt_operator.planners.runfacts.agent_run_env`)."""
    default_container: str | None = None
    """The job kind's training container, used when the pod has none named
    ``spec.agent.containerName`` (a TrainJob's ``node``; :mod:`ckpt_operator.kinds.kind`)."""
    job: Mapping[str, Any] | None = None
    """The job's body: its ranks for peer replication (:mod:`.replica_injection`)."""


@dataclass(frozen=True)
class InjectionResult:
    """What the webhook does to one pod."""

    ops: list[JSONPatchOp]
    """The JSON Patch (empty when nothing is to be done)."""
    skipped: str | None = None
    """Why nothing was injected (None when injected, or when there was nothing to do)."""
    notes: tuple[str, ...] = ()
    """Parts left out because the user set them already (the pod was injected otherwise)."""
    already_injected: bool = False
    """The pod carries the injection marker: re-admission, nothing to do."""

    @property
    def injected(self) -> bool:
        return bool(self.ops)


def is_injected(pod: Mapping[str, Any]) -> bool:
    """The pod was injected already (marker annotation or our config volume)."""
    meta = meta_of(pod)
    if meta.annotations.get(c.ANN_INJECTED):
        return True
    spec = Body(pod).spec
    return any(v.get("name") == c.VOL_CONFIG for v in spec.get("volumes") or ())


def is_unprotected(pod: Mapping[str, Any]) -> bool:
    """An opted-in pod (``ckpt.dev/inject`` label) without the agent."""
    meta = meta_of(pod)
    return meta.labels.get(c.LABEL_INJECT) == "true" and not is_injected(pod)


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _agent_env(
    spec: CheckpointPolicySpec, ctx: InjectionContext, metrics_port: int
) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": ENV_CONFIG, "value": c.CONFIG_PATH},
        {"name": ENV_RUN_ID, "value": ctx.run_id},
        {"name": ENV_STORAGE_URL, "value": spec.storage.url()},
    ]
    if ctx.resume_from:
        env.append({"name": ENV_RESUME_FROM, "value": ctx.resume_from})
    env += [{"name": k, "value": v} for k, v in ctx.run_env.items()]
    env += [
        {"name": ENV_SHM_DIR, "value": c.SHM_DIR},
        {"name": ENV_SIGNAL_FILE, "value": c.SIGNAL_FILE},
        {"name": ENV_METRICS_PORT, "value": str(metrics_port)},
        {"name": ENV_WORK_DIR, "value": c.WORK_DIR},
        {"name": ENV_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": ENV_NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": ENV_POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    env += [
        {"name": name, "value": value}
        for name, value in ((ENV_JOB_NAME, ctx.job_name), (ENV_JOB_UID, ctx.job_uid))
        if value
    ]
    if spec.storage.type == StorageType.S3 and spec.storage.s3 is not None:
        s3 = spec.storage.s3
        env += [{"name": name, "value": value} for name, value in s3_env(s3)]
        if s3.credentials_secret is not None:
            ref = s3.credentials_secret
            env.append(_secret_env(c.ENV_S3_ACCESS_KEY_ID, ref.name, ref.access_key_id_key))
            env.append(_secret_env(c.ENV_S3_SECRET_ACCESS_KEY, ref.name, ref.secret_access_key_key))
    return env


def _volumes(spec: CheckpointPolicySpec, ctx: InjectionContext) -> list[dict[str, Any]]:
    vols: list[dict[str, Any]] = [
        {
            "name": c.VOL_CONFIG,
            "configMap": {
                "name": config_map_name(ctx.policy_name),
                "items": [{"key": c.CONFIG_KEY, "path": c.CONFIG_KEY}],
            },
        },
        {
            "name": c.VOL_SHM,
            "emptyDir": {"medium": "Memory", "sizeLimit": f"{spec.agent.shm_size_mb}Mi"},
        },
        {
            "name": c.VOL_SIGNAL,
            "downwardAPI": {
                "items": [
                    {
                        "path": c.SIGNAL_KEY,
                        "fieldRef": {
                            "apiVersion": "v1",
                            "fieldPath": f"metadata.annotations['{c.ANN_SAVE_NOW}']",
                        },
                    }
                ]
            },
        },
        {"name": c.VOL_WORK, "emptyDir": {}},
    ]
    if spec.storage.type == StorageType.LOCAL and spec.storage.local.pvc_name:
        vols.append(
            {
                "name": c.VOL_STORAGE,
                "persistentVolumeClaim": {"claimName": spec.storage.local.pvc_name},
            }
        )
    return vols


def _mounts(spec: CheckpointPolicySpec) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": c.VOL_CONFIG, "mountPath": c.CONFIG_DIR, "readOnly": True},
        {"name": c.VOL_SHM, "mountPath": c.SHM_DIR},
        {"name": c.VOL_SIGNAL, "mountPath": c.SIGNAL_DIR, "readOnly": True},
        {"name": c.VOL_WORK, "mountPath": c.WORK_DIR},
    ]
    if spec.storage.type == StorageType.LOCAL and spec.storage.local.pvc_name:
        mounts.append({"name": c.VOL_STORAGE, "mountPath": spec.storage.local.path})
    return mounts


def _append_list(
    ops: list[JSONPatchOp], base: str, current: object, items: Sequence[Mapping[str, Any]]
) -> None:
    """Append ``items`` to the list at ``base`` (creating it when absent)."""
    if not items:
        return
    if isinstance(current, list):
        for item in items:
            ops.append(add(base + "/-", dict(item)))
    else:
        ops.append(add(base, [dict(i) for i in items]))


def _merge_map(
    ops: list[JSONPatchOp], base: str, current: object, items: Mapping[str, str]
) -> None:
    if isinstance(current, dict):
        for key, value in items.items():
            ops.append(add(base + pointer(key), value))
    else:
        ops.append(add(base, dict(items)))


def _sidecar_metrics_port(port: int) -> int:
    return port + 1 if port < 65535 else port - 1


def build_pod_patch(
    pod: Mapping[str, Any],
    policy_spec: CheckpointPolicySpec,
    job_annotations: Mapping[str, str],
    ctx: InjectionContext,
) -> InjectionResult:
    """The JSON Patch that injects the checkpoint agent into ``pod`` (see the module doc).

    ``job_annotations`` are the owning PyTorchJob's; they win over ``ctx`` for
    the run id and the resume point (a restart carries them).
    """
    if is_injected(pod):
        return InjectionResult(ops=[], already_injected=True)
    spec_obj = pod.get("spec")
    if not isinstance(spec_obj, Mapping):
        return InjectionResult(ops=[], skipped="the object has no pod spec")
    containers = spec_obj.get("containers") or []
    target_name = policy_spec.agent.container_name
    names_in_pod = [ctr.get("name") for ctr in containers]
    fallback = ctx.default_container
    if target_name not in names_in_pod and fallback is not None and fallback in names_in_pod:
        target_name = fallback
    index = next((i for i, n in enumerate(names_in_pod) if n == target_name), None)
    if index is None:
        names = ", ".join(str(ctr.get("name")) for ctr in containers) or "none"
        return InjectionResult(
            ops=[],
            skipped=(
                f"no container named {target_name!r} (policy spec.agent.containerName); "
                f"the pod has: {names}"
            ),
        )
    run_id = job_annotations.get(c.ANN_RUN_ID) or ctx.run_id
    resume_from = job_annotations.get(c.ANN_RESUME_FROM) or ctx.resume_from
    ctx = replace(ctx, run_id=run_id, resume_from=resume_from)

    # Refuse pods whose names or paths we would clobber.
    existing_volumes = {v.get("name") for v in spec_obj.get("volumes") or ()}
    taken = sorted(n for n in c.INJECTED_VOLUMES if n in existing_volumes)
    if taken:
        return InjectionResult(
            ops=[], skipped=f"volume name(s) {', '.join(taken)} already used by the pod"
        )
    container = containers[index]
    mounts = _mounts(policy_spec)
    used_paths = {m.get("mountPath", "").rstrip("/") for m in container.get("volumeMounts") or ()}
    notes: list[str] = []
    clash = sorted(m["mountPath"] for m in mounts if m["mountPath"].rstrip("/") in used_paths)
    if clash:
        storage_path = policy_spec.storage.local.path.rstrip("/")
        hard = [p for p in clash if p.rstrip("/") != storage_path]
        if hard:
            return InjectionResult(
                ops=[],
                skipped=(
                    f"mount path(s) {', '.join(hard)} already used by container {target_name!r}"
                ),
            )
        # The user mounts their own volume at the storage path: keep theirs.
        mounts = [m for m in mounts if m["name"] != c.VOL_STORAGE]
        notes.append(
            f"storage path {storage_path} is already mounted by the pod; kept the pod's mount"
        )
    all_names = {ctr.get("name") for ctr in containers} | {
        ctr.get("name") for ctr in spec_obj.get("initContainers") or ()
    }
    sidecar_image = policy_spec.agent.image or ctx.agent_image
    want_sidecar = policy_spec.agent.sidecar
    if want_sidecar and c.SIDECAR_NAME in all_names:
        return InjectionResult(
            ops=[], skipped=f"a container named {c.SIDECAR_NAME!r} already exists in the pod"
        )
    if want_sidecar and not sidecar_image:
        want_sidecar = False
        notes.append(
            "spec.agent.sidecar is true but no agent image is set (spec.agent.image or the "
            "operator's --agent-image): the agent persists in-process"
        )

    ops: list[JSONPatchOp] = []
    meta = meta_of(pod)

    # Markers first: annotations and the label the disruption watcher selects on.
    pod_annotations = {
        c.ANN_INJECTED: c.INJECTION_VERSION,
        c.ANN_POLICY: ctx.policy_name,
        c.ANN_RUN_ID: ctx.run_id,
    }
    if ctx.resume_from:
        pod_annotations[c.ANN_RESUME_FROM] = ctx.resume_from
    _merge_map(ops, "/metadata/annotations", meta.get("annotations"), pod_annotations)
    _merge_map(ops, "/metadata/labels", meta.get("labels"), {c.LABEL_INJECTED: "true"})

    # Volumes.
    volumes = _volumes(policy_spec, ctx)
    if not any(m["name"] == c.VOL_STORAGE for m in mounts):
        volumes = [v for v in volumes if v["name"] != c.VOL_STORAGE]
    _append_list(ops, "/spec/volumes", spec_obj.get("volumes"), volumes)

    # Training container: env (user values win), mounts, metrics port.
    base = f"/spec/containers/{index}"
    metrics_port = policy_spec.agent.metrics_port
    user_env = {e.get("name") for e in container.get("env") or ()}
    env = _agent_env(policy_spec, ctx, metrics_port)
    kept = [e["name"] for e in env if e["name"] in user_env]
    if kept:
        notes.append(f"kept the container's own value of {', '.join(kept)}")
    termination_log = container.get("terminationMessagePath") or TERMINATION_LOG_PATH
    if not container.get("terminationMessagePath"):
        ops.append(add(base + "/terminationMessagePath", TERMINATION_LOG_PATH))
    if not container.get("terminationMessagePolicy"):
        ops.append(add(base + "/terminationMessagePolicy", "File"))
    env.append({"name": ENV_TERMINATION_LOG, "value": termination_log})
    _append_list(
        ops, base + "/env", container.get("env"), [e for e in env if e["name"] not in user_env]
    )
    _append_list(ops, base + "/volumeMounts", container.get("volumeMounts"), mounts)
    ports = container.get("ports") or []
    if any(
        p.get("containerPort") == metrics_port or p.get("name") == c.METRICS_PORT_NAME
        for p in ports
    ):
        notes.append(
            f"container port {metrics_port} or name {c.METRICS_PORT_NAME} already declared"
        )
    else:
        _append_list(
            ops,
            base + "/ports",
            container.get("ports"),
            [{"name": c.METRICS_PORT_NAME, "containerPort": metrics_port, "protocol": "TCP"}],
        )

    grace = termination_grace(
        spec_obj.get("terminationGracePeriodSeconds"), job_annotations, policy_spec.preemption
    )
    if grace is not None:
        ops.append(add("/spec/terminationGracePeriodSeconds", grace))

    if want_sidecar:
        sc_port = _sidecar_metrics_port(metrics_port)
        own = {
            ENV_METRICS_PORT: str(sc_port),
            ENV_TERMINATION_LOG: TERMINATION_LOG_PATH,  # its own container, its own file
        }
        sc_env = [
            e if e["name"] not in own else {"name": e["name"], "value": own[e["name"]]} for e in env
        ]
        sidecar = {
            "name": c.SIDECAR_NAME,
            "image": sidecar_image,
            "restartPolicy": "Always",
            "command": list(ctx.sidecar_command),
            "env": sc_env,
            "volumeMounts": mounts,
            "ports": [
                {"name": c.SIDECAR_METRICS_PORT_NAME, "containerPort": sc_port, "protocol": "TCP"}
            ],
            "resources": dict(ctx.sidecar_resources),
            "terminationMessagePath": TERMINATION_LOG_PATH,
            "terminationMessagePolicy": "File",
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
        }
        notes += add_replication(ops, sidecar, pod, policy_spec, ctx.job)
        _append_list(ops, "/spec/initContainers", spec_obj.get("initContainers"), [sidecar])

    return InjectionResult(ops=ops, notes=tuple(notes))
