"""An ``OWNER.json`` namespace with terminal escapes, a bidi override and newlines (issue #28):
it reached a 3,252-character Event and a status condition raw. Every Event and condition the
behaviours write goes through the one sanitizer: one bounded line, escapes spelled out."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from ckpt_agent.format.layout import validation_key
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.owner import OWNER_MAX_BYTES, owner_key
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.text import EVENT_LIMIT, STATUS_LIMIT
from ckpt_operator.adapters.sources import StorageSourceFactory
from ckpt_operator.behaviours.deps import Deps
from ckpt_operator.behaviours.recovery import recover_job
from ckpt_operator.behaviours.retention import reconcile_retention
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import LocalPathGrant, OperatorConfig, TenancyConfig

RUN = "llm-pretrain-b"
TEAM_A = "ml-team"
#: A colour, an OSC window title ended by BEL, a screen clear, a newline and a forged second
#: line, a right-to-left override, a line separator; padded to the owner record's limit.
EVIL = "team-b\x1b[31m\x1b]0;pwned\x07\x1b[2J\nWarning Forged: all good\u202eevil\u2028"
RAW = ("\x1b", "\x07", "\n", "\u202e", "\u2028")


def _raw(text: str) -> list[str]:
    return [c for c in RAW if c in text]


def _store(root: Path) -> None:
    """One valid checkpoint of ``RUN``, owned by the hostile namespace."""
    storage = LocalStorage(root)
    writer = CheckpointWriter(storage, RUN)
    meta = CheckpointMeta(run_id=RUN, step=100, tier=Tier.FULL, created_at=1000.0)
    data = memoryview((100).to_bytes(8, "little"))
    done = writer.commit(
        meta, [writer.write_rank(meta, 0, {}, [TensorSource("w", "uint8", (8,), data)])]
    )
    verdict = ValidationVerdict(meta.checkpoint_id, done.manifest_hash, CheckpointStatus.VALID)
    storage.commit(validation_key(RUN, meta.checkpoint_id), verdict.to_bytes())
    doc = {"namespace": EVIL, "job": "j\x1b[2J", "version": 1}
    doc["namespace"] = EVIL + "n" * (OWNER_MAX_BYTES - 200 - len(json.dumps(doc)))
    storage.commit(owner_key(RUN), json.dumps(doc).encode())


def _deps(world: Any, root: Path) -> Deps:
    tenancy = TenancyConfig(local_paths=(LocalPathGrant("*", str(root)),))
    factory = StorageSourceFactory(world.api.get_secret_data, gc_grace_s=0.0, tenancy=tenancy)
    return Deps(
        api=world.api,
        events=world.events,
        metrics=world.metrics,
        sources=factory,
        config=OperatorConfig(tenancy=tenancy),
        clock=world.clock,
    )


def _setup(world: Any, fixture: Any, root: Path) -> dict[str, Any]:
    _store(root)
    policy: dict[str, Any] = fixture("checkpointpolicy.json")
    policy["metadata"]["namespace"] = TEAM_A
    policy["spec"]["storage"] = {"type": "local", "local": {"path": str(root)}}
    world.api.add_policy(policy)
    job: dict[str, Any] = fixture("pytorchjob_failed.json")
    job["metadata"]["namespace"] = TEAM_A
    job["metadata"]["annotations"][c.ANN_RUN_ID] = RUN
    world.api.add_job(job)
    return policy


def test_a_hostile_owner_namespace_reaches_events_and_conditions_escaped(
    world: Any, fixture: Any, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    policy = _setup(world, fixture, root)
    deps = _deps(world, root)

    asyncio.run(reconcile_retention(deps, policy))
    asyncio.run(recover_job(deps, world.api.jobs[(TEAM_A, "mnist-ddp")]))

    conditions = [
        cond
        for p in world.api.policies.values()
        for cond in p.get("status", {}).get("conditions", [])
    ]
    quoting = [x for x in conditions if "team-b" in x["message"]]
    assert quoting, conditions  # control: the namespace is quoted ...
    for cond in conditions:  # ... escaped, on one bounded line
        assert _raw(cond["message"]) == [] and len(cond["message"]) <= STATUS_LIMIT
    assert any("team-b\\x1b[31m\\x1b]0;pwned\\x07" in x["message"] for x in quoting)
    events = [e for e in world.events.events if "team-b" in e.message]
    assert events, world.events.events
    for e in world.events.events:
        assert _raw(e.message) == [] and _raw(e.reason) == [] and len(e.message) <= EVENT_LIMIT
    assert any("\\nWarning Forged: all good\\u202eevil\\u2028" in e.message for e in events)
