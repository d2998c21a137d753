"""The replica store's files on disk: names, folder listing and removal (links never followed).

The layout itself is documented in :mod:`.store`. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path
from typing import Final

__all__ = ["DATA", "DESC", "HASHES", "remove", "snapshot_folders", "subdirs"]

DATA: Final = "data"
DESC: Final = "descriptor.json"
"""Exists ⇔ the folder holds a complete replica (renamed into place last)."""
HASHES: Final = "hashes.json"


def subdirs(path: Path) -> list[Path]:
    """Real folders in ``path``, by name (links are never followed)."""
    out = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                out.append(Path(entry.path))
    return sorted(out)


def snapshot_folders(rank_dir: Path, *, complete: bool) -> list[Path]:
    """The snapshot folders of one (source, rank): incomplete ones first (unless
    ``complete``), then complete ones, oldest publication first."""
    found: list[tuple[int, Path]] = []
    for p in subdirs(rank_dir):
        if not p.name.startswith("seq_"):
            continue
        try:
            when = os.lstat(p / DESC).st_mtime_ns
        except FileNotFoundError:
            if complete:
                continue
            when = -1
        found.append((when, p))
    return [p for _, p in sorted(found)]


def remove(path: Path) -> None:
    """Remove a snapshot folder (a link in its place is left alone: never followed)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
