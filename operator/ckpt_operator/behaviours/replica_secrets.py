"""Issuing each replicating job's Secret from the pod webhook (``--issue-replica-secrets``).

The webhook admits a pod that replicates (its patch mounts ``ckpt-replica-<job>``,
:func:`~ckpt_operator.planners.replica_injection.mounts_replica_secret`): before the pod is
stored, :func:`issue_replica_secret` creates that Secret
(:func:`~ckpt_operator.planners.replica_secret.replica_secret`, a fresh random key) unless
it exists, so that every sidecar of the job finds it when it starts. The first pod of a job
creates it; the others find it (one create call each, answered 409). A Secret that exists
is never replaced: running sidecars hold its key. Not on a dry run.

Failing to create it never fails the admission: the pod starts, its sidecar logs
``peer replication is off: cannot read the replica secret …`` and persists as usual, and
the returned note (on the ``Injected`` Event and as an admission warning) says what to do.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any

from ckpt_operator.adapters.kube import ApiError
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.kinds.kind import JobKind
from ckpt_operator.planners.replica_secret import SECRET_KEY_HEX_DIGITS, replica_secret

__all__ = ["issue_replica_secret"]

log = logging.getLogger(__name__)


async def issue_replica_secret(deps: Deps, kind: JobKind, job: Mapping[str, Any]) -> str | None:
    """Make sure ``job``'s replica Secret exists; a note when it could not be made (None:
    created now, or there already)."""
    body = replica_secret(job, kind, secrets.token_hex(SECRET_KEY_HEX_DIGITS // 2))
    name = body["metadata"]["name"]
    api = deps.admission_api if deps.admission_api is not None else deps.api
    try:
        created = await api.create_secret(body)
    except ApiError as e:
        if e.status == 403:
            return (
                f"the operator may not create the replica Secret {name} (helm value "
                "rbac.issueReplicaSecrets); pods of this job run without peer replication "
                "until it exists (docs/replicas.md: create it by hand)"
            )
        log.warning("creating the replica Secret %s failed: %s", name, e)
        return (
            f"creating the replica Secret {name} failed ({e}); pods admitted before it "
            "exists run without peer replication"
        )
    if created:
        deps.events.emit(
            job, "Normal", "ReplicaSecretIssued", f"Secret {name} issued for peer replication"
        )
    return None
