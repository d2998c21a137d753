"""Issue #28: a policy's local path resolved as the storage opens it (``..`` removed as
text, then links resolved), with every symbolic link on the way reported. Real folders and
links in ``tmp_path``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_operator.adapters.sources import resolve_path
from ckpt_operator.planners.tenancy import PathLink, ResolvedPath


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """``grant/`` (with ``runs/``) and ``other/``."""
    grant, other = tmp_path / "grant", tmp_path / "other"
    (grant / "runs").mkdir(parents=True)
    other.mkdir()
    return grant.resolve(), other.resolve()


def test_resolve_path_reports_each_link_as_written_and_where_it_leads(
    dirs: tuple[Path, Path],
) -> None:
    grant, other = dirs
    (grant / "escape").symlink_to(other)
    (grant / "inner").symlink_to(grant / "runs")
    assert resolve_path(str(grant / "runs" / "x")) == ResolvedPath(
        str(grant / "runs" / "x"), str(grant / "runs" / "x")
    )
    got = resolve_path(str(grant / "escape" / "sub"))
    assert got.resolved == str(other / "sub")
    assert got.links == (PathLink(str(grant / "escape"), str(other), str(other)),)
    inner = resolve_path(str(grant / "inner"))
    assert inner.resolved == str(grant / "runs") and len(inner.links) == 1


def test_dotdot_is_removed_as_text_first_as_the_store_does(dirs: tuple[Path, Path]) -> None:
    """``LocalStorage`` (the pods' agents) opens ``abspath(path)``: ``grant/hop/../runs`` is
    ``grant/runs`` for it, whatever ``hop`` points to; the resolution agrees (the operator
    must judge the folder the pods write, not the one the kernel would reach through
    ``hop``)."""
    grant, other = dirs
    (other / "deep").mkdir()
    (grant / "hop").symlink_to(other / "deep")
    got = resolve_path(str(grant / "hop" / ".." / "runs"))
    assert got.resolved == str(grant / "runs") and got.links == ()
    assert os.path.realpath(got.written) != got.resolved  # the kernel would differ
    with pytest.raises(ValueError, match="not an absolute path"):
        resolve_path("relative/path")


def test_a_missing_tail_ends_the_walk(dirs: tuple[Path, Path]) -> None:
    grant, _ = dirs
    got = resolve_path(str(grant / "new" / "deeper"))
    assert got == ResolvedPath(got.written, str(grant / "new" / "deeper"))
