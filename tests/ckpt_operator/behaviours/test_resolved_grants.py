"""Issue #28: grants checked on the path as storage opens it, and legacy runs left alone.

Real folders and symbolic links in ``tmp_path``: ``grant-a/`` is granted to team A,
``grant-b/`` to team B (team B's run there, owned by B), ``nobody/`` to no one. A policy
of team A naming ``grant-a/escape`` (a link to ``grant-b``) passes the grant check as
written; the operator must refuse it naming the link, and write or delete nothing
outside A's grant — in retention, in restart planning, and when a link is swapped in
after the check. A run with checkpoints and no ``OWNER.json`` is claimed by nobody but
``ckpt claim``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.errors import UnsafePathError
from ckpt_agent.format.owner import RunOwner, claim_owner, read_owner
from ckpt_agent.storage.fs import LocalStorage
from ckpt_operator.behaviours.policies import reconcile_policy
from ckpt_operator.behaviours.recovery import recover_job
from ckpt_operator.behaviours.retention import reconcile_retention
from ckpt_operator.model import constants as c
from ckpt_operator.model.config import LocalPathGrant, TenancyConfig
from ckpt_operator.model.jobs import job_facts
from ckpt_operator.planners.tenancy import (
    PathLink,
    ResolvedPath,
    grant_anchor,
    resolved_refusal,
    unclaimed_refusal,
)
from tests.ckpt_agent.storage.test_hostile_fs import tree as _tree
from tests.ckpt_operator.behaviours.test_hostile_tenancy import (
    CKPTS,
    RUN_B,
    TEAM_A,
    TEAM_B,
    _checkpoints,
    _condition,
    _deps,
    _events,
    _ids,
    _job,
    _local,
    _policy,
)

RUN_A = "llm-pretrain-a"


@pytest.fixture
def grants(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``grant-a`` (empty), ``grant-b`` (team B's owned run, three checkpoints) and
    ``nobody`` (a folder in no grant), all resolved."""
    a, b, nobody = tmp_path / "grant-a", tmp_path / "grant-b", tmp_path / "nobody"
    for d in (a, b, nobody):
        d.mkdir()
    storage = LocalStorage(b)
    _checkpoints(storage, RUN_B)
    claim_owner(storage, RUN_B, RunOwner(TEAM_B, "pretrain", "uid-b", "agent", 1.0))
    return a.resolve(), b.resolve(), nobody.resolve()


def _tenancy(a: Path, b: Path) -> TenancyConfig:
    return TenancyConfig(
        local_paths=(LocalPathGrant(TEAM_A, str(a)), LocalPathGrant(TEAM_B, str(b)))
    )


# --------------------------------------------------------------------------- pure rules


def test_resolved_refusal_rules() -> None:
    grants = ["/vol/a", "/vol/shared"]
    plain = ResolvedPath("/vol/a/runs", "/vol/a/runs")
    assert resolved_refusal("a", plain, grants) is None
    assert grant_anchor(plain, grants) == "/vol/a"
    # a link inside the grant that stays inside (or lands in another grant of the namespace)
    inside = ResolvedPath(
        "/vol/a/cur/x",
        "/vol/shared/v2/x",
        (PathLink("/vol/a/cur", "../shared/v2", "/vol/shared/v2"),),
    )
    assert resolved_refusal("a", inside, grants) is None
    assert grant_anchor(inside, grants) == "/vol/shared"
    # the link out of the grant is named: which component, what it says, where it leads
    escape = ResolvedPath("/vol/a/escape", "/vol/b", (PathLink("/vol/a/escape", "../b", "/vol/b"),))
    why = resolved_refusal("a", escape, grants)
    assert why is not None
    assert "symbolic link '/vol/a/escape'" in why and "'../b'" in why and "'/vol/b'" in why
    assert "remove the link" in why
    # a link out and a '..' back in: still refused (no link may lead out)
    back = ResolvedPath(
        "/vol/a/escape/../a/x", "/vol/a/x", (PathLink("/vol/a/escape", "/vol/b/y", "/vol/b/y"),)
    )
    assert resolved_refusal("a", back, grants) is not None
    # no link, resolved outside (a grant root that moved): refused, not anchored
    moved = ResolvedPath("/vol/a/x", "/elsewhere/x")
    assert "resolves to '/elsewhere/x'" in (resolved_refusal("a", moved, grants) or "")
    assert grant_anchor(moved, grants) is None
    # control characters in a link target are shown escaped, never raw
    hostile = ResolvedPath("/vol/a/e", "/vol/b", (PathLink("/vol/a/e", "\x1b]0;x\x07", "/vol/b"),))
    assert "\x1b" not in (resolved_refusal("a", hostile, grants) or "\x1b")
    # nested grants: the outermost holds the anchor (more of the way opened without links)
    assert (
        grant_anchor(ResolvedPath("/vol/a/b/c", "/vol/a/b/c"), ["/vol/a/b", "/vol/a"]) == "/vol/a"
    )


def test_unclaimed_refusal_rules() -> None:
    assert unclaimed_refusal("r", "ns", 0) is None  # a new run: its writer claims it
    why = unclaimed_refusal("r", "ns", 3)
    assert why is not None and "3 checkpoint(s)" in why
    assert "ckpt claim --storage <url> --run-id r --namespace ns" in why


# --------------------------------------------------------------------------- the operator


@pytest.mark.parametrize("target", ["grant-b", "nobody"])
def test_a_link_in_the_namespaces_own_grant_is_refused_and_nothing_outside_is_touched(
    world: Any, fixture: Any, grants: tuple[Path, Path, Path], target: str
) -> None:
    """The red team's case: ``local.path: <grant-a>/escape``, ``escape`` → team B's folder
    (or one in nobody's grant). Retention and restart planning refuse it naming the link;
    B's checkpoints, its owner record and the other folder are exactly as they were.

    The folder also holds a run whose ``OWNER.json`` names team A (copied there, or
    forged by whoever can write it): the owner check would let A's policy delete from it
    and restart from it, so only the grant check on the resolved path stands between."""
    a, b, nobody = grants
    where = b if target == "grant-b" else nobody
    _checkpoints(LocalStorage(where), RUN_A)
    claim_owner(LocalStorage(where), RUN_A, RunOwner(TEAM_A, "j", "u", "agent", 1.0))
    (a / "escape").symlink_to(where)
    deps = _deps(world, _tenancy(a, b))
    policy = _policy(fixture, TEAM_A, _local(a / "escape"))
    world.api.add_policy(policy)
    job = world.api.add_job(_job(fixture, TEAM_A, RUN_A))
    before = {d: _tree(d) for d in (b, nobody)}

    asyncio.run(reconcile_retention(deps, policy))
    asyncio.run(recover_job(deps, job))

    assert {d: _tree(d) for d in (b, nobody)} == before  # no delete, no OWNER.json
    cond = _condition(world, TEAM_A)
    assert (cond["status"], cond["reason"]) == ("False", "StorageAccessDenied")
    assert f"symbolic link {str(a / 'escape')!r}" in cond["message"]
    assert repr(str(where)) in cond["message"]
    (event,) = _events(world, "StorageAccessDenied")
    assert event.type == "Warning" and "escape" in event.message
    assert world.api.called("create_job") == []  # no restart from B's checkpoint
    status = job_facts(world.api.jobs[(TEAM_A, "mnist-ddp")]).status
    assert status is not None and (status.state, status.reason) == ("GaveUp", "StorageAccessDenied")
    # the policy's own StorageAccess condition agrees (it said Allowed from the path as written)
    asyncio.run(reconcile_policy(deps, world.api.policies[(TEAM_A, "llm-finetune")]))
    conditions = world.api.policies[(TEAM_A, "llm-finetune")]["status"]["conditions"]
    (access,) = [x for x in conditions if x["type"] == "StorageAccess"]
    assert (access["status"], access["reason"]) == ("False", "StorageAccessDenied")
    assert f"symbolic link {str(a / 'escape')!r}" in access["message"]
    assert {d: _tree(d) for d in (b, nobody)} == before
    assert "escape" in status.message
    assert _ids(b, RUN_B) == CKPTS and _ids(where, RUN_A) == CKPTS


def test_dotdot_never_leaves_the_grant(
    world: Any, fixture: Any, grants: tuple[Path, Path, Path]
) -> None:
    """``<grant-a>/../grant-b`` is refused as written. ``<grant-a>/hop/../grant-b`` (``hop``
    a link to a folder beside B's) is, as the pods' storage opens it, ``<grant-a>/grant-b``
    (``..`` removed as text first): the operator looks there — inside A's grant, empty —
    never in B's folder, where the kernel's own resolution would have landed."""
    a, b, _ = grants
    (b.parent / "deep").mkdir()
    (a / "hop").symlink_to(b.parent / "deep")
    before = _tree(b)
    deps = _deps(world, _tenancy(a, b))
    for path, reason in (
        (f"{a}/../grant-b", "RetentionInPods"),  # not granted as written: the pods' reports
        (f"{a}/hop/../grant-b", "RetentionInPods"),  # <grant-a>/grant-b: does not exist here
    ):
        policy = _policy(fixture, TEAM_A, {"type": "local", "local": {"path": path}})
        world.api.add_policy(policy)
        world.api.add_job(_job(fixture, TEAM_A, RUN_B))
        asyncio.run(reconcile_retention(deps, policy))
        assert _condition(world, TEAM_A)["reason"] == reason, path
    assert _tree(b) == before
    assert not (a / "grant-b").exists()


def test_a_symlink_at_the_root_of_the_grant_is_the_administrators_and_works(
    world: Any, fixture: Any, tmp_path: Path
) -> None:
    """Mounted volumes are often links: a grant whose own path is a link (and a policy
    naming a folder below it) is opened where the link leads, and retention runs."""
    real = tmp_path / "volume-a"
    _checkpoints(LocalStorage(real / "runs"), RUN_A)
    claim_owner(LocalStorage(real / "runs"), RUN_A, RunOwner(TEAM_A, "j", "u", "agent", 1.0))
    mount = tmp_path / "mnt-a"
    mount.symlink_to(real)
    deps = _deps(world, TenancyConfig(local_paths=(LocalPathGrant(TEAM_A, str(mount)),)))
    policy = _policy(fixture, TEAM_A, _local(mount / "runs"))
    world.api.add_policy(policy)
    world.api.add_job(_job(fixture, TEAM_A, RUN_A))

    asyncio.run(reconcile_retention(deps, policy))

    assert _condition(world, TEAM_A)["reason"] == "RetentionApplied"
    assert len(_ids(real / "runs", RUN_A)) < len(CKPTS)


def test_a_link_swapped_in_after_the_check_is_refused_at_use(
    world: Any, fixture: Any, grants: tuple[Path, Path, Path]
) -> None:
    """The policy names a real folder of A's grant; the operator opens (and caches) its
    storage; then whoever can write A's volume replaces the folder with a link to B's.
    The next retention pass deletes nothing of B's and claims nothing: the storage is
    opened from the grant without following links."""
    a, b, _ = grants
    (a / "runs").mkdir()
    deps = _deps(world, _tenancy(a, b))
    policy = _policy(fixture, TEAM_A, _local(a / "runs"))
    world.api.add_policy(policy)
    world.api.add_job(_job(fixture, TEAM_A, RUN_B))
    asyncio.run(reconcile_retention(deps, policy))  # checked and opened: fine, nothing there
    assert _condition(world, TEAM_A)["reason"] == "RetentionApplied"

    (a / "runs").rmdir()
    (a / "runs").symlink_to(b)  # what a path-based open would now reach: B's run
    before = _tree(b)
    asyncio.run(reconcile_retention(deps, policy))

    assert _tree(b) == before
    cond = _condition(world, TEAM_A)
    assert cond["reason"] == "StorageErrors" and "symbolic link" in cond["message"]

    # restart planning on the same (cached) storage: refused, never planned from B's run
    job = world.api.jobs[(TEAM_A, "mnist-ddp")]
    with pytest.raises(UnsafePathError, match="symbolic link"):
        asyncio.run(recover_job(deps, job))
    assert world.api.called("create_job") == []
    assert _tree(b) == before


# --------------------------------------------------------------------------- legacy runs


def test_a_legacy_run_is_claimed_by_nobody_but_an_administrator(
    world: Any, fixture: Any, tmp_path: Path
) -> None:
    """Team B's run predates owner records; one storage root granted to every namespace.
    Team A's retention and restart leave it alone (no delete, no restart, no OWNER.json),
    and so do team B's own, until an administrator claims it with ``ckpt claim``."""
    root = tmp_path / "legacy"
    _checkpoints(LocalStorage(root), RUN_B)  # written before owner records existed
    deps = _deps(world, TenancyConfig(local_paths=(LocalPathGrant("*", str(root)),)))
    before = _tree(root)
    for ns in (TEAM_A, TEAM_B):
        policy = _policy(fixture, ns, _local(root))
        world.api.add_policy(policy)
        job = world.api.add_job(_job(fixture, ns, RUN_B))
        asyncio.run(reconcile_retention(deps, policy))
        asyncio.run(recover_job(deps, job))
        cond = _condition(world, ns)
        assert cond["reason"] == "StorageErrors" and "no owner record" in cond["message"]
        status = job_facts(world.api.jobs[(ns, "mnist-ddp")]).status
        assert status is not None and (status.state, status.reason) == (
            "GaveUp",
            "LegacyRunUnclaimed",
        )
        assert f"ckpt claim --storage <url> --run-id {RUN_B} --namespace {ns}" in status.message
    assert _tree(root) == before  # nothing deleted, no OWNER.json written
    assert read_owner(LocalStorage(root), RUN_B) is None
    assert world.api.called("create_job") == []
    warnings = _events(world, "LegacyRunUnclaimed")
    assert len(warnings) == 2 and all(e.type == "Warning" for e in warnings)

    # the administrator's action
    result = CliRunner().invoke(
        app,
        ["claim", "--storage", str(root), "--run-id", RUN_B, "--namespace", TEAM_B],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    owner = read_owner(LocalStorage(root), RUN_B)
    assert owner is not None and owner.namespace == TEAM_B and owner.claimed_by.startswith("admin")

    # now B's retention applies to it, and A is refused as for any run of another namespace
    asyncio.run(reconcile_retention(deps, world.api.policies[(TEAM_B, "llm-finetune")]))
    assert _condition(world, TEAM_B)["reason"] == "RetentionApplied"
    assert len(_ids(root, RUN_B)) < len(CKPTS)
    asyncio.run(reconcile_retention(deps, world.api.policies[(TEAM_A, "llm-finetune")]))
    assert f"belongs to namespace {TEAM_B}" in _condition(world, TEAM_A)["message"]
    fresh = _job(fixture, TEAM_B, RUN_B)
    fresh["metadata"]["name"] = "second"
    fresh["metadata"]["uid"] = "0d0e0f00-0000-4000-8000-000000000002"
    job_b = world.api.add_job(fresh)
    asyncio.run(recover_job(deps, job_b))
    assert world.api.called("create_job") == ["second-r1"]  # B restarts from its own run
    created = world.api.jobs[(TEAM_B, "second-r1")]
    assert created["metadata"]["annotations"][c.ANN_RESUME_FROM] in CKPTS


def test_a_new_run_is_not_legacy(world: Any, fixture: Any, tmp_path: Path) -> None:
    """No record and no checkpoints: a run whose writer has not started yet. The operator
    claims nothing (the writer does) and restarts the job from scratch."""
    root = tmp_path / "fresh"
    root.mkdir()
    deps = _deps(world, TenancyConfig(local_paths=(LocalPathGrant("*", str(root)),)))
    policy = _policy(fixture, TEAM_A, _local(root))
    world.api.add_policy(policy)
    job = world.api.add_job(_job(fixture, TEAM_A, "brand-new"))
    asyncio.run(reconcile_retention(deps, policy))
    assert _condition(world, TEAM_A)["reason"] == "RetentionApplied"
    asyncio.run(recover_job(deps, job))
    status = job_facts(world.api.jobs[(TEAM_A, "mnist-ddp")]).status
    assert status is None or status.reason != "LegacyRunUnclaimed"
    assert not (root / "brand-new" / "OWNER.json").exists()
    assert json.dumps(_tree(root)) == "{}"
