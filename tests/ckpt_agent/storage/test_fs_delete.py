"""Deleting under the filesystem backend's root (storage.fs_delete), on descriptors."""

from __future__ import annotations

import os
from pathlib import Path

from ckpt_agent.storage.confined import ConfinedTree, close_all
from ckpt_agent.storage.fs_delete import delete_tree, prune, unlink_entry


def _tree(tmp_path: Path) -> tuple[ConfinedTree, Path]:
    root = tmp_path / "root"
    (root / "run" / "a" / "deep").mkdir(parents=True)
    (root / "run" / "a" / "deep" / "x").write_bytes(b"1")
    (root / "run" / "a" / "y").write_bytes(b"2")
    (root / "run" / "b").write_bytes(b"3")
    return ConfinedTree(root), root


def test_delete_tree_removes_matching_objects_at_any_depth_and_empty_folders(
    tmp_path: Path,
) -> None:
    tree, root = _tree(tmp_path)
    fds, _ = tree.chain(["run"])
    try:
        assert delete_tree(tree, fds[-1], ["run"], "a", fsync=False) == 2
    finally:
        close_all(fds)
    assert sorted(os.listdir(root / "run")) == ["b"]


def test_a_planted_link_is_removed_never_followed(tmp_path: Path) -> None:
    tree, root = _tree(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep")
    os.symlink(outside, root / "run" / "a" / "link")
    fds, _ = tree.chain(["run"])
    try:
        delete_tree(tree, fds[-1], ["run"], "", fsync=True)
        assert unlink_entry(tree, fds[-1], "gone", root / "run" / "gone") is False
    finally:
        close_all(fds)
    assert (outside / "precious").read_bytes() == b"keep"
    assert os.listdir(root / "run") == []


def test_prune_removes_empty_folders_up_to_the_root(tmp_path: Path) -> None:
    tree, root = _tree(tmp_path)
    (root / "run" / "a" / "deep" / "x").unlink()
    fds, _ = tree.chain(["run", "a", "deep"])
    try:
        prune(fds, ["run", "a", "deep"])
    finally:
        close_all(fds)
    assert not (root / "run" / "a" / "deep").exists()
    assert (root / "run" / "a" / "y").exists()  # a folder with an object stays
