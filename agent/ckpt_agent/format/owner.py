"""Who a run belongs to: ``<run-id>/OWNER.json``, written once, never rewritten.

A run folder is the unit of tenancy: the operator lists, deletes (retention,
blob GC) and restarts from a run only on behalf of the Kubernetes namespace
recorded here. Who writes it:

* the run's writer, when it creates the run: at start, rank 0 of a pod the
  webhook injected claims a run that has no record **and no checkpoints**
  (:func:`check_owner`); a second claim reads back the first, a record is never
  replaced;
* an administrator, for a **legacy run** (checkpoints but no record: written before
  owner records existed, or by a trainer outside Kubernetes): ``ckpt claim``
  (:func:`admin_claim`), the only writer that may also replace a record
  (``--force``).

Nobody else: the operator only reads it, and a writer that finds a legacy run
refuses to start (:class:`~ckpt_agent.errors.RunOwnershipError`: its checkpoints
may be another namespace's) until an administrator claims it. The document::

    {"namespace": "team-a", "job": "llm-pretrain", "uid": "5f0c6a7e-...",
     "claimedBy": "agent", "time": 1714647737.0, "version": 1}

Only ``namespace`` decides anything; the job, its uid, who claimed it
(``agent``, ``admin``; ``operator`` in runs it claimed before issue #28)
and the time are for humans.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ckpt_agent.errors import CheckpointFormatError, RunOwnershipError
from ckpt_agent.format.layout import loads, run_prefix, steps_prefix
from ckpt_agent.policy.agent_config import ENV_JOB_NAME, ENV_JOB_UID, ENV_NAMESPACE
from ckpt_agent.storage import NotFoundError, Storage

__all__ = [
    "OWNER",
    "OWNER_VERSION",
    "RunOwner",
    "admin_claim",
    "check_owner",
    "claim_owner",
    "has_checkpoints",
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


def has_checkpoints(storage: Storage, run_id: str) -> bool:
    """Whether anything is stored under the run's checkpoint folders (one listed key is
    enough: the listing stops there)."""
    return next(iter(storage.list(steps_prefix(run_id))), None) is not None


def legacy_message(run_id: str, namespace: str) -> str:
    """What to do about a legacy run (checkpoints, no owner record)."""
    return (
        f"run {run_id} has checkpoints but no owner record ({OWNER}: written before owner "
        "records existed, or by a trainer outside Kubernetes), so it may be another "
        "namespace's; it is not resumed, claimed or cleaned up. An administrator who knows "
        f"whose it is claims it: ckpt claim --storage <url> --run-id {run_id} --namespace "
        f"{namespace}; or give this job a new run id (ckpt.dev/run-id; outside the operator: "
        "CKPT_RUN_ID)"
    )


def check_owner(storage: Storage, run_id: str, owner: RunOwner, *, claim: bool) -> RunOwner:
    """The writer's check at start: claim a new run (``claim``: one writer per run, rank 0)
    or read its owner. :class:`RunOwnershipError` when another namespace owns it, or when
    it is a legacy run (checkpoints, no record: every rank refuses; ``ckpt claim``)."""
    found = read_owner(storage, run_id)
    if found is None:
        if has_checkpoints(storage, run_id):
            raise RunOwnershipError(legacy_message(run_id, owner.namespace))
        if claim:
            found = claim_owner(storage, run_id, owner)
    if found is not None and found.namespace != owner.namespace:
        raise RunOwnershipError(
            f"run {run_id} belongs to namespace {found.namespace}, not {owner.namespace}: "
            "give this job its own run id (remove or change its ckpt.dev/run-id annotation; "
            "outside the operator: CKPT_RUN_ID)"
        )
    return found or owner


def admin_claim(
    storage: Storage, run_id: str, owner: RunOwner, *, force: bool = False
) -> tuple[RunOwner | None, RunOwner]:
    """An administrator's claim (``ckpt claim``): ``(the record before, the record now)``.

    Claims a run with no record (legacy or new); a record naming ``owner``'s namespace is
    left as it is; one naming another namespace is replaced only with ``force``
    (:class:`RunOwnershipError` without). An unreadable record is replaced only with
    ``force`` too (:class:`~ckpt_agent.errors.CheckpointFormatError` without).
    """
    try:
        before = read_owner(storage, run_id)
    except CheckpointFormatError:
        if not force:
            raise
        before = None
    else:
        if before is not None and before.namespace == owner.namespace:
            return before, before
        if before is not None and not force:
            raise RunOwnershipError(
                f"run {run_id} belongs to namespace {before.namespace} (claimed by "
                f"{before.claimed_by or '?'}); to give it to {owner.namespace} instead, check "
                "that none of its checkpoints are the other namespace's and pass --force"
            )
        if before is None:
            return None, claim_owner(storage, run_id, owner)
    storage.commit(owner_key(run_id), owner.to_bytes())
    now = read_owner(storage, run_id)
    if now is None:
        raise CheckpointFormatError(f"{OWNER} of run {run_id} vanished right after it was written")
    return before, now
