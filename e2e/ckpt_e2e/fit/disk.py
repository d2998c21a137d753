"""A small filesystem for scenario 9: a real tmpfs where this machine lets us mount one.

As root (with CAP_SYS_ADMIN) :class:`SmallDisk` mounts a tmpfs of a few MiB: "full" is a
filler file written until the kernel says ENOSPC, "read-only" is ``mount -o remount,ro``
(EROFS from the kernel). Elsewhere it falls back to a simulation at the storage's OS
boundary (:mod:`ckpt_e2e.fit.faults` ``errors`` rules switched by a flag file) and says so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path
from typing import Any


class SmallDisk:
    """A tmpfs at ``path`` (or a simulated one); see the module doc."""

    def __init__(self, path: Path, size_mb: int = 16) -> None:
        self.path = path
        self.size_mb = size_mb
        self.real = False
        self.flag_full = path.parent / f"{path.name}.full"
        self.flag_ro = path.parent / f"{path.name}.read-only"
        self.filler = path / "filler.bin"

    def __enter__(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "fit-disk", str(self.path)],
            capture_output=True,
            text=True,
            check=False,
        )
        self.real = proc.returncode == 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
        self.writable()
        if self.real:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
            self.real = False

    @property
    def kind(self) -> str:
        return (
            f"real tmpfs ({self.size_mb} MiB, errors from the kernel)"
            if self.real
            else "simulated (errno at the storage's os boundary: mount not permitted here)"
        )

    def fault(self) -> dict[str, Any]:
        """The trainer's fault spec: nothing on a real disk, the switchable errors otherwise."""
        if self.real:
            return {}
        return {
            "errors": [
                {"errno": "ENOSPC", "op": op, "while_file": str(self.flag_full)}
                for op in ("write", "create")
            ]
            + [{"errno": "EROFS", "op": "create", "while_file": str(self.flag_ro)}]
        }

    def fill(self) -> None:
        """Use up the free space (until the kernel answers ENOSPC)."""
        if not self.real:
            self.flag_full.touch()
            return
        chunk = b"\0" * (1 << 16)
        with open(self.filler, "ab", buffering=0) as f:
            while True:
                try:
                    f.write(chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        break
                    chunk = chunk[: len(chunk) // 2]

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.flag_full.unlink()
        if self.real:
            with contextlib.suppress(FileNotFoundError, OSError):
                os.unlink(self.filler)

    def read_only(self) -> None:
        if not self.real:
            self.flag_ro.touch()
            return
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def writable(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.flag_ro.unlink()
        if self.real:
            subprocess.run(
                ["mount", "-o", "remount,rw", str(self.path)], capture_output=True, check=False
            )
