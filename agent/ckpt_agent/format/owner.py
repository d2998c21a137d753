"""Who a run belongs to: ``<run-id>/OWNER.json``, written once, never rewritten.

A run folder is the unit of tenancy: the operator lists, deletes (retention,
blob GC) and restarts from a run only on behalf of the Kubernetes namespace
recorded here. The record is claimed on first sight (by the operator, for the
namespace of the first job it sees using the run; a writer may claim it too)
and is never replaced: a second claim reads back the first. The document::

    {"namespace": "team-a", "job": "llm-pretrain", "uid": "5f0c6a7e-...",
     "claimedBy": "operator", "time": 1714647737.0, "version": 1}

Only ``namespace`` decides anything; the job, its uid and the time are for
humans (which job of the namespace started the run).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ckpt_agent.errors import CheckpointFormatError, RunOwnershipError
from ckpt_agent.format.layout import loads, run_prefix
from ckpt_agent.policy.agent_config import ENV_JOB_NAME, ENV_JOB_UID, ENV_NAMESPACE
from ckpt_agent.storage import NotFoundError, Storage

__all__ = [
    "OWNER",
    "OWNER_VERSION",
    "RunOwner",
    "check_owner",
    "claim_owner",
    "owner_from_env",
    "owner_key",
    "read_owner",
]

OWNER = "OWNER.json"
OWNER_VERSION = 1
#: An owner record is a few hundred bytes; anything larger is not one.
OWNER_MAX_BYTES = 4096


@dataclass(frozen=True)
class RunOwner:
    """The namespace (and, for humans, the job) a run belongs to."""

    namespace: str
    job: str = ""
    uid: str = ""
    claimed_by: str = ""
    time: float = 0.0

    def to_bytes(self) -> bytes:
        doc = {
            "namespace": self.namespace,
            "job": self.job,
            "uid": self.uid,
            "claimedBy": self.claimed_by,
            "time": self.time,
            "version": OWNER_VERSION,
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RunOwner:
        """Parse an owner record; :class:`CheckpointFormatError` when it is not one."""
        doc = loads(data, OWNER, OWNER_MAX_BYTES)  # bounded: no deep nesting, no huge numbers
        if not isinstance(doc.get("namespace"), str):
            raise CheckpointFormatError(f"{OWNER} has no namespace")
        if not doc["namespace"]:
            raise CheckpointFormatError(f"{OWNER} has an empty namespace")
        time = doc.get("time", 0.0)
        return cls(
            namespace=doc["namespace"],
            job=str(doc.get("job", "")),
            uid=str(doc.get("uid", "")),
            claimed_by=str(doc.get("claimedBy", "")),
            time=float(time) if isinstance(time, int | float) else 0.0,
        )


def owner_key(run_id: str) -> str:
    return run_prefix(run_id) + OWNER


def read_owner(storage: Storage, run_id: str) -> RunOwner | None:
    """The run's owner; None when the run has no record (a new or a legacy run)."""
    try:
        data = storage.read(owner_key(run_id), 0, OWNER_MAX_BYTES + 1)
    except NotFoundError:
        return None
    return RunOwner.from_bytes(data)


def claim_owner(storage: Storage, run_id: str, owner: RunOwner) -> RunOwner:
    """The run's owner, claiming it for ``owner`` when it has none.

    Never replaces an existing record. Two concurrent first claims both
    write; the record read back afterwards is the one that counts (the
    caller compares it, not its own ``owner``).
    """
    existing = read_owner(storage, run_id)
    if existing is not None:
        return existing
    storage.commit(owner_key(run_id), owner.to_bytes())
    claimed = read_owner(storage, run_id)
    if claimed is None:
        raise CheckpointFormatError(f"{OWNER} of run {run_id} vanished right after it was written")
    return claimed


def owner_from_env(
    environ: Mapping[str, str] | None = None, *, claimed_by: str = "agent"
) -> RunOwner | None:
    """The owner the webhook's env names (``CKPT_NAMESPACE``, ``CKPT_JOB_NAME``,
    ``CKPT_JOB_UID``); None outside Kubernetes (no namespace)."""
    env = os.environ if environ is None else environ
    namespace = env.get(ENV_NAMESPACE, "").strip()
    if not namespace:
        return None
    return RunOwner(
        namespace,
        env.get(ENV_JOB_NAME, "").strip(),
        env.get(ENV_JOB_UID, "").strip(),
        claimed_by,
        time.time(),
    )


def check_owner(storage: Storage, run_id: str, owner: RunOwner, *, claim: bool) -> RunOwner:
    """The writer's check at start: claim the run (``claim``: one writer per run, rank 0)
    or read its owner; :class:`RunOwnershipError` when another namespace owns it."""
    found = claim_owner(storage, run_id, owner) if claim else read_owner(storage, run_id)
    if found is not None and found.namespace != owner.namespace:
        raise RunOwnershipError(
            f"run {run_id} belongs to namespace {found.namespace}, not {owner.namespace}: "
            "give this job its own run id (remove or change its ckpt.dev/run-id annotation; "
            "outside the operator: CKPT_RUN_ID)"
        )
    return found or owner
