"""Issue #28: a store whose root is opened from a grant without following links (a link swapped in after the check is refused, not
followed). Real folders and symbolic links in ``tmp_path``: ``grant/`` is the anchor,
``other/`` must never be read, written or deleted through it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ckpt_agent.errors import NotFoundError, UnsafePathError
from ckpt_agent.storage.anchored import AnchoredLocalStorage
from ckpt_agent.storage.confined import ConfinedTree
from ckpt_agent.storage.options import StorageOptions

FAST = StorageOptions(fsync=False)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """``grant/`` (with ``runs/``) and ``other/`` (with a file that must stay untouched)."""
    grant, other = tmp_path / "grant", tmp_path / "other"
    (grant / "runs").mkdir(parents=True)
    other.mkdir()
    (other / "keep").write_bytes(b"other's")
    return grant.resolve(), other.resolve()


def _snapshot(root: Path) -> dict[str, bytes | str]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


# --------------------------------------------------------------------------- the store


def test_an_anchored_store_reads_writes_and_creates_its_root_below_the_grant(
    dirs: tuple[Path, Path],
) -> None:
    grant, _ = dirs
    store = AnchoredLocalStorage(grant / "runs" / "new" / "root", grant, FAST)
    assert not store.reachable()
    store.commit("r/OWNER.json", b"{}")  # creates new/root below the grant, confined
    assert store.read("r/OWNER.json") == b"{}"
    assert [i.key for i in store.list("r/")] == ["r/OWNER.json"]
    assert store.reachable()
    store.delete("r/OWNER.json")
    assert not store.exists("r/OWNER.json")


def test_the_root_must_be_the_resolved_path_below_the_anchor(dirs: tuple[Path, Path]) -> None:
    grant, other = dirs
    (grant / "escape").symlink_to(other)
    with pytest.raises(UnsafePathError, match=r"escape.*now resolves to"):
        AnchoredLocalStorage(grant / "escape", grant, FAST)  # swapped in before the open
    with pytest.raises(UnsafePathError, match="is not below"):
        AnchoredLocalStorage(other, grant, FAST)
    assert (other / "keep").read_bytes() == b"other's"


@pytest.mark.parametrize("where", ["root", "between"])
def test_a_link_swapped_in_after_the_check_is_refused_not_followed(
    dirs: tuple[Path, Path], where: str
) -> None:
    """The store was opened on a real folder; then someone who can write the grant
    replaces the root (or a folder between the grant and the root) with a link to
    ``other/``. Every later call is refused; ``other/`` is neither read, written nor
    deleted from."""
    grant, other = dirs
    root = grant / "runs" / "team" if where == "between" else grant / "runs"
    root.mkdir(exist_ok=True)
    store = AnchoredLocalStorage(root, grant, FAST)
    store.commit("run/OWNER.json", b"mine")
    planted = other / "team" if where == "between" else other
    (planted / "run").mkdir(parents=True)
    (planted / "run" / "OWNER.json").write_bytes(b"other's owner")
    before = _snapshot(other)

    shutil.rmtree(grant / "runs")  # the folder right below the grant, in both cases
    (grant / "runs").symlink_to(other)
    assert Path(os.path.realpath(root)) == planted  # what a path-based open would reach

    for call in (
        lambda: store.read("run/OWNER.json"),
        lambda: store.commit("run/OWNER.json", b"stolen"),
        lambda: store.delete("run/OWNER.json"),
        lambda: store.delete_prefix("run/"),
        lambda: list(store.list("run/")),
    ):
        with pytest.raises(UnsafePathError, match="symbolic link"):
            call()
    assert _snapshot(other) == before


def test_the_refusal_names_the_link_and_its_target(dirs: tuple[Path, Path]) -> None:
    grant, other = dirs
    tree = ConfinedTree(grant / "runs" / "x", anchor=grant)
    (grant / "runs").rmdir()
    (grant / "runs").symlink_to(other)
    with pytest.raises(UnsafePathError) as info:
        tree.open_root()
    assert str(grant / "runs") in str(info.value) and repr(str(other)) in str(info.value)


def test_a_missing_anchor_is_not_found(tmp_path: Path) -> None:
    tree = ConfinedTree(tmp_path / "gone" / "root", anchor=tmp_path / "gone")
    with pytest.raises(NotFoundError, match="no such directory"):
        tree.open_root(create=True)
    with pytest.raises(ValueError):
        ConfinedTree(tmp_path / "a", anchor=tmp_path / "b")
