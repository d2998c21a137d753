"""Cluster DNS for local processes: a namespace's pod and Service names → loopback pod IPs.

Pods run by :class:`ckpt_e2e.localpod.LocalPod` share this machine's network and no DNS
server answers for them. A pod on a node with a loopback pod CIDR (``create_node(pod_cidr=
"127.…")``) has its own address here (its pod IP), so a name the cluster's DNS would give
that pod can be replaced by the IP before the process sees it. :class:`PodNames` knows,
for one namespace:

* every pod with a loopback ``status.podIP``, as ``<pod>``, ``<pod>.<ns>``,
  ``<pod>.<ns>.svc`` and ``<pod>.<ns>.svc.cluster.local`` (the webhook names replica peers
  ``<pod>.<ns>.svc``);
* every Service with a selector, under the same four forms, as the IP of the first
  Running pod it selects that has one (the training-operator's ``<job>-master-0``, the
  ``MASTER_ADDR`` of a PyTorchJob's workers).

:meth:`PodNames.rewrite` replaces such a name where it stands as a whole host (not part of
a longer name or path: ``a.ns.svc:7471`` and ``x,a.ns.svc:1`` are rewritten,
``/results/a.json`` is not). Names it does not know stay as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .procs import wait_until

__all__ = ["HOST_VARIABLES", "PodNames", "host_names"]

#: Environment variables whose values name hosts (``host`` or ``host:port,…``): the ones
#: :class:`~ckpt_e2e.localpod.LocalPod` resolves for a pod with a loopback IP.
HOST_VARIABLES = frozenset({"MASTER_ADDR", "CKPT_REPLICA_PEERS"})

_HOST = re.compile(r"(?<![A-Za-z0-9_.-])([a-z0-9]([a-z0-9.-]*[a-z0-9])?)(?![A-Za-z0-9_.-])")


def host_names(name: str, namespace: str) -> list[str]:
    """The DNS names of pod or Service ``name`` in ``namespace``."""
    svc = f"{name}.{namespace}.svc"
    return [name, f"{name}.{namespace}", svc, f"{svc}.cluster.local"]


def _loopback_ip(pod: Mapping[str, Any]) -> str | None:
    ip = str((pod.get("status") or {}).get("podIP") or "")
    return ip if ip.startswith("127.") else None


def _selects(selector: Mapping[str, str], pod: Mapping[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class PodNames:
    """The names of ``namespace``'s pods and Services with loopback IPs (module doc).

    ``list_objects(kind)`` returns the ``items`` of ``pods`` or ``services`` in the
    namespace (e.g. ``lambda kind: cluster.request("GET", f"/api/v1/namespaces/{ns}/{kind}")
    ["items"]``)."""

    def __init__(
        self, namespace: str, list_objects: Callable[[str], Iterable[Mapping[str, Any]]]
    ) -> None:
        self.namespace = namespace
        self.list_objects = list_objects
        self.ips: dict[str, str] = {}

    def refresh(self) -> dict[str, str]:
        """Read the pods and Services again; returns name → IP."""
        pods = [p for p in self.list_objects("pods") if not p["metadata"].get("deletionTimestamp")]
        ips: dict[str, str] = {}
        for pod in pods:
            ip = _loopback_ip(pod)
            if ip:
                ips.update(dict.fromkeys(host_names(pod["metadata"]["name"], self.namespace), ip))
        for svc in self.list_objects("services"):
            selector = (svc.get("spec") or {}).get("selector") or {}
            chosen = [
                ip
                for p in pods
                if _selects(selector, p)
                and (p.get("status") or {}).get("phase") == "Running"
                and (ip := _loopback_ip(p))
            ]
            if chosen:
                names = host_names(svc["metadata"]["name"], self.namespace)
                ips.update({n: chosen[0] for n in names if n not in ips})
        self.ips = ips
        return ips

    def rewrite(self, text: str) -> str:
        """``text`` with every known name that stands as a whole host replaced by its IP."""
        return _HOST.sub(lambda m: self.ips.get(m.group(1), m.group(1)), text)

    def unknown(self, text: str) -> list[str]:
        """The hosts of ``host[:port],…`` ``text`` that name something of this namespace's
        (``<name>.<ns>[.svc…]``, or a bare name) and have no IP yet."""
        hosts = [part.strip().rpartition(":")[0] or part.strip() for part in text.split(",")]
        suffixes = (f".{self.namespace}", f".{self.namespace}.svc")
        return [
            h
            for h in hosts
            if h
            and h not in self.ips
            and not h[0].isdigit()
            and h != "localhost"
            and ("." not in h or h.endswith(suffixes) or h.endswith(".svc.cluster.local"))
        ]

    def resolve_env(self, env: Mapping[str, str], timeout: float) -> dict[str, str]:
        """The values of :data:`HOST_VARIABLES` in ``env`` with their names replaced by IPs;
        waits up to ``timeout`` s for a name to get one (a peer pod not Running yet), then
        leaves the names it still does not know."""
        values = {k: v for k, v in env.items() if k in HOST_VARIABLES and v}
        if not values:
            return {}

        def known() -> bool:
            self.refresh()
            return not any(self.unknown(v) for v in values.values())

        try:
            wait_until(known, timeout, "pod names resolved", interval=0.25)
        except TimeoutError:
            pass
        return {k: self.rewrite(v) for k, v in values.items()}
