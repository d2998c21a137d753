"""Deleting under the filesystem backend's root without following a link.

:func:`delete_tree` removes the objects of a folder whose names start with a
prefix, at any depth, and the folders left empty; a link met on the way is
removed as a link (:func:`unlink_entry`), never followed; :func:`prune`
removes the empty folders above a deleted key. Folders are descriptors opened
by :class:`~ckpt_agent.storage.confined.ConfinedTree`; what confinement is and
why: :mod:`ckpt_agent.storage.fs`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as stat_mod
from collections.abc import Sequence
from pathlib import Path

from ckpt_agent.errors import NotFoundError, UnsafePathError
from ckpt_agent.storage.base import TEMP_PREFIX
from ckpt_agent.storage.confined import ConfinedTree, kind_of
from ckpt_agent.text import clean

__all__ = ["delete_tree", "prune", "unlink_entry"]

log = logging.getLogger(__name__)


def delete_tree(
    tree: ConfinedTree, fd: int, parts: list[str], name_prefix: str, *, fsync: bool
) -> int:
    """Delete the objects in folder ``fd`` whose names start with ``name_prefix``, at
    any depth, and the folders left empty; links are removed, never followed."""
    directory = tree.root.joinpath(*parts)
    n = 0
    removed = False
    try:
        names = sorted(os.listdir(fd))
    except OSError as e:
        raise tree.error(e, "listing", directory) from e
    for name in names:
        if not name.startswith(name_prefix) or name.startswith(TEMP_PREFIX):
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise tree.error(e, "stat", directory / name) from e
        if not stat_mod.S_ISDIR(st.st_mode):
            if unlink_entry(tree, fd, name, directory / name):
                removed = True
                n += stat_mod.S_ISREG(st.st_mode)
            continue
        try:
            sub, _ = tree.subdir(fd, name, directory / name)
        except NotFoundError:
            continue
        except UnsafePathError:  # became a link after the stat: remove the link
            removed |= unlink_entry(tree, fd, name, directory / name)
            continue
        try:
            n += delete_tree(tree, sub, [*parts, name], "", fsync=fsync)
        finally:
            os.close(sub)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=fd)
            removed = True
    if removed and fsync:
        tree.fsync_fd(fd, directory)
    return n


def unlink_entry(tree: ConfinedTree, fd: int, name: str, path: Path) -> bool:
    """Remove the entry ``name`` of folder ``fd`` (a link itself, never its target)."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        os.unlink(name, dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False
    except OSError as e:
        raise tree.error(e, "deleting", path) from e
    if not stat_mod.S_ISREG(st.st_mode):
        log.warning(
            "removed %s, a %s planted in the store (not an object; a link's target is left alone)",
            clean(path),
            kind_of(st.st_mode),
        )
    return True


def prune(fds: Sequence[int], parts: Sequence[str]) -> None:
    """Remove the now-empty folders ``parts`` (``fds`` is their chain from the root),
    deepest first, up to (not including) the root."""
    for i in range(len(parts) - 1, -1, -1):
        try:
            os.rmdir(parts[i], dir_fd=fds[i])
        except OSError:
            return
