"""The per-job Secret of peer replication, as the operator issues it (docs/replicas.md). Pure.

With ``--issue-replica-secrets`` the pod webhook creates it
(:mod:`ckpt_operator.behaviours.replica_secrets`) when it admits the first pod of a job
whose policy has ``spec.agent.replicas.enabled``, so that it exists before any sidecar of
the job starts and reads it: ``ckpt-replica-<job>``
(:func:`~ckpt_operator.planners.replica_injection.replica_secret_name`), type ``Opaque``,
one key ``secret`` (the random key the caller drew: 32 bytes as 64 hex digits), labelled
:data:`ISSUED_BY_LABEL`, owned by the job so that it goes when the job goes. A restart
``J-r<k>`` is a new job: it gets its own Secret, with a new key.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from typing import Any, Final

from ckpt_agent.policy.replica_contract import REPLICA_SECRET_KEY
from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.model.bodies import meta_of
from ckpt_operator.planners.replica_injection import replica_secret_name

__all__ = ["ISSUED_BY_LABEL", "SECRET_KEY_HEX_DIGITS", "replica_secret"]

ISSUED_BY_LABEL: Final = "ckpt.dev/replica-secret"
"""Label of the Secrets the operator issues (value ``issued``); the chart's admission
policy lets the operator's account create no other Secret."""
SECRET_KEY_HEX_DIGITS: Final = 64
"""32 random bytes, hex: what ``openssl rand -hex 32`` gives (docs/replicas.md)."""
_HEX = re.compile(r"[0-9a-f]+")


def replica_secret(job: Mapping[str, Any], kind: JobKind, key_hex: str) -> dict[str, Any]:
    """The Secret of ``job`` holding ``key_hex`` (its namespace, name and uid from the job).

    Raises ValueError when ``key_hex`` is not 64 lowercase hex digits or the job has no
    name, namespace or uid (an owner reference needs them)."""
    if len(key_hex) != SECRET_KEY_HEX_DIGITS or not _HEX.fullmatch(key_hex):
        raise ValueError(f"a replica key is {SECRET_KEY_HEX_DIGITS} lowercase hex digits")
    meta = meta_of(job)
    name, namespace, uid = meta.name, meta.namespace, meta.uid
    if not (name and namespace and uid):
        raise ValueError("the job needs a name, a namespace and a uid to own its Secret")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": replica_secret_name(str(name)),
            "namespace": str(namespace),
            "labels": {ISSUED_BY_LABEL: "issued", "app.kubernetes.io/managed-by": "ckpt-operator"},
            "ownerReferences": [
                {
                    "apiVersion": kind.api_version,
                    "kind": kind.kind,
                    "name": str(name),
                    "uid": str(uid),
                }
            ],
        },
        "data": {REPLICA_SECRET_KEY: base64.b64encode(key_hex.encode()).decode()},
    }
