"""``ckpt claim``: the administrator's action that gives a run (a legacy one: checkpoints,
no OWNER.json) to a namespace (issue #28)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.format.owner import RunOwner, claim_owner, owner_key, read_owner
from ckpt_agent.storage.fs import LocalStorage

runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return res.exit_code, res.output


def _store(tmp_path: Path) -> LocalStorage:
    storage = LocalStorage(tmp_path / "store")
    storage.commit("legacy/steps/full_step_000000000010/COMMIT", b"{}")
    storage.commit("owned/steps/full_step_000000000010/COMMIT", b"{}")
    claim_owner(storage, "owned", RunOwner("team-b", claimed_by="agent"))
    return storage


def test_help_teaches_what_a_legacy_run_is_and_what_force_does() -> None:
    code, out = _invoke("claim", "--help")
    assert code == 0
    text = " ".join(out.split())
    for phrase in ("legacy run", "OWNER.json", "--namespace", "--force", "never does"):
        assert phrase in text, phrase
    code, out = _invoke("--help")
    assert code == 0 and "claim" in out


def test_without_a_run_it_lists_runs_and_their_owners_legacy_first(tmp_path: Path) -> None:
    storage = _store(tmp_path)
    code, out = _invoke("claim", "--storage", str(storage.root))
    assert code == 0, out
    assert out.index("legacy") < out.index("owned") and "team-b" in out
    assert "1 legacy run(s)" in out


def test_claim_a_legacy_run_then_refuse_another_namespace_without_force(tmp_path: Path) -> None:
    storage = _store(tmp_path)
    root = str(storage.root)
    code, out = _invoke("claim", "-s", root, "-r", "legacy", "-n", "team-a", "--job", "train")
    assert code == 0, out
    assert "claimed run legacy for namespace team-a (a legacy run; 1 checkpoint(s))" in " ".join(
        out.split()
    )
    owner = read_owner(storage, "legacy")
    assert owner is not None and (owner.namespace, owner.job) == ("team-a", "train")
    assert owner.claimed_by.startswith("admin ")
    code, out = _invoke("claim", "-s", root, "-r", "legacy", "-n", "team-a")
    assert code == 0 and "already belongs to namespace team-a" in out
    code, out = _invoke("claim", "-s", root, "-r", "owned", "-n", "team-a")
    assert code == 1 and "--force" in out and "nothing was written" in out
    assert read_owner(storage, "owned").namespace == "team-b"  # type: ignore[union-attr]
    code, out = _invoke("claim", "-s", root, "-r", "owned", "-n", "team-a", "--force")
    assert code == 0 and "moved from namespace team-b to team-a" in " ".join(out.split())
    assert read_owner(storage, "owned").namespace == "team-a"  # type: ignore[union-attr]


def test_bad_input_and_hostile_records(tmp_path: Path) -> None:
    storage = _store(tmp_path)
    root = str(storage.root)
    code, out = _invoke("claim", "-s", root, "-r", "legacy", "-n", "Team_A")
    assert code == 2 and "not a Kubernetes namespace name" in out
    code, out = _invoke("claim", "-s", root, "-r", "../x", "-n", "team-a")
    assert code == 2
    code, out = _invoke("claim", "-s", root, "-r", "legacy", "-n", "team-a", "--job", "j" * 5000)
    assert code == 2 and "at most 253" in out
    assert read_owner(storage, "legacy") is None
    storage.commit(owner_key("bad"), b"<html>")
    code, out = _invoke("claim", "-s", root, "-r", "bad", "-n", "team-a")
    assert code == 5 and "--force" in out
    code, _ = _invoke("claim", "-s", root, "-r", "bad", "-n", "team-a", "--force")
    assert code == 0
    # a forged owner namespace with terminal escapes is shown escaped
    storage.commit("evil/steps/full_step_000000000010/COMMIT", b"{}")
    storage.commit(owner_key("evil"), json.dumps({"namespace": "x\x1b]0;pwned\x07"}).encode())
    code, out = _invoke("claim", "-s", root)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
