"""Pod spec → local process: the pure translation of one container (no API, no processes).

What the translation means (volumes, path translation, environment, argv): the contract in
the ``ckpt_e2e.localpod`` docstring. Whatever the pod refers to in the API (ConfigMaps,
Secrets, ServiceAccount tokens) comes in through a :data:`Lookup` callback, so every
function here works on plain pod objects.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

from .errors import LocalPodError
from .procs import CONTAINER_ENV

PYTORCH_CONTAINER = "pytorch"
_PATH_CHARS = "A-Za-z0-9_.-"
#: Volume kinds whose files the harness writes (the others are plain folders).
MATERIALIZED = ("configMap", "secret", "downwardAPI", "projected")

#: ``lookup(kind, name, optional)``: data of ConfigMap (kind ``configmaps``) or Secret
#: (``secrets``) ``name``, decoded; None when it is optional and missing.
Lookup = Callable[[str, str, bool], dict[str, str] | None]
#: Volume file name → (text, mode or None).
Files = dict[str, tuple[str, int | None]]


def default_container(names: Sequence[str]) -> str:
    """``pytorch`` (what the training-operator watches) if present, else the first."""
    return PYTORCH_CONTAINER if PYTORCH_CONTAINER in names else names[0]


def is_native_sidecar(container: Mapping[str, Any]) -> bool:
    """An init container with ``restartPolicy: Always``: a native sidecar (Kubernetes
    ≥ 1.29), which runs beside the pod's containers for the pod's whole life."""
    return container.get("restartPolicy") == "Always"


def select_container(pod: Mapping[str, Any], want: str | None) -> dict[str, Any]:
    """Container ``want`` of the pod (default: :func:`default_container`): one of its
    ``containers`` or a native sidecar (:func:`is_native_sidecar`) of its ``initContainers``.
    An init container that runs to completion is refused: the harness never runs those."""
    containers = pod["spec"]["containers"]
    names = [c["name"] for c in containers]
    want = want or default_container(names)
    for c in containers:
        if c["name"] == want:
            return dict(c)
    meta = pod.get("metadata") or {}
    where = f"pod {meta.get('namespace')}/{meta.get('name')}"
    init = pod["spec"].get("initContainers") or []
    for c in init:
        if c["name"] == want:
            if is_native_sidecar(c):
                return dict(c)
            raise LocalPodError(
                f"{where}: init container {want!r} is not a native sidecar (restartPolicy: "
                "Always); the harness runs containers and native sidecars only"
            )
    raise LocalPodError(
        f"{where} has no container {want!r}: {names}"
        + (f", init containers {[c['name'] for c in init]}" if init else "")
    )


def native_sidecars(pod: Mapping[str, Any]) -> list[str]:
    """Names of the pod's native sidecars, in the order the kubelet starts them."""
    return [c["name"] for c in pod["spec"].get("initContainers") or [] if is_native_sidecar(c)]


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
    """Maps container paths (mount paths) to local paths, see ``ckpt_e2e.localpod``."""

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


# ---------------------------------------------------------------------------- downward API
def _quantity(q: str | int | float) -> Decimal:
    from kubernetes.utils import parse_quantity

    return Decimal(parse_quantity(q))  # type: ignore[no-untyped-call,unused-ignore]


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def resource_field(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """A ``resourceFieldRef`` (``limits.cpu``, ``requests.memory``, ... with ``divisor``)."""
    res = ref["resource"]
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


def _container_resource(pod: Mapping[str, Any], default: str, ref: Mapping[str, Any]) -> str:
    """A ``resourceFieldRef`` of ``ref["containerName"]`` (default: ``default``)."""
    cname = ref.get("containerName") or default
    c = next(x for x in pod["spec"]["containers"] if x["name"] == cname)
    return resource_field(c, ref)


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    """A downward-API ``fieldRef`` (``metadata.name``, ``metadata.labels['k']``, ...)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        return format_map(meta.get(path.split(".")[1]) or {})
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


def format_map(m: Mapping[str, str]) -> str:
    """The kubelet's downward-API format for labels/annotations: sorted ``k="v"`` lines."""
    return "\n".join(f"{k}={json.dumps(m[k], ensure_ascii=False)}" for k in sorted(m))


def object_data(kind: str, obj: Mapping[str, Any]) -> dict[str, str]:
    """The decoded data of a ConfigMap (``configmaps``) or Secret (``secrets``) object."""
    if kind == "secrets":
        return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
    data = dict(obj.get("data") or {})
    for k, v in (obj.get("binaryData") or {}).items():
        data[k] = base64.b64decode(v).decode(errors="replace")
    return data


# ---------------------------------------------------------------------------- environment
def env_value(
    e: Mapping[str, Any],
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    defined: Mapping[str, str],
    lookup: Lookup,
) -> str:
    """The value of one ``env`` entry (``value`` with ``$(VAR)`` expansion, or ``valueFrom``)."""
    if "valueFrom" not in e:
        return expand_vars(str(e.get("value", "")), defined)
    vf = e["valueFrom"]
    if "fieldRef" in vf:
        return field_ref(pod, vf["fieldRef"]["fieldPath"])
    if "resourceFieldRef" in vf:
        return _container_resource(pod, container["name"], vf["resourceFieldRef"])
    for key, kind in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
        if key in vf:
            ref = vf[key]
            data = lookup(kind, ref["name"], bool(ref.get("optional")))
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    return ""
                raise LocalPodError(f"{key} {ref['name']}/{ref['key']} not found")
            return data[ref["key"]]
    raise LocalPodError(f"unsupported valueFrom in env {e['name']}: {vf}")


def pod_env(pod: Mapping[str, Any], container: Mapping[str, Any], lookup: Lookup) -> dict[str, str]:
    """The container's own environment: ``envFrom``, then ``env`` in order (untranslated)."""
    out: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if "configMapRef" in src:
            ref = src["configMapRef"]
            data = lookup("configmaps", ref["name"], bool(ref.get("optional")))
        else:
            ref = src["secretRef"]
            data = lookup("secrets", ref["name"], bool(ref.get("optional")))
        for k, v in (data or {}).items():
            out[prefix + k] = v
    for e in container.get("env") or []:
        out[e["name"]] = env_value(e, pod, container, out, lookup)
    return out


def process_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    lookup: Lookup,
    paths: Mapping[str, Path],
    translator: PathTranslator,
    *,
    base: Mapping[str, str],
    api_port: str,
    extra: Mapping[str, str],
    marker: str,
) -> dict[str, str]:
    """The local process's environment, in the order the ``localpod`` contract gives
    (``paths``: every mount path → local path, exported as ``CKPT_E2E_PATH_MAP``)."""
    meta = pod["metadata"]
    translated = {k: translator.text(v) for k, v in pod_env(pod, container, lookup).items()}
    pod_ip = str((pod.get("status") or {}).get("podIP") or "")
    # A loopback pod IP is this pod's own address here: the agent listens there, so the
    # operator reaches it at the pod IP as in a cluster (a pod's own network namespace).
    own_address = (
        {"CKPT_METRICS_ADDR": pod_ip, "CKPT_REPLICA_LISTEN_HOST": pod_ip}
        if pod_ip.startswith("127.")
        else {}
    )
    return {
        **base,
        "HOSTNAME": meta["name"],
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": api_port,
        **own_address,
        **translated,
        **extra,
        CONTAINER_ENV: marker,
        "CKPT_E2E_POD_NAME": meta["name"],
        "CKPT_E2E_POD_NAMESPACE": meta["namespace"],
        "CKPT_E2E_PATH_MAP": json.dumps({k: str(v) for k, v in paths.items()}),
    }


# ---------------------------------------------------------------------------- process
def build_argv(
    container: Mapping[str, Any],
    env: Mapping[str, str],
    translator: PathTranslator,
    exe_map: Mapping[str, str],
    where: str,
) -> list[str]:
    """``command + args`` expanded and translated, ``argv[0]`` mapped by ``exe_map``."""
    command = container.get("command") or []
    if not command:
        raise LocalPodError(
            f"container {container['name']} of {where} has no "
            "command: a local run cannot use the image's entrypoint"
        )
    argv = [
        translator.text(expand_vars(str(a), env))
        for a in [*command, *(container.get("args") or [])]
    ]
    argv[0] = exe_map.get(argv[0], argv[0])
    return argv


def working_dir(
    container: Mapping[str, Any], translator: PathTranslator, pod_dir: Path
) -> Path | None:
    """The translated ``workingDir`` (None when unset)."""
    wd = container.get("workingDir")
    if not wd:
        return None
    translated = translator.text(wd)
    # an untranslated absolute container path would point anywhere on the host
    return Path(translated) if translated != wd else pod_dir / "cwd" / wd.lstrip("/")


# ---------------------------------------------------------------------------- volumes
def mount_paths(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    volume_dir: Callable[[Mapping[str, Any]], Path],
) -> dict[str, Path]:
    """``{mountPath: local path}`` of the container's mounts (``subPath`` honoured);
    ``volume_dir(volume)`` gives each volume's folder (asked once per volume)."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    local_of: dict[str, Path] = {}
    paths: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        vname = mount["name"]
        if vname not in local_of:
            local_of[vname] = volume_dir(volumes.get(vname, {"name": vname}))
        local = local_of[vname]
        if mount.get("subPath"):
            local = local / mount["subPath"]
        paths[mount["mountPath"]] = local
    return paths


def volume_files(
    kind: str,
    src: Mapping[str, Any],
    pod: Mapping[str, Any],
    container_name: str,
    lookup: Lookup,
    sa_token: Callable[[Mapping[str, Any]], str | None],
) -> Files:
    """The files of a ``configMap``/``secret``/``downwardAPI``/``projected`` volume now.

    ``sa_token(source)`` answers a projected ``serviceAccountToken`` source.
    """

    def files_of(sub_kind: str, sub: Mapping[str, Any]) -> Files:
        files: Files = {}
        if sub_kind in ("configMap", "secret"):
            ref = sub.get("name") or sub.get("secretName", "")
            data = lookup(
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
                    value = field_ref(pod, it["fieldRef"]["fieldPath"])
                else:
                    value = _container_resource(pod, container_name, it["resourceFieldRef"])
                files[it["path"]] = (value, it.get("mode"))
        elif sub_kind == "serviceAccountToken":
            token = sa_token(sub)
            if token is not None:
                files[sub["path"]] = (token, None)
        return files

    if kind == "projected":
        out: Files = {}
        for source in src.get("sources") or []:
            for sub_kind, sub in source.items():
                out.update(files_of(sub_kind, sub or {}))
        return out
    sub = dict(src)
    if kind == "secret":
        sub["name"] = src.get("secretName", "")
    return files_of(kind, sub)


def volume_uses_api(kind: str, src: Mapping[str, Any]) -> bool:
    """Whether the volume's files come from the API (configMap/secret), not the pod alone."""
    return kind in ("configMap", "secret") or (
        kind == "projected"
        and any(("configMap" in s or "secret" in s) for s in src.get("sources") or [])
    )
